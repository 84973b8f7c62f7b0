"""The what-if knobs of a replay, as one frozen object that travels from the CLI to the engines.

:class:`Knobs` holds every choice that changes a replay's result (world layout, DDP's buckets
and comm hook, stragglers and jitter, averaging periods, uneven inputs, the parallelism and
its own knobs); :meth:`Knobs.checked` validates them against the world and the network and
returns what the planners use. Options that never change a result (which engine, per-rank
simulation, progress display) are arguments of :func:`simddp.replay.replay`, not knobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from fakepg.arguments import integer, number

from ..models import NetworkModel

__all__ = ["Knobs", "CheckedKnobs", "Config", "COMM_HOOKS"]

COMM_HOOKS = (None, "allreduce", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class Knobs:
    """Every knob of a replay (see :mod:`simddp.replay` for what each models).

    DDP: ``bucket_cap_mb``, ``first_bucket_mb``, ``comm_hook`` (:data:`COMM_HOOKS`),
    ``powersgd_rank``, ``localsgd_period`` / ``slowmo_period``, ``uneven`` (rank → iterations
    it runs; Join shadows the rest), ``groups`` (independent DDP groups), ``shared_nic``.
    FSDP2: ``parallel`` (a :class:`~simddp.program.parallel.Parallel` spec such as
    ``"fsdp"`` or ``"hsdp:8"``; None: the capture's own layout over the world),
    ``forward_prefetch`` / ``backward_prefetch`` (units all-gathered ahead; FSDP2's default 1),
    ``reshard_after_forward`` (None: the capture's; else it must be the capture's).
    Every parallelism: ``rank_speed`` (rank → speed factor), ``jitter`` (relative standard
    deviation of compute and network times), ``seed``, ``iterations``, ``gpu_memory_gb``
    (device memory for the OOM verdict; None: no verdict).
    """

    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None
    comm_hook: str | None = None
    powersgd_rank: int = 1
    rank_speed: Mapping[int, float] = field(default_factory=dict)
    jitter: float = 0.0
    seed: int = 0
    localsgd_period: int | None = None
    slowmo_period: int | None = None
    uneven: Mapping[int, int] = field(default_factory=dict)
    iterations: int | None = None
    groups: int = 1
    shared_nic: bool = False
    parallel: str | None = None
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    reshard_after_forward: bool | None = None
    gpu_memory_gb: float | None = None

    @classmethod
    def of(cls, **kw: Any) -> Knobs:
        """Knobs from keywords; an unknown one is an error naming the accepted ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in kw if k not in names)
        if unknown:
            raise TypeError(f"unknown replay knob(s) {', '.join(unknown)}; the knobs are: "
                            f"{', '.join(names)}")
        kw = {k: v for k, v in kw.items() if not (k in ("rank_speed", "uneven") and v is None)}
        return cls(**kw)

    def replace(self, **kw: Any) -> Knobs:
        return dataclasses.replace(self, **kw)

    def given(self, kw: Mapping[str, Any]) -> dict[str, Any]:
        """This object's values of the fields named in ``kw`` (the keywords a caller gave)."""
        return {k: getattr(self, k) for k in kw}

    @property
    def period(self) -> int | None:
        """The model averaging period (LocalSGD or SlowMo), if any."""
        return self.localsgd_period if self.localsgd_period is not None else self.slowmo_period

    def checked(self, world: int, net: NetworkModel) -> CheckedKnobs:
        """Check the knobs against each other, the world and the network."""
        ranks = f"a rank of the world (0..{world - 1})"
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {COMM_HOOKS}, got {self.comm_hook!r}")
        integer("powersgd_rank", self.powersgd_rank, minimum=1)
        number("jitter", self.jitter, minimum=0, hint="a relative standard deviation, e.g. 0.05")
        speeds = dict(self.rank_speed or {})
        for r, v in speeds.items():
            if integer("rank_speed: a key", r, minimum=0, hint=ranks) >= world:
                raise ValueError(f"rank_speed names rank {r!r}, but the world has ranks "
                                 f"0..{world - 1}")
            number(f"rank_speed[{r}]", v, positive=True, hint="a speed factor, 0.5 = half speed")
        if self.localsgd_period is not None and self.slowmo_period is not None:
            raise ValueError("give localsgd_period or slowmo_period, not both")
        period = self.period
        if period is not None:
            integer("the averaging period (localsgd_period/slowmo_period)", period, minimum=1)
            if self.comm_hook not in (None, "allreduce"):
                raise ValueError("LocalSGD/SlowMo replace the gradient all_reduce (post-localSGD "
                                 "is itself a comm hook): use comm_hook=None with them")
            if self.uneven:
                raise ValueError("uneven inputs (Join) with LocalSGD/SlowMo are not modelled")
        if integer("groups", self.groups, minimum=1, hint=f"a divisor of world_size={world}") \
                and world % self.groups:
            raise ValueError(f"groups must divide world_size={world}, got {self.groups!r}")
        if self.gpu_memory_gb is not None:
            number("gpu_memory_gb", self.gpu_memory_gb, positive=True,
                   hint="the device's memory in GB (1e9 bytes), e.g. 80")
        if self.shared_nic and net.gpus_per_node is None:
            raise ValueError("shared_nic=True needs a network with gpus_per_node (the ranks that "
                             "share a node's NIC)")
        uneven = dict(self.uneven or {})
        for r, n in uneven.items():
            if integer("uneven: a key", r, minimum=0, hint=ranks) >= world:
                raise ValueError(f"uneven maps ranks (0..{world - 1}) to iteration counts, "
                                 f"got rank {r!r}")
            integer(f"uneven[{r}]", n, minimum=0, hint="the iterations that rank runs")
        iterations = self.iterations
        if iterations is None:
            iterations = max(1, period or 1, max(uneven.values(), default=-1) + 1)
        iterations = integer("iterations", iterations, minimum=1)
        if any(n > iterations for n in uneven.values()):
            raise ValueError(f"uneven gives a rank more than iterations={iterations} iterations")
        return CheckedKnobs(self, world, net, speeds, uneven, iterations)


@dataclass(frozen=True)
class CheckedKnobs:
    """:class:`Knobs` checked for one world and network: what planners and engines read."""

    knobs: Knobs
    world: int
    network: NetworkModel
    speeds: dict[int, float]
    uneven: dict[int, int]
    iterations: int

    def describe(self) -> dict[str, Any]:
        """The knobs as a result row shows them (the network's own fields first)."""
        k = self.knobs
        return {**self.network.describe(), "bucket_cap_mb": k.bucket_cap_mb,
                "first_bucket_mb": k.first_bucket_mb, "comm_hook": k.comm_hook,
                "powersgd_rank": k.powersgd_rank if k.comm_hook == "powersgd" else None,
                "rank_speed": {str(r): v for r, v in sorted(self.speeds.items())} or None,
                "jitter": float(k.jitter), "seed": k.seed, "localsgd_period": k.localsgd_period,
                "slowmo_period": k.slowmo_period,
                "uneven": {str(r): v for r, v in sorted(self.uneven.items())} or None,
                "groups": k.groups, "shared_nic": k.shared_nic, "parallel": k.parallel,
                "forward_prefetch": k.forward_prefetch, "backward_prefetch": k.backward_prefetch,
                "reshard_after_forward": k.reshard_after_forward,
                "gpu_memory_gb": k.gpu_memory_gb}


@dataclass(frozen=True)
class Config:
    """One point of a what-if: a world size, a network (a model or a preset name; None: the
    capture's) and the :class:`Knobs`. Sweeps and ``simddp whatif`` carry these from the
    command line to the engines."""

    world_size: int | None = None
    network: Any = None
    knobs: Knobs = field(default_factory=Knobs)

    @classmethod
    def from_kwargs(cls, kw: Mapping[str, Any]) -> Config:
        """From :func:`~simddp.replay.replay`'s keywords (``world_size``, ``network`` and the
        knobs' fields); an unknown keyword is an error naming the knobs."""
        kw = dict(kw)
        world, net = kw.pop("world_size", None), kw.pop("network", None)
        return cls(world, net, Knobs.of(**kw))

    def as_kwargs(self) -> dict[str, Any]:
        """The keywords of :func:`~simddp.replay.replay` (knobs that differ from the default)."""
        default = Knobs()
        out: dict[str, Any] = {"world_size": self.world_size, "network": self.network}
        for f in dataclasses.fields(Knobs):
            v = getattr(self.knobs, f.name)
            if v != getattr(default, f.name):
                out[f.name] = v
        return out
