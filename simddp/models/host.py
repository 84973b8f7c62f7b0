"""The host: data loading as a producer the step waits for, and ranks sharing a node's cores.

**Data loading.** A ``torch.utils.data.DataLoader`` with ``W`` worker processes prepares
batches in parallel with training (``num_workers=W``, each worker building whole batches,
``prefetch_factor`` of them ahead): in steady state it delivers one batch every
``P = samples · per_sample / W_eff`` seconds, where ``per_sample`` is the host's time to read,
decode and augment one sample and ``W_eff`` the workers that really run at once — at most the
cores this rank has, ``host_cores / ranks_per_host``. The step consumes a batch per
iteration, so a step faster than ``P`` waits for the loader: the iteration takes
``max(step, P)`` (a producer–consumer pipeline's throughput is its slowest stage's). With
``W = 0`` (DataLoader's default) the main process loads each batch itself, on the step's
critical path: ``samples · per_sample`` more per iteration. ``per_sample`` is the user's
measured figure (e.g. images/s of the loader alone on one core: ``per_sample = 1 / that``).

**Shared cores.** Ranks of one node run their host-side work on the node's cores. A rank that
keeps ``threads`` cores busy (1 for a GPU rank's Python thread; for CPU training, the cores a
single-process step really used) slows down when the node's ranks ask for more cores than it
has: by ``ranks_per_host · threads / host_cores`` (the OS time-shares the cores fairly),
never below 1. So one single-process ``--step-time`` serves every world size: 4 ranks of one
thread on 2 cores run each step at half speed, 2 ranks at full speed.

>>> HostLoader(per_sample_us=1000.0, workers=4).period(64)   # 64 samples, 1 ms each, 4 workers
0.016
>>> HostLoader(per_sample_us=1000.0, workers=4, host_cores=8, ranks_per_host=8).period(64)
0.064
>>> core_share_slowdown(ranks_per_host=4, threads=1.0, host_cores=2)
2.0
"""

from __future__ import annotations

from dataclasses import dataclass

from fakepg.arguments import integer, number

__all__ = ["HostLoader", "core_share_slowdown"]


@dataclass(frozen=True)
class HostLoader:
    """A node's data loading for one rank (see the module docstring).

    per_sample_us: host µs to load, decode and augment one sample on one core.
    workers: DataLoader worker processes per rank (0: the main process loads inline).
    host_cores: CPU cores per node (None: as many as the workers need).
    ranks_per_host: ranks sharing the node's cores.
    """

    per_sample_us: float
    workers: int = 0
    host_cores: int | None = None
    ranks_per_host: int = 1

    def __post_init__(self) -> None:
        number("host_per_sample_us", self.per_sample_us, minimum=0,
               hint="host microseconds per sample (load + decode + augment), e.g. 1500")
        integer("loader_workers", self.workers, minimum=0,
                hint="DataLoader workers per rank (0: the main process loads)")
        if self.host_cores is not None:
            integer("host_cores", self.host_cores, minimum=1, hint="CPU cores per node")
        integer("ranks_per_host", self.ranks_per_host, minimum=1, hint="ranks per node")

    @property
    def parallel(self) -> float:
        """Workers that run at once: the workers, at most this rank's share of the cores."""
        if self.host_cores is None:
            return float(self.workers)
        return min(float(self.workers), self.host_cores / self.ranks_per_host)

    def batch_seconds(self, samples: int) -> float:
        """One core's seconds to prepare a batch of ``samples``."""
        return samples * self.per_sample_us * 1e-6

    def inline(self, samples: int) -> float:
        """Seconds the step itself spends loading (main-process loading, ``workers=0``)."""
        return self.batch_seconds(samples) if self.workers == 0 else 0.0

    def period(self, samples: int) -> float:
        """Steady-state seconds between batches the workers deliver (0: inline loading)."""
        if self.workers == 0:
            return 0.0
        return self.batch_seconds(samples) / self.parallel


def core_share_slowdown(ranks_per_host: int, threads: float, host_cores: int) -> float:
    """Factor (≥ 1) on a rank's host-bound work when ``ranks_per_host`` ranks each keep
    ``threads`` cores busy on a node of ``host_cores`` cores."""
    integer("ranks_per_host", ranks_per_host, minimum=1, hint="ranks per node")
    number("rank_threads", threads, positive=True,
           hint="cores one rank keeps busy, e.g. 1 (a GPU rank) or the cores a CPU step uses")
    integer("host_cores", host_cores, minimum=1, hint="CPU cores per node")
    return max(1.0, ranks_per_host * threads / host_cores)
