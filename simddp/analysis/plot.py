"""The PNG Gantt chart of a timeline (matplotlib, imported only when a chart is drawn)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = ["plot"]


def _matplotlib() -> tuple[Any, Any, Any]:
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
    pyplot, no global backend change); returns the path written."""
    FigureCanvasAgg, Figure, Patch = _matplotlib()

    shown = list(range(tl.nranks)) if ranks is None else list(ranks)
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868",
              "wait": "#C44E52", "callback": "#8172B3"}
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
        ylabels += [f"rank {r} comm", f"rank {r} compute"]
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel(f"virtual time ({unit})")
    ax.set_xlim(0, max(tl.makespan * scale, 1e-12))
    ax.set_title(title or f"simddp timeline: {tl.nranks} ranks, "
                          f"{tl.num_iterations()} iterations")
    handles = [Patch(facecolor=colors[k], label=k, hatch="//" if k == "wait" else None)
               for k in colors] + [Patch(facecolor=comm_colors[0], label="collective")]
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=dpi, format="png")
    return os.fspath(path)
