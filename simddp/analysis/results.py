"""What a run leaves behind: one result shape for co-simulation and replay.

Both :class:`SimResult` (:func:`simddp.simulate`) and :class:`ReplayResult`
(:func:`simddp.replay.replay`) carry a :class:`~simddp.Timeline` as ``.timeline`` and read
their figures from it (:class:`RunResult`): ``iteration_times``, ``exposed_comm`` and
``slowest_rank`` per iteration, ``iteration_time`` and ``mean_exposed_comm`` their means,
``summary()``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import fakepg

from .export import write_csv
from .timeline import Timeline

__all__ = ["RunResult", "SimResult", "ReplayResult"]


class RunResult:
    """The accessors both results share; a subclass has a ``timeline`` attribute."""

    timeline: Timeline

    @property
    def iteration_times(self) -> list[float]:
        """Per iteration: the slowest rank's duration, seconds (:meth:`Timeline.iteration_times`)."""
        return self.timeline.iteration_times()

    @property
    def exposed_comm(self) -> list[float]:
        """Per iteration: the largest exposed communication over ranks, seconds."""
        return self.timeline.exposed_comm()

    @property
    def slowest_rank(self) -> list[int]:
        """Per iteration: the rank with the longest duration."""
        return self.timeline.slowest_ranks()

    @property
    def iteration_time(self) -> float:
        """Mean of :attr:`iteration_times` (0 without iterations)."""
        t = self.iteration_times
        return sum(t) / len(t) if t else 0.0

    @property
    def mean_exposed_comm(self) -> float:
        """Mean of :attr:`exposed_comm` (0 without iterations)."""
        x = self.exposed_comm
        return sum(x) / len(x) if x else 0.0

    def summary(self) -> str:
        return self.timeline.summary()


@dataclass
class SimResult(RunResult):
    """What a simulated world leaves behind.

    returns: each rank's return value, in rank order. trace: fakepg's per-rank collective
    records, with ``issue``, ``start`` and ``end`` in virtual seconds. timeline: the
    :class:`Timeline` (spans, iterations, exports). wall_time: real seconds the run took.
    """

    returns: list[Any]
    trace: list[list[fakepg.CollectiveRecord]]
    timeline: Timeline
    nprocs: int
    seed: int
    timing: Any
    wall_time: float = 0.0
    spawn_result: Any = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.nprocs

    def to_json(self, path: Any = None) -> str:
        """The collective trace (with virtual times) as fakepg's JSON."""
        return fakepg.to_json(self.trace, path)


