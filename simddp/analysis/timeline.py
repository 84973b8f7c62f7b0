"""The timeline of a simulated run: per-rank spans, collectives, iterations, and exports.

Spans per rank (virtual seconds):

* compute: ``"forward"``, ``"backward"``, ``"optimizer"`` (consecutive ops of one phase merged);
* ``"wait"``: the rank's clock jumped to a collective's end (``Work.wait``, a synchronous call,
  the end-of-backward wait for the DDP Reducer's buckets, or a stream wait of an op);
* ``"callback"``: future callbacks (comm hooks' post-processing), on their side stream;
* collectives (:class:`CommSpan`): issued, started, ended, one per rank and collective.

Iteration *i* of a rank runs from the end of its iteration *i−1* (its clock at 0 for the
first, which therefore includes setup such as DDP's construction) to the end of its *i*-th
optimizer step (or :func:`simddp.mark_iteration`). Per rank and iteration
(:meth:`Timeline.breakdown`):

* comm = time during which at least one of the rank's collectives runs (union of
  ``[start, end]``), overlap = the part of it during which the rank also computes,
  exposed comm = comm − overlap;
* wait = time the rank spent blocked in waits (exposed comm plus waiting for slower ranks).

``iteration_times()`` and ``exposed_comm()`` give, per iteration, the maximum over ranks.
This module is the one place that computes them: co-simulation and replay both hand their
records over as per-rank :class:`Lane` objects, and their results read these figures from
here. The figures are computed per lane on first use (a replay of 65,536 ranks asks for
iteration times and exposed communication, never for every span as an object).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Sequence

from . import export
from .intervals import intersection, measure
from .lanes import COMPUTE_KINDS, CommSpan, IterationStats, Lane, Span, SpanRow, LaneView
from .perrank import PerRank

__all__ = ["Timeline", "Lane", "Span", "CommSpan", "IterationStats", "COMPUTE_KINDS"]

class Timeline:
    """Per-rank spans and collectives of one simulated run, with iteration statistics and
    exports (:meth:`to_chrome_trace`, :meth:`plot`, :meth:`summary`, :meth:`to_csv`).

    Build one from records (``Timeline(nranks, spans, comms, boundaries, end_times)``) or from
    per-rank lanes (:meth:`from_lanes`, what the engines do).
    """

    def __init__(self, nranks: int, spans: Iterable[Span] = (), comms: Iterable[CommSpan] = (),
                 boundaries: Sequence[Sequence[float]] | None = None,
                 end_times: Sequence[float] | None = None) -> None:
        rows: list[list[SpanRow]] = [[] for _ in range(nranks)]
        for s in spans:
            rows[s.rank].append((s.kind, s.start, s.end, s.name))
        cs: list[list[CommSpan]] = [[] for _ in range(nranks)]
        for c in comms:
            cs[c.rank].append(c)
        bounds = ([list(b) for b in boundaries] if boundaries is not None
                  else [[] for _ in range(nranks)])
        ends = list(end_times) if end_times is not None else [0.0] * nranks
        self._init([Lane(rows[r], cs[r], bounds[r], ends[r]) for r in range(nranks)])

    @classmethod
    def from_lanes(cls, lanes: Sequence[Lane]) -> Timeline:
        """A timeline whose rank ``r`` is ``lanes[r]``."""
        tl = cls.__new__(cls)
        tl._init(list(lanes))
        return tl

    @classmethod
    def from_classes(cls, lanes: Sequence[Lane], rank_class: Any,
                     first: Sequence[int]) -> Timeline:
        """A timeline of ``len(rank_class)`` ranks in classes of identical ranks: rank ``r``'s
        lane is ``lanes[rank_class[r]]`` (``rank_class``: a numpy integer array), ``first[c]``
        the lowest rank of class ``c`` (ascending in ``c``). Figures are computed once per
        class; per-rank records (``lanes``, ``boundaries`` …) are views, not copies."""
        tl = cls.__new__(cls)
        lanes = list(lanes)
        tl._init(LaneView(lanes, rank_class), lanes, rank_class, list(first))
        return tl

    def _init(self, lanes: Sequence[Lane], class_lanes: list[Lane] | None = None,
              rank_class: Any = None, first: Sequence[int] | None = None) -> None:
        self.lanes = lanes
        self.nranks = len(lanes)
        # classes of identical ranks (each rank its own class unless from_classes)
        self.class_lanes: Sequence[Lane] = lanes if class_lanes is None else class_lanes
        self.rank_class = rank_class
        self.class_first: Sequence[int] = range(self.nranks) if first is None else first
        self._cache: dict[Any, Any] = {}

    def classes(self) -> list[tuple[int, int]]:
        """Per class of identical ranks: ``(lowest rank, number of ranks)``; every rank is
        a class of its own unless the timeline came from :meth:`from_classes` (replay)."""
        if self.rank_class is None:
            return [(r, 1) for r in range(self.nranks)]
        import numpy as np

        sizes = np.bincount(self.rank_class, minlength=len(self.class_lanes)).tolist()
        return list(zip(self.class_first, sizes))

    def class_ranks(self, c: int) -> list[int]:
        """The ranks of class ``c`` (see :meth:`classes`), ascending."""
        if self.rank_class is None:
            return [c]
        import numpy as np

        return np.flatnonzero(self.rank_class == c).tolist()

    def subset(self, ranks: Iterable[int]) -> Timeline:
        """A timeline of ``ranks`` only, renumbered 0..k−1 in the order given."""
        return Timeline.from_lanes([self.lanes[r] for r in ranks])

    # -- records -------------------------------------------------------------------------------
    @property
    def boundaries(self) -> list[list[float]]:
        """Per rank: the clock at each iteration's end."""
        return self._records([lane.boundaries for lane in self.class_lanes])

    @property
    def end_times(self) -> list[float]:
        """Per rank: the clock when the rank's function returned."""
        return self._records([lane.end_time for lane in self.class_lanes])

    def _records(self, per_class: list) -> Sequence:
        return per_class if self.rank_class is None else PerRank(per_class, self.rank_class)

    @property
    def spans(self) -> list[Span]:
        """Every rank's spans, rank by rank."""
        got = self._cache.get("spans")
        if got is None:
            got = self._cache["spans"] = [s for r in range(self.nranks) for s in self.rank_spans(r)]
        return got

    @property
    def comms(self) -> list[CommSpan]:
        """Every rank's collectives, rank by rank."""
        got = self._cache.get("comms")
        if got is None:
            got = self._cache["comms"] = [c for r in range(self.nranks) for c in self.rank_comms(r)]
        return got

    @property
    def makespan(self) -> float:
        """The latest rank's final clock."""
        return max((lane.end_time for lane in self.class_lanes), default=0.0)

    def rank_spans(self, rank: int, kinds: Sequence[str] | None = None) -> list[Span]:
        return [Span(rank, k, s, e, name) for k, s, e, name in self.lanes[rank].spans
                if kinds is None or k in kinds]

    def rank_comms(self, rank: int) -> list[CommSpan]:
        return self.lanes[rank].comm_spans(rank)

    def num_iterations(self) -> int:
        """Iterations completed by every rank."""
        return min((len(lane.boundaries) for lane in self.class_lanes), default=0)

    def windows(self, rank: int) -> list[tuple[float, float]]:
        return self.lanes[rank].windows()

    # -- statistics ------------------------------------------------------------------------------
    def breakdown(self, representatives: bool = False) -> list[IterationStats]:
        """One :class:`IterationStats` per (iteration, rank), iteration-major.

        ``representatives=True``: one per (iteration, class of identical ranks) instead, its
        ``rank`` the class's lowest (:meth:`classes` gives the sizes); the same as the
        default unless the timeline has classes (replay). Maxima over ranks are maxima over
        these rows, without a row per rank."""
        rows = self._cache.get("breakdown")
        if rows is None:
            rows = self._cache["breakdown"] = self._breakdown()
        if representatives or self.rank_class is None:
            return list(rows)
        out: list[IterationStats] = []  # every rank: its class's rows, renumbered
        classes = self.rank_class.tolist()
        i = 0
        while i < len(rows):
            it = rows[i].iteration
            of_class: dict[int, IterationStats] = {}
            while i < len(rows) and rows[i].iteration == it:
                of_class[int(self.rank_class[rows[i].rank])] = rows[i]
                i += 1
            for r, c in enumerate(classes):
                row = of_class.get(c)
                if row is not None:
                    out.append(row if row.rank == r else dataclasses.replace(row, rank=r))
        return out

    def _breakdown(self) -> list[IterationStats]:
        rows: list[IterationStats] = []
        lanes = self.class_lanes
        per_rank = [lane.windows() for lane in lanes]
        for i in range(max((len(w) for w in per_rank), default=0)):
            for k, lane in enumerate(lanes):
                if i >= len(per_rank[k]):
                    continue
                r = self.class_first[k]
                lo, hi = per_rank[k][i]
                phases = {k: measure(lane.clipped(k, lo, hi)) for k in COMPUTE_KINDS}
                comm = lane.clipped("comm", lo, hi)
                rows.append(IterationStats(
                    iteration=i, rank=r, start=lo, end=hi, forward=phases["forward"],
                    backward=phases["backward"], optimizer=phases["optimizer"],
                    wait=measure(lane.clipped("wait", lo, hi)), comm=measure(comm),
                    overlap=intersection(comm, lane.clipped(COMPUTE_KINDS, lo, hi))))
        return rows

    def iteration_figures(self) -> list[dict[str, Any]]:
        """Per iteration, over all ranks: the largest ``duration``, ``compute``, ``comm``,
        ``exposed`` comm and ``wait``; ``comm_sum`` and ``overlap_sum`` (over ranks) and the
        rank with the most compute (``most_compute``, the lowest such). What
        :meth:`summary` shows; from one breakdown row per class, weighted by its size."""
        weight = dict(self.classes()) if self.rank_class is not None else None
        its: dict[int, list[IterationStats]] = {}
        for row in self.breakdown(representatives=True):
            its.setdefault(row.iteration, []).append(row)
        out = []
        for k in sorted(its):
            group = its[k]
            if weight is None:
                comm = sum(g.comm for g in group)
                ov = sum(g.overlap for g in group)
            else:  # a class counts once per rank
                comm = sum(g.comm * weight[g.rank] for g in group)
                ov = sum(g.overlap * weight[g.rank] for g in group)
            out.append({"duration": max(g.duration for g in group),
                        "compute": max(g.compute for g in group),
                        "comm": max(g.comm for g in group),
                        "exposed": max(g.exposed_comm for g in group),
                        "wait": max(g.wait for g in group), "comm_sum": comm,
                        "overlap_sum": ov,
                        "most_compute": max(group, key=lambda g: (g.compute, -g.rank)).rank})
        return out

    def _per_class(self, metric: str) -> list[list[float]]:
        got = self._cache.get(metric)
        if got is None:
            got = self._cache[metric] = [getattr(lane, metric)() for lane in self.class_lanes]
        return got

    def _per_rank(self, metric: str) -> Sequence[list[float]]:
        return self._records(self._per_class(metric))

    def compute_figures(self, tick: Any = None) -> None:
        """Compute (and cache) every lane's durations and exposed communication now, calling
        ``tick(lanes done)`` every 4096 lanes (a progress display)."""
        for metric in ("durations", "exposed"):
            if metric in self._cache:
                continue
            got = []
            for k, lane in enumerate(self.class_lanes):
                got.append(getattr(lane, metric)())
                if tick is not None and k % 4096 == 4095:
                    tick((k + 1) // 2 if metric == "durations"
                         else (len(self.class_lanes) + k + 1) // 2)
            self._cache[metric] = got

    def _per_iteration(self, metric: str, rank: int | None) -> list[float]:
        if rank is not None:
            return list(self._per_rank(metric)[rank])
        out: list[float] = []
        for values in self._per_class(metric):
            for i, v in enumerate(values):
                if i == len(out):
                    out.append(v)
                elif v > out[i]:
                    out[i] = v
        return out

    def iteration_times(self, rank: int | None = None) -> list[float]:
        """Per iteration: the longest rank's duration (or ``rank``'s), in seconds."""
        return self._per_iteration("durations", rank)

    def exposed_comm(self, rank: int | None = None) -> list[float]:
        """Per iteration: the largest exposed communication over ranks (or ``rank``'s)."""
        return self._per_iteration("exposed", rank)

    def exposed_comm_by_scope(self, rank: int | None = None) -> dict[str, list[float]]:
        """Per scope (mesh dimension: ``"shard"``, ``"tp"``, DDP's ``"dp"`` …), per iteration:
        the largest exposed communication of that scope's collectives over ranks (or
        ``rank``'s; see :meth:`Lane.exposed_by_scope`)."""
        per = self._cache.get("exposed_by_scope")
        if per is None:
            per = self._cache["exposed_by_scope"] = [lane.exposed_by_scope()
                                                     for lane in self.class_lanes]
        if rank is not None:
            return {k: list(v) for k, v in self._records(per)[rank].items()}
        out: dict[str, list[float]] = {}
        for lane in per:
            for scope, values in lane.items():
                best = out.setdefault(scope, [])
                for i, v in enumerate(values):
                    if i == len(best):
                        best.append(v)
                    elif v > best[i]:
                        best[i] = v
        return dict(sorted(out.items()))

    def waits(self, rank: int | None = None) -> list[float]:
        """Per iteration: the largest time blocked in waits over ranks (or ``rank``'s)."""
        return self._per_iteration("waits", rank)

    def slowest_ranks(self) -> list[int]:
        """Per iteration: the rank with the longest duration (the lowest such rank)."""
        best: list[tuple[float, int]] = []
        # classes in order of their lowest rank: the first class reaching the maximum holds
        # the lowest rank with it
        for r, values in zip(self.class_first, self._per_class("durations")):
            for i, v in enumerate(values):
                if i == len(best):
                    best.append((v, r))
                elif v > best[i][0]:
                    best[i] = (v, r)
        return [r for _, r in best]

    # -- exports ---------------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | os.PathLike | None = None) -> dict[str, Any]:
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one process per
        rank; a "compute" thread (forward/backward/optimizer spans and waits), a "callbacks"
        thread, and one "comm" thread per process group (and one for its point-to-point
        transfers) with a span per collective and an instant event where it was issued.
        Timestamps are virtual microseconds. Returns the document; writes it to ``path``."""
        return export.chrome_trace(self, path)

    def plot(self, path: str | os.PathLike, *, ranks: Sequence[int] | None = None,
             title: str | None = None, dpi: int = 110) -> str:
        """A PNG Gantt chart: per rank a compute lane (forward, backward, optimizer, waits,
        callbacks) and a comm lane (each collective), iteration ends as ticks. ``ranks=None``:
        every rank up to 16, else :meth:`notable_ranks` (slowest, stragglers, most and least
        waiting), labelled with why. Needs matplotlib (``pip install 'fakepg-simddp[plot]'``)."""
        from .plot import plot

        return plot(self, path, ranks=ranks, title=title, dpi=dpi)

    def notable_ranks(self, limit: int = 16) -> dict[int, str]:
        """Up to ``limit`` ranks worth looking at, {rank: why} in rank order: each
        iteration's slowest rank, stragglers (most compute), most and least waiting, rank 0,
        then the lowest others (:func:`simddp.analysis.plot.notable_ranks`)."""
        from .plot import notable_ranks

        return notable_ranks(self, limit)

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """:meth:`breakdown` as CSV (one row per iteration and rank, seconds)."""
        return export.breakdown_csv(self, path)

    def summary(self, max_rows: int = 12, width: int | None = None) -> str:
        """A text table per iteration: time (longest rank), compute, comm, exposed comm and
        overlap (largest over ranks), waits, and the rank with the most compute; ``width``
        columns wide (default: ``$COLUMNS``, else 80)."""
        return export.summary(self, max_rows, width)
