"""The PNG Gantt chart of a timeline (matplotlib, imported only when a chart is drawn)."""

from __future__ import annotations

import operator
import os
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = ["plot", "notable_ranks", "MAX_LANES"]

MAX_LANES = 16  # ranks drawn by default; a bigger world shows its notable ranks



class Picks(dict):
    """Notable ranks and why, at most ``limit``; a rank picked twice keeps both reasons."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def add(self, rank: int, why: str) -> None:
        if rank in self:
            if why and why not in self[rank]:
                self[rank] = f"{self[rank]}, {why}" if self[rank] else why
        elif len(self) < self.limit:
            self[rank] = why

    def filled(self, n: int) -> dict[int, str]:
        """Rank 0 and then the lowest ranks up to the limit, by rank."""
        for r in [0, *range(n)]:
            if len(self) >= self.limit:
                break
            self.add(r, "")
        return dict(sorted(self.items()))


def notable_ranks(tl: Timeline, limit: int = MAX_LANES) -> dict[int, str]:
    """Up to ``limit`` ranks worth drawing, each with why: the slowest rank of each iteration,
    the ranks with the most compute (stragglers), the most and the least waiting, rank 0,
    then the lowest other ranks; in rank order. All ranks when the world has ``limit`` or
    fewer.

    Each figure is one pass over the per-iteration breakdown, so this stays linear in ranks.
    """
    n = tl.nranks
    if n <= limit:
        return {r: "" for r in range(n)}
    if tl.rank_class is not None:
        return _notable_classes(tl, limit)
    compute = [0.0] * n
    wait = [0.0] * n
    durations: dict[int, list[tuple[float, int]]] = {}
    for s in tl.breakdown():
        compute[s.rank] += s.compute
        wait[s.rank] += s.wait
        durations.setdefault(s.iteration, []).append((s.duration, s.rank))
    picks = Picks(limit)
    add = picks.add

    for it in durations.values():  # an iteration's slowest rank, where one stands out
        it.sort(key=lambda d: (-d[0], d[1]))
        if it[0][0] > it[len(it) // 2][0] * (1 + 1e-9):
            add(it[0][1], "slowest")
    by_compute = sorted(range(n), key=lambda r: (-compute[r], r))
    typical = compute[by_compute[n // 2]]
    for r in by_compute[:3]:
        if compute[r] > typical * (1 + 1e-9):
            add(r, "straggler")
    add(max(range(n), key=lambda r: (wait[r], -r)), "most wait")
    add(min(range(n), key=lambda r: (wait[r], r)), "least wait")
    return picks.filled(n)


def _notable_classes(tl: Timeline, limit: int) -> dict[int, str]:
    """:func:`notable_ranks` of a timeline in classes of identical ranks (replay): the same
    picks, from one breakdown row per class weighted by its size."""
    import numpy as np

    classes = tl.classes()  # (lowest rank, size), by lowest rank
    index = {first: c for c, (first, _) in enumerate(classes)}
    n = tl.nranks
    compute = [0.0] * len(classes)
    wait = [0.0] * len(classes)
    durations: dict[int, list[tuple[float, int]]] = {}
    for s in tl.breakdown(representatives=True):
        c = index[s.rank]
        compute[c] += s.compute
        wait[c] += s.wait
        durations.setdefault(s.iteration, []).append((s.duration, s.rank))
    picks = Picks(limit)
    add = picks.add

    def at_position(order: list[tuple[float, int]], k: int) -> float:
        """The value at position k of the per-rank list these (value, first rank) rows,
        sorted, stand for (each row repeated by its class's size)."""
        for v, first in order:
            k -= classes[index[first]][1]
            if k < 0:
                return v
        return order[-1][0]  # pragma: no cover

    for it in durations.values():  # an iteration's slowest rank, where one stands out
        it.sort(key=lambda d: (-d[0], d[1]))
        m = sum(classes[index[r]][1] for _, r in it)
        if it[0][0] > at_position(it, m // 2) * (1 + 1e-9):
            add(it[0][1], "slowest")
    by_compute = sorted(range(len(classes)), key=lambda c: (-compute[c], classes[c][0]))
    typical = at_position([(compute[c], classes[c][0]) for c in by_compute], n // 2)
    top: list[int] = []  # the 3 ranks first in (-compute, rank) order
    levels = sorted({compute[c] for c in by_compute[:3]}, reverse=True)
    for level in levels:
        members = [c for c in range(len(classes)) if compute[c] == level]
        ranks = np.flatnonzero(np.isin(tl.rank_class, members))[:3 - len(top)]
        top += ranks.tolist()
        if len(top) >= 3:
            break
    for r in top:
        if compute[int(tl.rank_class[r])] > typical * (1 + 1e-9):
            add(r, "straggler")
    most = max(range(len(classes)), key=lambda c: (wait[c], -classes[c][0]))
    add(classes[most][0], "most wait")
    least = min(range(len(classes)), key=lambda c: (wait[c], classes[c][0]))
    add(classes[least][0], "least wait")
    return picks.filled(n)


def load_matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(f"Timeline.plot needs matplotlib, which is not installed ({e}); "
                          f"install the plotting extra: pip install 'fakepg-simddp[plot]'"
                          ) from e
    return FigureCanvasAgg, Figure, Patch


def plot(tl: Timeline, path: str | os.PathLike, *, ranks: Sequence[int] | None = None,
         title: str | None = None, dpi: int = 110) -> str:
    """Draw ``tl`` (see :meth:`Timeline.plot`) with matplotlib's Agg canvas directly (no
    pyplot, no global backend change); returns the path written. ``ranks=None`` draws every
    rank of a world of up to :data:`MAX_LANES` ranks, else its :func:`notable_ranks` (the
    slowest, stragglers, most/least waiting), each labelled with why."""
    FigureCanvasAgg, Figure, Patch = load_matplotlib()

    if ranks is None:
        why = tl.notable_ranks()
    else:
        why = {}
        for r in ranks:
            try:
                k = operator.index(r)
            except TypeError:
                k = -1
            if not 0 <= k < tl.nranks:
                raise ValueError(f"plot(ranks=...): rank {r!r} is not in this timeline of "
                                 f"{tl.nranks} ranks (0..{tl.nranks - 1})")
            why[k] = ""
    shown = list(why)
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868",
              "wait": "#C44E52", "callback": "#8172B3", "host": "#CCB974"}
    comm_colors = ("#937860", "#DA8BC3")
    unit, scale = ("ms", 1e3) if tl.makespan < 10 else ("s", 1.0)
    fig = Figure(figsize=(12, 1.2 + 0.75 * len(shown)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    yticks, ylabels = [], []
    for row, r in enumerate(shown):
        base = (len(shown) - 1 - row) * 2.0
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for s in tl.rank_spans(r):
            by_kind.setdefault(s.kind, []).append((s.start * scale, (s.end - s.start) * scale))
        for kind, bars in by_kind.items():
            ax.broken_barh(bars, (base + 1.0, 0.8), facecolors=colors.get(kind, "#999999"),
                           hatch="//" if kind == "wait" else None, linewidth=0)
        comm_bars: list[list[tuple[float, float]]] = [[], []]
        for k, c in enumerate(sorted((c for c in tl.rank_comms(r) if c.start is not None),
                                     key=lambda c: (c.start, c.group, c.seq))):
            comm_bars[k % 2].append((c.start * scale, max(c.end - c.start, 0.0) * scale))
        for k in (0, 1):
            if comm_bars[k]:
                ax.broken_barh(comm_bars[k], (base + 0.1, 0.8), facecolors=comm_colors[k],
                               edgecolor="black", linewidth=0.3)
        for t in tl.boundaries[r]:
            ax.vlines(t * scale, base, base + 1.9, colors="black", linewidth=0.6)
        yticks += [base + 0.5, base + 1.4]
        tag = f" ({why[r]})" if why[r] else ""
        ylabels += [f"rank {r} comm", f"rank {r}{tag} compute"]
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel(f"virtual time ({unit})")
    ax.set_xlim(0, max(tl.makespan * scale, 1e-12))
    if title is None:
        what = (f"{tl.nranks} ranks" if len(shown) == tl.nranks and shown == sorted(shown)
                else f"ranks {_ranges(shown)} of {tl.nranks}")
        title = f"simddp timeline: {what}, {tl.num_iterations()} iterations"
    ax.set_title(title)
    handles = [Patch(facecolor=colors[k], label=k, hatch="//" if k == "wait" else None)
               for k in colors] + [Patch(facecolor=comm_colors[0], label="collective")]
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=dpi, format="png")
    return os.fspath(path)


def _ranges(ranks: Sequence[int]) -> str:
    """"0-3, 17, 40" for [0, 1, 2, 3, 17, 40] (order kept)."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)
