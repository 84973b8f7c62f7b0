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
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

__all__ = ["Timeline", "Span", "CommSpan", "IterationStats"]

COMPUTE_KINDS = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Span:
    """A stretch of one rank's time: kind is forward/backward/optimizer/wait/callback."""

    rank: int
    kind: str
    start: float
    end: float
    name: str

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CommSpan:
    """One rank's part of one collective (start/end are None if it never matched)."""

    rank: int
    op: str
    group: str
    group_ranks: tuple[int, ...]
    seq: int
    bytes: int
    issue: float
    start: float | None
    end: float | None
    site: str
    in_backward: bool
    p2p: bool = False
    peer: int | None = None

    @property
    def duration(self) -> float:
        return 0.0 if self.start is None or self.end is None else self.end - self.start

    @property
    def name(self) -> str:
        if self.p2p:
            arrow = "→" if self.op == "send" else "←"
            return f"{self.op} {arrow}{self.peer} #{self.seq}"
        return f"{self.op} #{self.seq}"


@dataclass(frozen=True)
class IterationStats:
    """One rank's iteration, in seconds."""

    iteration: int
    rank: int
    start: float
    end: float
    forward: float
    backward: float
    optimizer: float
    wait: float
    comm: float
    overlap: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.optimizer

    @property
    def exposed_comm(self) -> float:
        return max(0.0, self.comm - self.overlap)


# -- interval arithmetic on sorted, disjoint interval lists ------------------------------------

