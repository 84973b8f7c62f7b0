"""``Timing``: everything :func:`simddp.simulate` needs to know to keep virtual time."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .compute import Compute
from .network import Network

__all__ = ["Timing"]


def _default_network() -> Network:
    return Network.preset("gloo-loopback")


def _default_compute() -> Compute:
    return Compute.roofline("cpu")


@dataclass
class Timing:
    """How long things take in a simulated run.

    network: a :class:`~simddp.Network` (default ``Network.preset("gloo-loopback")``); a
        collective lasts ``network.collective_time(op, bytes, group size)``.
    compute: a :class:`~simddp.Compute` (default ``Compute.roofline("cpu")``); every aten op
        a rank runs costs ``compute.op_time(func, args, kwargs, out)``.
    rank_speed: ``{rank: factor}``; a rank at 0.5 runs at half speed (its ops take twice as
        long). Ranks not named run at 1.0. Collectives are not affected.
    jitter: relative standard deviation of the noise on each op's time and on each
        collective's time (a mean-1 log-normal factor), drawn from numpy Generators seeded
        from (seed, rank) and (seed, "network"): reruns with one seed are identical.
    timeout: per-collective timeout in virtual seconds (or a ``timedelta``); ``None`` uses
        the process group's own timeout (30 minutes unless ``new_group(timeout=...)`` says
        otherwise).
    seed: the jitter seed; ``None`` uses the seed passed to :func:`simddp.simulate` (which
        also seeds the ranks' RNGs). Set it to vary the noise alone.
    """

    network: Network = field(default_factory=_default_network)
    compute: Compute = field(default_factory=_default_compute)
    rank_speed: Mapping[int, float] = field(default_factory=dict)
    jitter: float = 0.0
    timeout: float | datetime.timedelta | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not hasattr(self.network, "collective_time"):
            raise TypeError(f"Timing.network must be a simddp.Network (something with "
                            f"collective_time(op, nbytes, nranks)), got {self.network!r}")
        if not hasattr(self.compute, "op_time"):
            raise TypeError(f"Timing.compute must be a simddp.Compute (something with "
                            f"op_time(func, args, kwargs, out)), got {self.compute!r}; "
                            f"e.g. Compute.roofline('cpu') or Compute.constant(1e-5)")
        speeds = dict(self.rank_speed or {})
        for rank, factor in speeds.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ValueError(f"Timing.rank_speed keys must be ranks (ints >= 0), got {rank!r}")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                    or not math.isfinite(factor) or factor <= 0:
                raise ValueError(f"Timing.rank_speed[{rank}] must be a finite speed factor > 0 "
                                 f"(0.5 = half speed), got {factor!r}")
        self.rank_speed = speeds
        if isinstance(self.jitter, bool) or not isinstance(self.jitter, (int, float)) \
                or not math.isfinite(self.jitter) or self.jitter < 0:
            raise ValueError(f"Timing.jitter must be a relative standard deviation >= 0 "
                             f"(e.g. 0.05 for 5 %), got {self.jitter!r}")
        if self.timeout is not None:
            secs = self.timeout_seconds
            if not math.isfinite(secs) or secs <= 0:
                raise ValueError(f"Timing.timeout must be > 0 seconds (or a timedelta), "
                                 f"got {self.timeout!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ValueError(f"Timing.seed must be an int >= 0 or None, got {self.seed!r}")

    @property
    def timeout_seconds(self) -> float | None:
        """``timeout`` in seconds (None when the group's timeout applies)."""
        t: Any = self.timeout
        if t is None:
            return None
        if isinstance(t, datetime.timedelta):
            return t.total_seconds()
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ValueError(f"Timing.timeout must be seconds or a timedelta, got {t!r}")
        return float(t)

    def speed(self, rank: int) -> float:
        return float(self.rank_speed.get(rank, 1.0))
