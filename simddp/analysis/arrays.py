"""A timeline kept as per-rank arrays of figures (the vectorised replay's), lanes on demand.

A replay of a million distinct ranks cannot keep a span list per rank. Its
:class:`ArrayTimeline` holds, per rank and iteration, numpy arrays of the figures every
statistic reads — iteration ends, compute per phase, waits, time in collectives and the
exposed part of it — and computes iteration times, exposed communication, waits, the slowest
and notable ranks and the summary from them. A rank's spans and collectives (a
:class:`~simddp.analysis.Lane`) are materialised only when asked for (``lanes[r]``,
``rank_spans``, ``plot``, ``subset``), by the engine re-running that rank's plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from .lanes import CommSpan, IterationStats, Lane, Span
from .timeline import Timeline

__all__ = ["ArrayTimeline"]


class _Rows(Sequence):
    """Per rank, a row of a 2-D array as a list (``timeline.boundaries``)."""

    __slots__ = ("a",)

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.a[i].tolist()
        return self.a[i].tolist()

    def __iter__(self):
        for lo in range(0, len(self.a), 65536):
            yield from self.a[lo:lo + 65536].tolist()

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (_Rows, list, tuple)) or hasattr(other, "__len__"):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class _LazyLanes(Sequence):
    """Per rank, its :class:`Lane`, built on demand by ``make(ranks)``."""

    __slots__ = ("make", "n")

    def __init__(self, make: Callable[[list[int]], list[Lane]], n: int) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.make(list(range(self.n)[i]))
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.make([int(i)])[0]

    def __iter__(self):
        for lo in range(0, self.n, 1024):
            yield from self.make(list(range(lo, min(lo + 1024, self.n))))


class ArrayTimeline(Timeline):
    """A :class:`Timeline` of ``nranks`` ranks and ``iterations`` iterations from per-rank
    ``[nranks, iterations]`` arrays: ``bounds`` (iteration ends), ``forward``, ``backward``,
    ``optimizer`` (compute), ``wait``, ``comm`` (a collective of the rank running) and
    ``exposed`` (comm while the rank waits; ``exposed_by_scope``: the same per mesh dimension,
    only that dimension's collectives); ``lanes(ranks)`` builds lanes on demand."""

    def __init__(self, nranks: int, iterations: int, *, bounds: np.ndarray,
                 forward: np.ndarray, backward: np.ndarray, optimizer: np.ndarray,
                 wait: np.ndarray, comm: np.ndarray, exposed: np.ndarray,
                 lanes: Callable[[list[int]], list[Lane]],
                 exposed_by_scope: dict[str, np.ndarray] | None = None) -> None:
        self.iterations = iterations
        self.exposed_by = dict(sorted((exposed_by_scope or {}).items()))
        self.bounds = bounds
        self.figures = {"forward": forward, "backward": backward, "optimizer": optimizer,
                        "waits": wait, "comm": comm, "exposed": exposed}
        lo = np.concatenate([np.zeros((nranks, 1)), bounds[:, :-1]], axis=1)
        self.figures["durations"] = bounds - lo  # as Lane.durations: b[i] - b[i-1]
        self.starts = lo
        self.make_lanes = lanes
        self._init(_LazyLanes(lanes, nranks))

    # -- records -------------------------------------------------------------------------------
    @property
    def boundaries(self) -> Sequence:  # type: ignore[override]
        return _Rows(self.bounds)

    @property
    def end_times(self) -> list[float]:  # type: ignore[override]
        return self.bounds[:, -1].tolist()

    @property
    def makespan(self) -> float:
        return float(self.bounds[:, -1].max()) if self.nranks else 0.0

    def num_iterations(self) -> int:
        return self.iterations

    def windows(self, rank: int) -> list[tuple[float, float]]:
        return list(zip(self.starts[rank].tolist(), self.bounds[rank].tolist()))

    @property
    def spans(self) -> list[Span]:
        """Every rank's spans, rank by rank (lanes built 1024 ranks at a time)."""
        got = self._cache.get("spans")
        if got is None:
            got = self._cache["spans"] = [Span(r, k, s, e, name)
                                          for r, lane in enumerate(self.lanes)
                                          for k, s, e, name in lane.spans]
        return got

    @property
    def comms(self) -> list[CommSpan]:
        """Every rank's collectives, rank by rank."""
        got = self._cache.get("comms")
        if got is None:
            got = self._cache["comms"] = [c for r, lane in enumerate(self.lanes)
                                          for c in lane.comm_spans(r)]
        return got

    def subset(self, ranks: Any) -> Timeline:
        return Timeline.from_lanes(self.make_lanes([int(r) for r in ranks]))

    # -- statistics ------------------------------------------------------------------------------
    def compute_figures(self, tick: Any = None) -> None:
        """(The figures are arrays already.)"""

    def _per_iteration(self, metric: str, rank: int | None) -> list[float]:
        a = self.figures[metric]
        if rank is not None:
            return a[rank].tolist()
        return a.max(axis=0).tolist() if self.nranks else []

    def exposed_comm_by_scope(self, rank: int | None = None) -> dict[str, list[float]]:
        if rank is not None:
            return {k: a[rank].tolist() for k, a in self.exposed_by.items()}
        return {k: a.max(axis=0).tolist() if self.nranks else []
                for k, a in self.exposed_by.items()}

    def slowest_ranks(self) -> list[int]:
        return np.argmax(self.figures["durations"], axis=0).tolist()

    def _compute(self) -> np.ndarray:
        f = self.figures
        return f["forward"] + f["backward"] + f["optimizer"]

    def breakdown(self, representatives: bool = False) -> list[IterationStats]:
        f = self.figures
        cols = [self.starts, self.bounds, f["forward"], f["backward"], f["optimizer"],
                f["waits"], f["comm"], f["comm"] - f["exposed"]]
        rows = []
        for i in range(self.iterations):
            for r, vals in enumerate(zip(*(c[:, i].tolist() for c in cols))):
                rows.append(IterationStats(i, r, *vals))
        return rows

    def iteration_figures(self) -> list[dict[str, Any]]:
        f = self.figures
        compute = self._compute()
        out = []
        for i in range(self.iterations):
            c = compute[:, i]
            out.append({"duration": float(f["durations"][:, i].max()),
                        "compute": float(c.max()), "comm": float(f["comm"][:, i].max()),
                        "exposed": float(f["exposed"][:, i].max()),
                        "wait": float(f["waits"][:, i].max()),
                        "comm_sum": float(f["comm"][:, i].sum()),
                        "overlap_sum": float((f["comm"][:, i] - f["exposed"][:, i]).sum()),
                        "most_compute": int(np.argmax(c))})
        return out

    def notable_ranks(self, limit: int = 16) -> dict[int, str]:
        """As :meth:`Timeline.notable_ranks`, from the arrays (linear in ranks, vectorised)."""
        from .plot import Picks

        n = self.nranks
        if n <= limit:
            return {r: "" for r in range(n)}
        f = self.figures
        compute = np.zeros(n)
        wait = np.zeros(n)
        for i in range(self.iterations):
            compute += f["forward"][:, i] + f["backward"][:, i] + f["optimizer"][:, i]
            wait += f["waits"][:, i]
        picks = Picks(limit)
        for i in range(self.iterations):
            d = f["durations"][:, i]
            top = int(np.argmax(d))
            median = np.partition(-d, n // 2)[n // 2] * -1.0  # position n//2, descending
            if d[top] > median * (1 + 1e-9):
                picks.add(top, "slowest")
        order = np.lexsort((np.arange(n), -compute))
        typical = compute[order[n // 2]]
        for r in order[:3].tolist():
            if compute[r] > typical * (1 + 1e-9):
                picks.add(r, "straggler")
        picks.add(int(np.argmax(wait)), "most wait")
        picks.add(int(np.argmin(wait)), "least wait")
        return picks.filled(n)
