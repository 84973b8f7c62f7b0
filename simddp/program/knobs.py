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
    Memory: ``expandable_segments`` (torch's caching allocator with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as torchtitan runs; False: its
    default segments; :mod:`simddp.models.allocator`).
    Cost mechanisms (docs/costs.md): ``overlap`` (False: DDP's
    all_reduces after backward), the host (:mod:`simddp.models.host`: ``host_per_sample_us``,
    ``loader_workers``, ``host_cores``, ``ranks_per_host``, ``rank_threads``,
    ``samples_per_rank``), per-step synchronisations (:mod:`simddp.models.syncs`:
    ``sync_points``, ``sync_us``, ``metric_allreduces``) are off by default; NCCL's tuning
    model (``protocol_latency``, :mod:`simddp.models.nccl_latency`) and the GPU's SM share
    and launch cost (``gpu_contention``, :mod:`simddp.models.gpu_contention`) default (None)
    to what the network is: on for a network that runs NCCL (``Network.nccl``, every NCCL
    preset) and for the GPU it names (``Network.gpu``: dgx-a100, dgx-h100...); False / "off"
    switch them off for a study.
    Pipeline parallelism (:mod:`simddp.program.pipeline`; None: the capture's):
    ``pp_schedule`` (torch's schedule name as ``get_schedule_class`` takes it: "GPipe",
    "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV"), ``microbatches`` and ``stages_per_rank`` (virtual stages; must be the
    capture's).
    Compute options (the compute model prices them; ``simddp whatif`` refuses them while no
    model does): ``compile`` (torch.compile), ``float8`` (Float8 linears), ``async_tp``
    (async tensor parallelism). Rows show them when set.
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
    overlap: bool = True
    host_per_sample_us: float = 0.0
    loader_workers: int = 0
    host_cores: int | None = None
    ranks_per_host: int | None = None
    rank_threads: float | None = None
    samples_per_rank: int | None = None
    sync_points: int = 0
    sync_us: float | None = None
    metric_allreduces: int = 0
    protocol_latency: bool | None = None
    gpu_contention: str | None = None
    pp_schedule: str | None = None
    microbatches: int | None = None
    stages_per_rank: int | None = None
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    expandable_segments: bool = True  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

    @classmethod
    def of(cls, **kw: Any) -> Knobs:
        """Knobs from keywords; an unknown one is an error naming the accepted ones."""
        return cls().replace(**kw)

    def replace(self, **kw: Any) -> Knobs:
        """These knobs with ``kw`` changed (None for ``rank_speed``/``uneven``: none); an
        unknown keyword is an error naming the knobs."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(k for k in kw if k not in names)
        if unknown:
            raise TypeError(f"unknown replay knob(s) {', '.join(unknown)}; the knobs are: "
                            f"{', '.join(names)}")
        kw = {k: ({} if k in ("rank_speed", "uneven") and v is None else v)
              for k, v in kw.items()}
        return dataclasses.replace(self, **kw)

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
        self._check_pipeline()
        iterations = self.iterations
        if iterations is None:
            iterations = max(1, period or 1, max(uneven.values(), default=-1) + 1)
        iterations = integer("iterations", iterations, minimum=1)
        if any(n > iterations for n in uneven.values()):
            raise ValueError(f"uneven gives a rank more than iterations={iterations} iterations")
        return CheckedKnobs(self, world, *self._costs(world, net), speeds, uneven, iterations)

    def _check_pipeline(self) -> None:
        """The pipeline knobs, each on its own (the planner checks them against the capture)."""
        if self.pp_schedule is not None:
            from .schedules import schedule_class

            schedule_class(self.pp_schedule)
        if self.microbatches is not None:
            integer("microbatches", self.microbatches, minimum=1,
                    hint="microbatches per step, e.g. 8")
        if self.stages_per_rank is not None:
            integer("stages_per_rank", self.stages_per_rank, minimum=1,
                    hint="pipeline stages per rank: 1, or 2+ for interleaved schedules")

    @property
    def pipeline_knobs(self) -> dict[str, Any]:
        """The pipeline knobs that are set."""
        return {n: getattr(self, n) for n in ("pp_schedule", "microbatches", "stages_per_rank")
                if getattr(self, n) is not None}

    def _costs(self, world: int, net: NetworkModel) -> tuple[NetworkModel, Any, float, int]:
        """The cost mechanisms' models: (the network with NCCL's latency and the GPU's
        contention, the host loader or None, the compute slowdown of shared cores, the ranks
        per host)."""
        from ..models.gpu_contention import default_contention, gpu_contention
        from ..models.host import HostLoader, core_share_slowdown
        from ..models.nccl_latency import ProtocolLatency

        if not all(isinstance(getattr(self, n), bool) for n in
                   ("overlap", "compile", "float8", "async_tp")):
            raise ValueError("overlap, compile, float8 and async_tp must be True or False")
        if self.protocol_latency not in (None, True, False):
            raise ValueError("protocol_latency must be True, False or None (the network's own: "
                             "on for NCCL fabrics)")
        integer("sync_points", self.sync_points, minimum=0, hint="host syncs per step, e.g. 1")
        integer("metric_allreduces", self.metric_allreduces, minimum=0,
                hint="small all_reduces per step (logged metrics), e.g. 1")
        if self.sync_us is not None:
            number("sync_us", self.sync_us, minimum=0, hint="microseconds per host sync")
        rph = self.ranks_per_host
        if rph is None:
            rph = getattr(net, "gpus_per_node", None) or 1
        rph = min(integer("ranks_per_host", rph, minimum=1, hint="ranks per node"), world)
        contention = self.gpu_contention
        if contention is None and getattr(net, "contention", None) is None:
            contention = default_contention(net)  # the network's GPU, where it names one
        if contention is not None and str(contention).lower() not in ("off", "none", "false"):
            if not hasattr(net, "with_"):
                raise TypeError(f"gpu_contention needs a simddp.Network or MeasuredNetwork, "
                                f"got {net!r}")
            net = net.with_(contention=gpu_contention(contention))
        tuned = self.protocol_latency
        if tuned is None:
            tuned = bool(getattr(net, "nccl", False))
        if tuned:
            net = ProtocolLatency(net)
        loader = None
        if self.host_per_sample_us:
            loader = HostLoader(self.host_per_sample_us, self.loader_workers, self.host_cores,
                                rph)
        if self.samples_per_rank is not None:
            integer("samples_per_rank", self.samples_per_rank, minimum=1,
                    hint="samples one rank loads per iteration (its batch size)")
        slowdown = 1.0
        if self.rank_threads is not None:
            if self.host_cores is None:
                raise ValueError("rank_threads needs host_cores (the cores of a node the ranks "
                                 "share)")
            slowdown = core_share_slowdown(rph, self.rank_threads, self.host_cores)
        return net, loader, slowdown, rph


@dataclass(frozen=True)
class CheckedKnobs:
    """:class:`Knobs` checked for one world and network: what planners and engines read."""

    knobs: Knobs
    world: int
    network: NetworkModel  # with the knobs' NCCL latency and GPU contention
    loader: Any  # simddp.models.host.HostLoader, or None
    core_slowdown: float  # compute × this (ranks sharing a host's cores)
    ranks_per_host: int
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
                "gpu_memory_gb": k.gpu_memory_gb, **k.pipeline_knobs, **self._cost_columns()}

    def _cost_columns(self) -> dict[str, Any]:
        """The cost mechanisms' columns, only those switched on (rows stay as they were)."""
        k, default = self.knobs, Knobs()
        names = ("overlap", "host_per_sample_us", "loader_workers", "host_cores",
                 "ranks_per_host", "rank_threads", "samples_per_rank", "sync_points", "sync_us",
                 "metric_allreduces", "protocol_latency", "gpu_contention", "compile", "float8",
                 "async_tp", "expandable_segments")
        return {n: getattr(k, n) for n in names if getattr(k, n) != getattr(default, n)}


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
