"""``Timing``: everything :func:`simddp.simulate` needs to know to keep virtual time."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from fakepg.arguments import integer, number

from .models import Compute, ComputeModel, Network, NetworkModel

__all__ = ["Timing"]


def _default_network() -> Network:
    return Network.preset("gloo-loopback")


def _default_compute() -> Compute:
    return Compute.roofline("cpu")


@dataclass
class Timing:
    """How long things take in a simulated run.

    network: a :class:`~simddp.models.NetworkModel` such as :class:`~simddp.Network` (default
        ``Network.preset("gloo-loopback")``); a collective lasts
        ``network.collective_time(op, bytes, group size)``.
    compute: a :class:`~simddp.models.ComputeModel` such as :class:`~simddp.Compute` (default
        ``Compute.roofline("cpu")``); every aten op a rank runs costs
        ``compute.op_time(func, args, kwargs, out)``.
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

    network: NetworkModel = field(default_factory=_default_network)
    compute: ComputeModel = field(default_factory=_default_compute)
    rank_speed: Mapping[int, float] = field(default_factory=dict)
    jitter: float = 0.0
    timeout: float | datetime.timedelta | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.network, NetworkModel):
            raise TypeError(f"Timing.network must be a network model: a simddp.Network, or "
                            f"anything with name, gpus_per_node, collective_time(op, nbytes, "
                            f"nranks) and describe() (simddp.models.NetworkModel), "
                            f"got {self.network!r}")
        if not isinstance(self.compute, ComputeModel):
            raise TypeError(f"Timing.compute must be a simddp.Compute (something with "
                            f"op_time(func, args, kwargs, out)), got {self.compute!r}; "
                            f"e.g. Compute.roofline('cpu') or Compute.constant(1e-5)")
        speeds = dict(self.rank_speed or {})
        for rank, factor in speeds.items():
            integer("Timing.rank_speed: a key", rank, minimum=0, hint="keys are ranks")
            number(f"Timing.rank_speed[{rank}]", factor, positive=True,
                   hint="a speed factor, 0.5 = half speed")
        self.rank_speed = speeds
        number("Timing.jitter", self.jitter, minimum=0,
               hint="a relative standard deviation, e.g. 0.05 for 5 %")
        if self.timeout is not None:
            secs = self.timeout_seconds
            if not math.isfinite(secs) or secs <= 0:
                raise ValueError(f"Timing.timeout must be > 0 seconds (or a timedelta), "
                                 f"got {self.timeout!r}")
        if self.seed is not None:
            integer("Timing.seed", self.seed, minimum=0, hint="or None: simulate's seed")

    @property
    def timeout_seconds(self) -> float | None:
        """``timeout`` in seconds (None when the group's timeout applies)."""
        t: Any = self.timeout
        if t is None:
            return None
        if isinstance(t, datetime.timedelta):
            return t.total_seconds()
        return number("Timing.timeout", t, positive=True, hint="seconds, or a timedelta")

    def speed(self, rank: int) -> float:
        return float(self.rank_speed.get(rank, 1.0))