@dataclass
class ReplayResult(RunResult):
    """What :func:`simddp.replay.replay` found. Times in virtual seconds.

    timeline: every rank's spans and collectives (``timeline.subset(range(8))`` for a chart of
    a few). buckets: the layout replayed (parameter indices per bucket); bucket_bytes: bytes
    each bucket's collectives carried (per stage). collectives: every collective (name, op,
    group, members, bytes, start, end). rank_collectives / rank_comm_bytes: per rank, the
    collectives it took part in and their bytes (a list, or where replay simulated classes of
    identical ranks a :class:`~simddp.analysis.PerRank` that reads like one). knobs: the keywords it ran with.
    engine / engine_reason: the engine that ran ("simpy", "vector") and why.
    peak_memory_bytes: the largest rank's peak memory in a step as torch reports it
    (``max_memory_reserved``: the caching allocator's segments, :mod:`simddp.models.allocator`);
    peak_memory_allocated_bytes: its ``max_memory_allocated``; memory: bytes per category at
    the program-order peak; memory_fragmentation: the share of the reserved peak not allocated
    there; memory_outside_bytes: what the process holds outside torch's allocator (the CUDA
    context, NCCL's buffers); memory_limit_bytes: the device's (``gpu_memory_gb``); oom: whether
    the allocator could not serve the step within the device's memory less what is outside it
    (after releasing its cache, as torch retries); memory_margin_bytes: that allocatable memory
    less the reserved peak.
    bubble_fraction: a pipeline's, per pipeline rank (None: no pipeline).
    parallel: the layout replayed (e.g. ``"fsdp:32,tp:8"``); exposed_comm_by_dim: exposed
    communication per mesh dimension.
    """

    world_size: int
    iterations: int
    knobs: dict[str, Any]
    buckets: list[list[int]]
    bucket_bytes: list[list[int]]
    collectives: list[dict[str, Any]]
    rank_collectives: Sequence[int]
    rank_comm_bytes: Sequence[int]
    timeline: Timeline = field(repr=False)
    wall_time: float = 0.0
    engine: str = ""
    engine_reason: str = ""
    peak_memory_bytes: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    memory_limit_bytes: int | None = None
    peak_memory_allocated_bytes: int = 0
    memory_outside_bytes: dict[str, int] = field(default_factory=dict)
    memory_ooms: int | None = None  # allocations the allocator model could not serve
    memory_fragmentation: float = 0.0
    memory_margin: int | None = None  # the smallest over ranks (job_memory)
    # pipeline parallelism: per pipeline rank, its bubble fraction (docs/pipeline-parallel.md)
    bubble_fraction: list[float] | None = None
    parallel: str | None = None  # the layout replayed ("fsdp:32,tp:8"; None: DDP's groups)

    @property
    def oom(self) -> bool | None:
        """Whether the peak memory per rank exceeds the device's (None: no limit given)."""
        if self.memory_limit_bytes is None:
            return None
        if self.memory_ooms is not None:
            return self.memory_ooms > 0
        return self.peak_memory_bytes > self.memory_limit_bytes

    @property
    def peak_memory_reserved_bytes(self) -> int:
        """torch's ``max_memory_reserved`` (the same as ``peak_memory_bytes``)."""
        return self.peak_memory_bytes

    @property
    def memory_allocatable_bytes(self) -> int | None:
        """The device's memory less what the process holds outside torch's allocator."""
        if self.memory_limit_bytes is None:
            return None
        return self.memory_limit_bytes - sum(self.memory_outside_bytes.values())

    @property
    def memory_margin_bytes(self) -> int | None:
        """The allocatable memory less the reserved peak (negative: out of memory), on the
        rank closest to running out."""
        if self.memory_margin is not None:
            return self.memory_margin
        a = self.memory_allocatable_bytes
        return None if a is None else a - self.peak_memory_bytes

    @property
    def collectives_per_iteration(self) -> float:
        """Collectives rank 0 took part in, per iteration."""
        return self.rank_collectives[0] / self.iterations

    @property
    def comm_bytes_per_iteration(self) -> float:
        """Bytes of the collectives rank 0 took part in (nccl-tests' convention), per
        iteration."""
        return self.rank_comm_bytes[0] / self.iterations

    @property
    def exposed_comm_by_dim(self) -> dict[str, float]:
        """Per mesh dimension (``"shard"``, ``"replicate"``, ``"tp"``, DDP's ``"dp"`` …): the
        exposed communication of its collectives alone, per iteration the largest over ranks,
        averaged over iterations (seconds). Dimensions whose collectives are exposed at the
        same time each count it (see :meth:`~simddp.Timeline.exposed_comm_by_scope`)."""
        return {k: sum(v) / len(v) if v else 0.0
                for k, v in self.timeline.exposed_comm_by_scope().items()}

    def row(self) -> dict[str, Any]:
        """One flat row for a sweep table: knobs, then results."""
        return {**self.knobs, "parallel": self.knobs.get("parallel") or self.parallel,
                "layout": self.parallel,  # the spec resolved at this world size
                "world_size": self.world_size, "iterations": self.iterations,
                "iteration_time_s": self.iteration_time,
                "exposed_comm_s": self.mean_exposed_comm,
                "exposed_comm_by_dim": self.exposed_comm_by_dim,
                "buckets": len(self.buckets),
                "collectives_per_iteration": self.collectives_per_iteration,
                "comm_bytes_per_iteration": self.comm_bytes_per_iteration,
                "peak_memory_bytes": self.peak_memory_bytes, "oom": self.oom,
                "peak_memory_reserved_bytes": self.peak_memory_bytes,
                "peak_memory_allocated_bytes": self.peak_memory_allocated_bytes,
                "memory_margin_bytes": self.memory_margin_bytes,
                **self._bubble_columns()}

    def _bubble_columns(self) -> dict[str, Any]:
        """A pipeline's bubble fraction: the largest over pipeline ranks, and their mean."""
        b = self.bubble_fraction
        if b is None:
            return {}
        return {"bubble_fraction": max(b), "bubble_fraction_mean": sum(b) / len(b)}

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "iterations": self.iterations,
                "knobs": self.knobs, "iteration_time": self.iteration_time,
                "iteration_times": self.iteration_times, "exposed_comm": self.exposed_comm,
                "exposed_comm_by_dim": self.exposed_comm_by_dim, "parallel": self.parallel,
                "slowest_rank": self.slowest_rank, "buckets": self.buckets,
                "bucket_bytes": self.bucket_bytes,
                "rank_collectives": list(self.rank_collectives),
                "rank_comm_bytes": list(self.rank_comm_bytes), "collectives": self.collectives,
                **({} if self.bubble_fraction is None
                   else {"bubble_fraction": self.bubble_fraction})}

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Everything but the wall time (so equal inputs give identical text)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """One row per iteration: the knobs, the iteration, its time, exposed comm, slowest
        rank."""
        rows = [{**self.knobs, "world_size": self.world_size, "iteration": i,
                 "iteration_time_s": t, "exposed_comm_s": x, "slowest_rank": s}
                for i, (t, x, s) in enumerate(zip(self.iteration_times, self.exposed_comm,
                                                  self.slowest_rank))]
        return write_csv(rows, path)

    def summary(self) -> str:
        k = ", ".join(f"{a}={_rank_keys(b)}" for a, b in self.knobs.items()
                      if b not in (None, 0.0, 1, False))
        return (f"replay: {self.world_size} ranks, {len(self.buckets)} buckets, {k}\n"
                f"  iteration {self.iteration_time * 1e3:.3f} ms, exposed comm "
                f"{self.mean_exposed_comm * 1e3:.3f} ms, "
                f"{self.collectives_per_iteration:g} collectives and "
                f"{self.comm_bytes_per_iteration / 1e6:.3f} MB per iteration (rank 0); "
                f"simulated in {self.wall_time:.3f} s")


def _rank_keys(value: Any) -> Any:
    """A ``{"3": 0.5}`` knob (string keys, as JSON keeps them) shown with rank numbers."""
    if isinstance(value, dict) and all(isinstance(k, str) and k.isdigit() for k in value):
        return {int(k): v for k, v in value.items()}
    return value