def _union(ivals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(ivals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _clip(merged: list[tuple[float, float]], ends: list[float], lo: float, hi: float
          ) -> list[tuple[float, float]]:
    i = bisect.bisect_right(ends, lo)
    out = []
    while i < len(merged) and merged[i][0] < hi:
        s, e = merged[i]
        s, e = max(s, lo), min(e, hi)
        if e > s:
            out.append((s, e))
        i += 1
    return out


def _measure(ivals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in ivals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class _Lane:
    """A sorted, disjoint interval list with bisectable ends."""

    def __init__(self, ivals: Iterable[tuple[float, float]]) -> None:
        self.ivals = _union(ivals)
        self.ends = [e for _, e in self.ivals]

    def clip(self, lo: float, hi: float) -> list[tuple[float, float]]:
        return _clip(self.ivals, self.ends, lo, hi)


@dataclass
class Timeline:
    """Per-rank spans and collectives of one simulated run, with iteration statistics and
    exports (:meth:`to_chrome_trace`, :meth:`plot`, :meth:`summary`, :meth:`to_csv`)."""

    nranks: int
    spans: list[Span]
    comms: list[CommSpan]
    boundaries: list[list[float]]  # per rank: the clock at each iteration's end
    end_times: list[float]  # per rank: the clock when the rank's function returned
    _lanes: dict[Any, _Lane] = field(default_factory=dict, repr=False, compare=False)

    # -- queries -----------------------------------------------------------------------------
    @property
    def makespan(self) -> float:
        """The latest rank's final clock."""
        return max(self.end_times, default=0.0)

    def rank_spans(self, rank: int, kinds: Sequence[str] | None = None) -> list[Span]:
        return [s for s in self.spans if s.rank == rank and (kinds is None or s.kind in kinds)]

    def rank_comms(self, rank: int) -> list[CommSpan]:
        return [c for c in self.comms if c.rank == rank]

    def num_iterations(self) -> int:
        """Iterations completed by every rank."""
        return min((len(b) for b in self.boundaries), default=0)

    def windows(self, rank: int) -> list[tuple[float, float]]:
        b = self.boundaries[rank]
        return [(b[i - 1] if i else 0.0, b[i]) for i in range(len(b))]

    def _lane(self, rank: int, what: str) -> _Lane:
        key = (rank, what)
        lane = self._lanes.get(key)
        if lane is None:
            if what == "comm":
                ivals = [(c.start, c.end) for c in self.comms
                         if c.rank == rank and c.start is not None and c.end is not None]
            elif what == "compute":
                ivals = [(s.start, s.end) for s in self.spans
                         if s.rank == rank and s.kind in COMPUTE_KINDS]
            else:
                ivals = [(s.start, s.end) for s in self.spans if s.rank == rank and s.kind == what]
            lane = self._lanes[key] = _Lane(ivals)
        return lane

    def breakdown(self) -> list[IterationStats]:
        """One :class:`IterationStats` per (iteration, rank), iteration-major."""
        cached = self._lanes.get("breakdown")
        if cached is not None:
            return list(cached)
        rows: list[IterationStats] = []
        per_rank = [self.windows(r) for r in range(self.nranks)]
        for i in range(max((len(w) for w in per_rank), default=0)):
            for r in range(self.nranks):
                if i >= len(per_rank[r]):
                    continue
                lo, hi = per_rank[r][i]
                phases = {k: _measure(self._lane(r, k).clip(lo, hi)) for k in COMPUTE_KINDS}
                comm = self._lane(r, "comm").clip(lo, hi)
                compute = self._lane(r, "compute").clip(lo, hi)
                rows.append(IterationStats(
                    iteration=i, rank=r, start=lo, end=hi, forward=phases["forward"],
                    backward=phases["backward"], optimizer=phases["optimizer"],
                    wait=_measure(self._lane(r, "wait").clip(lo, hi)),
                    comm=_measure(comm), overlap=_intersection(comm, compute)))
        self._lanes["breakdown"] = rows  # type: ignore[assignment]
        return list(rows)

    def _per_iteration(self, attr: str, rank: int | None) -> list[float]:
        out: dict[int, float] = {}
        for row in self.breakdown():
            if rank is not None and row.rank != rank:
                continue
            v = getattr(row, attr)
            out[row.iteration] = max(out.get(row.iteration, v), v)
        return [out[i] for i in sorted(out)]

    def iteration_times(self, rank: int | None = None) -> list[float]:
        """Per iteration: the longest rank's duration (or ``rank``'s), in seconds."""
        return self._per_iteration("duration", rank)

    def exposed_comm(self, rank: int | None = None) -> list[float]:
        """Per iteration: the largest exposed communication over ranks (or ``rank``'s)."""
        return self._per_iteration("exposed_comm", rank)

    def waits(self, rank: int | None = None) -> list[float]:
        """Per iteration: the largest time blocked in waits over ranks (or ``rank``'s)."""
        return self._per_iteration("wait", rank)

    # -- exports -----------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | os.PathLike | None = None) -> dict[str, Any]:
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one process per
        rank; a "compute" thread (forward/backward/optimizer spans and waits), a "callbacks"
        thread, and one "comm" thread per process group (and one for its point-to-point
        transfers) with a span per collective and an instant event where it was issued.
        Timestamps are virtual microseconds. Returns the document; writes it to ``path``."""
        def track(c: CommSpan) -> str:  # p2p transfers have channels of their own
            return f"{c.group} p2p" if c.p2p else c.group

        groups = sorted({track(c) for c in self.comms})
        gtid = {g: 10 + i for i, g in enumerate(groups)}
        ev: list[dict[str, Any]] = []
        for r in range(self.nranks):
            ev.append({"ph": "M", "pid": r, "tid": 0, "name": "process_name",
                       "args": {"name": f"rank {r}"}})
            ev.append({"ph": "M", "pid": r, "tid": 0, "name": "process_sort_index",
                       "args": {"sort_index": r}})
            ev.append({"ph": "M", "pid": r, "tid": 0, "name": "thread_name",
                       "args": {"name": "compute"}})
            ev.append({"ph": "M", "pid": r, "tid": 1, "name": "thread_name",
                       "args": {"name": "callbacks"}})
            for g in groups:
                ev.append({"ph": "M", "pid": r, "tid": gtid[g], "name": "thread_name",
                           "args": {"name": f"comm: {g}"}})
        for s in self.spans:
            ev.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": s.rank,
                       "tid": 1 if s.kind == "callback" else 0,
                       "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
        for c in self.comms:
            if c.start is None or c.end is None:
                continue
            args = {"bytes": c.bytes, "group": c.group, "group_ranks": list(c.group_ranks),
                    "issued_us": c.issue * 1e6, "queued_us": (c.start - c.issue) * 1e6,
                    "site": c.site, "in_backward": c.in_backward}
            ev.append({"ph": "X", "name": c.name, "cat": "comm", "pid": c.rank,
                       "tid": gtid[track(c)], "ts": c.start * 1e6,
                       "dur": (c.end - c.start) * 1e6, "args": args})
            ev.append({"ph": "i", "s": "t", "name": f"issue {c.name}", "cat": "issue",
                       "pid": c.rank, "tid": gtid[track(c)], "ts": c.issue * 1e6})
        for r, bounds in enumerate(self.boundaries):
            for i, t in enumerate(bounds):
                ev.append({"ph": "i", "s": "p", "name": f"iteration {i} end", "cat": "iteration",
                           "pid": r, "tid": 0, "ts": t * 1e6})
        doc = {"traceEvents": ev, "displayTimeUnit": "ms",
               "otherData": {"generator": "simddp", "clock": "virtual time, microseconds"}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc

    def plot(self, path: str | os.PathLike, *, ranks: Sequence[int] | None = None,
             title: str | None = None, dpi: int = 110) -> str:
        """A PNG Gantt chart: per rank a compute lane (forward, backward, optimizer, waits,
        callbacks) and a comm lane (each collective), iteration ends as ticks. Uses
        matplotlib's Agg canvas directly (no pyplot, no global backend change)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        shown = list(range(self.nranks)) if ranks is None else list(ranks)
        colors = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868",
                  "wait": "#C44E52", "callback": "#8172B3"}
        comm_colors = ("#937860", "#DA8BC3")
        unit, scale = ("ms", 1e3) if self.makespan < 10 else ("s", 1.0)
        fig = Figure(figsize=(12, 1.2 + 0.75 * len(shown)))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        yticks, ylabels = [], []
        for row, r in enumerate(shown):
            base = (len(shown) - 1 - row) * 2.0
            by_kind: dict[str, list[tuple[float, float]]] = {}
            for s in self.rank_spans(r):
                by_kind.setdefault(s.kind, []).append((s.start * scale, (s.end - s.start) * scale))
            for kind, bars in by_kind.items():
                ax.broken_barh(bars, (base + 1.0, 0.8), facecolors=colors.get(kind, "#999999"),
                               hatch="//" if kind == "wait" else None, linewidth=0)
            comm_bars: list[list[tuple[float, float]]] = [[], []]
            for k, c in enumerate(sorted((c for c in self.rank_comms(r) if c.start is not None),
                                         key=lambda c: (c.start, c.group, c.seq))):
                comm_bars[k % 2].append((c.start * scale, max(c.end - c.start, 0.0) * scale))
            for k in (0, 1):
                if comm_bars[k]:
                    ax.broken_barh(comm_bars[k], (base + 0.1, 0.8), facecolors=comm_colors[k],
                                   edgecolor="black", linewidth=0.3)
            for t in self.boundaries[r]:
                ax.vlines(t * scale, base, base + 1.9, colors="black", linewidth=0.6)
            yticks += [base + 0.5, base + 1.4]
            ylabels += [f"rank {r} comm", f"rank {r} compute"]
        ax.set_yticks(yticks)
        ax.set_yticklabels(ylabels, fontsize=8)
        ax.set_xlabel(f"virtual time ({unit})")
        ax.set_xlim(0, max(self.makespan * scale, 1e-12))
        ax.set_title(title or f"simddp timeline: {self.nranks} ranks, "
                              f"{self.num_iterations()} iterations")
        handles = [Patch(facecolor=colors[k], label=k, hatch="//" if k == "wait" else None)
                   for k in colors] + [Patch(facecolor=comm_colors[0], label="collective")]
        ax.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=dpi, format="png")
        return os.fspath(path)

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """:meth:`breakdown` as CSV (one row per iteration and rank, seconds)."""
        buf = io.StringIO()
        cols = ["iteration", "rank", "start", "end", "duration", "forward", "backward",
                "optimizer", "compute", "wait", "comm", "overlap", "exposed_comm"]
        w = csv.writer(buf)
        w.writerow(cols)
        for row in self.breakdown():
            w.writerow([getattr(row, c) for c in cols])
        text = buf.getvalue()
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def summary(self, max_rows: int = 12) -> str:
        """A text table per iteration: time (longest rank), compute, comm, exposed comm and
        overlap (largest over ranks), waits, and the rank with the most compute."""
        from rich.console import Console
        from rich.table import Table

        rows = self.breakdown()
        its: dict[int, list[IterationStats]] = {}
        for row in rows:
            its.setdefault(row.iteration, []).append(row)
        table = Table(title=f"simddp: {self.nranks} ranks, {len(its)} iterations, "
                            f"makespan {self.makespan * 1e3:.3f} ms (virtual)")
        for col in ("iter", "time ms", "compute ms", "comm ms", "exposed ms", "overlap",
                    "wait ms", "most compute"):
            table.add_column(col, justify="right")

        def line(label: str, group: list[IterationStats]) -> list[str]:
            comm = sum(g.comm for g in group)
            ov = sum(g.overlap for g in group)
            heavy = max(group, key=lambda g: (g.compute, -g.rank))
            return [label, f"{max(g.duration for g in group) * 1e3:.3f}",
                    f"{max(g.compute for g in group) * 1e3:.3f}",
                    f"{max(g.comm for g in group) * 1e3:.3f}",
                    f"{max(g.exposed_comm for g in group) * 1e3:.3f}",
                    f"{100.0 * ov / comm:.0f} %" if comm > 0 else "-",
                    f"{max(g.wait for g in group) * 1e3:.3f}", f"rank {heavy.rank}"]

        keys = sorted(its)
        shown = keys if len(keys) <= max_rows else keys[: max_rows // 2] + keys[-(max_rows // 2):]
        for i, k in enumerate(shown):
            if i and shown[i - 1] != k - 1:
                table.add_row(*(["…"] * 8))
            table.add_row(*line(str(k), its[k]))
        if len(keys) > 2:  # steady state: iteration 0 includes setup
            steady = [its[k] for k in keys if k > 0]

            def mean(fn: Any) -> str:
                return f"{sum(fn(g) for g in steady) / len(steady) * 1e3:.3f}"

            table.add_section()
            table.add_row(f"mean 1–{keys[-1]}", mean(lambda g: max(x.duration for x in g)),
                          mean(lambda g: max(x.compute for x in g)),
                          mean(lambda g: max(x.comm for x in g)),
                          mean(lambda g: max(x.exposed_comm for x in g)), "",
                          mean(lambda g: max(x.wait for x in g)), "")
        buf = io.StringIO()
        Console(file=buf, width=110, color_system=None, force_terminal=False).print(table)
        return buf.getvalue()
