"""``Timing``: everything :func:`simddp.simulate` needs to know to keep virtual time."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from fakepg.arguments import integer, number

from . import faults as _faults
from .models import ComputeModel, Network, NetworkModel

__all__ = ["Timing"]


def _default_network() -> Network:
    return Network.preset("gloo-loopback")


def _default_compute() -> ComputeModel:
    from .models import Compute  # when a Timing needs it: the compute models import torch

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
    network_jitter: the jitter of collectives' times alone (``None``: ``jitter``).
    faults: :func:`simddp.faults.slow_rank` / :func:`~simddp.faults.slow_link` faults, each
        from a virtual time (see :mod:`simddp.faults`).

    :meth:`token` writes the perturbable part (rank_speed, jitter, network_jitter, seed,
    faults) as one string; :meth:`with_token` puts it back on a base timing: that is how
    :func:`simddp.explore` replays a timing it found.
    """

    network: NetworkModel = field(default_factory=_default_network)
    compute: ComputeModel = field(default_factory=_default_compute)
    rank_speed: Mapping[int, float] = field(default_factory=dict)
    jitter: float = 0.0
    timeout: float | datetime.timedelta | None = None
    seed: int | None = None
    network_jitter: float | None = None
    faults: Sequence[Any] = ()

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
        if number("Timing.jitter", self.jitter, minimum=0,
                  hint="a relative standard deviation, e.g. 0.05 for 5 %") > 1:
            raise ValueError(f"Timing.jitter must be a relative standard deviation from 0 to 1 "
                             f"(100 %), got {self.jitter!r}")
        if self.timeout is not None:
            secs = self.timeout_seconds
            if not math.isfinite(secs) or secs <= 0:
                raise ValueError(f"Timing.timeout must be > 0 seconds (or a timedelta), "
                                 f"got {self.timeout!r}")
        if self.seed is not None:
            integer("Timing.seed", self.seed, minimum=0, hint="or None: simulate's seed")
        if self.network_jitter is not None:
            if number("Timing.network_jitter", self.network_jitter, minimum=0,
                      hint="a relative standard deviation, or None: the same as jitter") > 1:
                raise ValueError(f"Timing.network_jitter must be a relative standard deviation "
                                 f"from 0 to 1 (100 %), got {self.network_jitter!r}")
        self.faults = _faults.check(self.faults)

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

    @property
    def net_jitter(self) -> float:
        """The jitter of collectives' times (``network_jitter``, else ``jitter``)."""
        return float(self.jitter if self.network_jitter is None else self.network_jitter)

    # -- replay tokens -----------------------------------------------------------------------
    def token(self) -> str:
        """The perturbable fields (rank_speed, jitter, network_jitter, seed, faults) as a
        replay token ``"sd1:..."``; network, compute and timeout are not in it.

        >>> from simddp import faults
        >>> t = Timing(rank_speed={1: 0.5}, faults=[faults.slow_link(0, 1, 3.0, at=0.25)])
        >>> back = Timing().with_token(t.token())
        >>> back.rank_speed, back.faults == t.faults
        ({1: 0.5}, True)
        """
        flt = []
        for f in self.faults:
            until = None if f.until == math.inf else f.until
            if isinstance(f, _faults.SlowRank):
                flt.append(["rank", f.rank, f.factor, f.at, until])
            else:
                flt.append(["link", f.a, f.b, f.factor, f.at, until])
        doc = {"s": sorted([int(r), float(v)] for r, v in self.rank_speed.items()),
               "j": float(self.jitter), "n": self.network_jitter, "seed": self.seed, "f": flt}
        raw = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        return "sd1:" + base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode().rstrip("=")

    def with_token(self, token: str) -> "Timing":
        """This timing with the perturbable fields of ``token`` (from :meth:`token`)."""
        if not isinstance(token, str) or not token.startswith("sd1:"):
            raise ValueError(f"Timing.with_token: {token!r} is not a simddp timing token "
                             f"(they start with 'sd1:'; fakepg's schedule tokens are for "
                             f"fakepg.spawn(schedule=...))")
        body = token[4:]
        try:
            raw = zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            doc = json.loads(raw)
            flt: list[Any] = []
            for f in doc["f"]:
                if f[0] == "rank":
                    flt.append(_faults.slow_rank(f[1], f[2], at=f[3], until=f[4]))
                else:
                    flt.append(_faults.slow_link(f[1], f[2], f[3], at=f[4], until=f[5]))
            return dataclasses.replace(
                self, rank_speed={int(r): float(v) for r, v in doc["s"]}, jitter=doc["j"],
                network_jitter=doc["n"], seed=doc["seed"], faults=tuple(flt))
        except (binascii.Error, zlib.error, ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"Timing.with_token: {token[:40]!r}... is damaged ({e})") from None

    def deviations(self, base: "Timing") -> list[str]:
        """How this timing's perturbable fields differ from ``base``'s, one line each."""
        out = []
        for r in sorted(set(self.rank_speed) | set(base.rank_speed)):
            if self.speed(r) != base.speed(r):
                out.append(f"rank {r} {base.speed(r) / self.speed(r):g}x slower"
                           if self.speed(r) < base.speed(r) else f"rank {r} at speed {self.speed(r):g}")
        if self.jitter != base.jitter:
            out.append(f"jitter {self.jitter:g} (base {base.jitter:g})")
        if self.network_jitter != base.network_jitter and self.net_jitter != base.net_jitter:
            out.append(f"network jitter {self.net_jitter:g} (base {base.net_jitter:g})")
        if self.seed != base.seed:
            out.append(f"noise seed {self.seed}")
        out += [f.describe() for f in self.faults if f not in base.faults]
        return out
