"""What a sweep leaves behind: :class:`SweepResult`, one row per configuration, with a terminal
table, CSV/JSON, a pandas DataFrame and plots.

A :class:`SweepResult` is a ``list`` of flat dict rows (what :func:`simddp.sweep` always
returned), so ``rows[0]["iteration_time_s"]`` and ``len(rows)`` keep working::

    res = sweep(cap, world_size=[64, 1024], bucket_cap_mb=[1, 25])
    print(res.table())                 # fits 80 columns
    res.to_pandas()                    # for notebooks (needs pandas: the "sweeps" extra)
    res.to_csv("rows.csv"); res.to_json("rows.json")
    res.plot_scaling("scaling.png")    # iteration time vs world size, one line per configuration
    res.plot_breakdown("breakdown.png")  # compute / exposed comm / wait, stacked

Row columns: the knobs (:meth:`simddp.ReplayResult.row`), ``world_size``, and the figures, in
seconds and means over the replayed iterations: ``iteration_time_s`` (slowest rank),
``exposed_comm_s`` (largest over ranks), ``compute_s`` (largest over ranks: the straggler's),
``wait_s`` (largest time a rank spent blocked, i.e. waiting for the others), ``slowest_rank``
(of the last iteration), plus ``buckets``, collectives and bytes per iteration, ``wall_time_s``.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Callable, ClassVar, Iterable, Sequence

from .export import terminal_width, write_csv
from .timeline import Timeline

__all__ = ["SweepResult", "row_figures", "RESULT_COLUMNS"]

# The figures of a row; every other column is a knob (a configuration axis).
RESULT_COLUMNS = ("layout", "iterations", "iteration_time_s", "exposed_comm_s", "exposed_comm_by_dim",
                  "compute_s", "wait_s",
                  "slowest_rank", "buckets", "collectives_per_iteration",
                  "comm_bytes_per_iteration", "peak_memory_bytes", "oom", "wall_time_s",
                  "bubble_fraction", "bubble_fraction_mean", "peak_memory_reserved_bytes",
                  "peak_memory_allocated_bytes", "memory_margin_bytes")
# Knobs that describe a network rather than name one: shown only through "network".
_NETWORK_DETAIL = ("bandwidth_GBps", "latency_us", "algorithm")
_SHORT = {"world_size": "ranks", "bucket_cap_mb": "cap MB", "comm_hook": "hook",
          "gpus_per_node": "GPUs/node", "rank_speed": "speeds", "first_bucket_mb": "1st MB",
          "localsgd_period": "localsgd", "slowmo_period": "slowmo",
          "reshard_after_forward": "reshard", "forward_prefetch": "fwd pf",
          "backward_prefetch": "bwd pf", "pp_schedule": "schedule", "microbatches": "mb",
          "stages_per_rank": "v"}


def row_figures(tl: Timeline) -> dict[str, Any]:
    """The breakdown columns of a row, from a run's timeline: ``compute_s`` and ``wait_s``
    (per iteration the largest over ranks, averaged) and the last iteration's
    ``slowest_rank``."""
    per_it = tl.iteration_figures()
    n = len(per_it) or 1
    slowest = tl.slowest_ranks()
    return {"compute_s": sum(g["compute"] for g in per_it) / n,
            "wait_s": sum(g["wait"] for g in per_it) / n,
            "slowest_rank": slowest[-1] if slowest else None}


def _memory(row: dict[str, Any]) -> str:
    """A row's peak memory per rank, in GB (1e9 bytes), marked OOM where it does not fit."""
    b = row.get("peak_memory_bytes") or 0
    text = f"{b / 1e9:.2f}G" if b >= 1e8 else f"{b / 1e6:.2f}M"
    return text + (" OOM" if row.get("oom") else "")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ",".join(f"{k}:{x:g}" if isinstance(x, (int, float)) else f"{k}:{x}"
                        for k, x in v.items())
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


class SweepResult(list):
    """Rows (dicts) of a sweep, in grid order; see the module docstring.

    ``captured``: the capture the rows replayed (``captures``: one per row, where rows replayed
    several — one per parallel layout) and ``configs``: each row's
    :func:`~simddp.replay.replay` keywords (None when built from rows alone); :meth:`replay`
    re-runs one row with them, e.g. for its timeline.
    """

    # simddp.replay registers its replay() here: the analysis layer stands below the engines
    replayer: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, rows: Iterable[dict[str, Any]] = (), *, captured: Any = None,
                 configs: Sequence[dict[str, Any]] | None = None,
                 title: str | None = None, captures: Sequence[Any] | None = None) -> None:
        super().__init__(rows)
        self.captures = list(captures) if captures is not None else None
        self.captured = captured if captured is not None or not self.captures \
            else self.captures[0]
        self.configs = None if configs is None else [dict(c) for c in configs]
        self.title = title
        self.meta: dict[str, Any] = {}  # what produced the rows (whatif: compute, calibration)

    # ---- columns --------------------------------------------------------------------------
    def knob_columns(self) -> list[str]:
        """The knob columns, in row order (everything but the figures)."""
        cols: list[str] = []
        for row in self:
            cols += [k for k in row if k not in RESULT_COLUMNS and k not in cols]
        return cols

    def varying(self, *, include_world_size: bool = False) -> list[str]:
        """Knob columns whose value differs between rows: what tells configurations apart."""
        out = []
        for k in self.knob_columns():
            if k in _NETWORK_DETAIL or (k == "world_size" and not include_world_size):
                continue
            if len({json.dumps(r.get(k), sort_keys=True, default=str) for r in self}) > 1:
                out.append(k)
        return out

    def configuration(self, row: dict[str, Any]) -> str:
        """A label for ``row``'s configuration (its varying knobs but the world size)."""
        parts = [f"{_SHORT.get(k, k)} {_fmt(row.get(k))}" for k in self.varying()]
        return ", ".join(parts) or "all"

    def configurations(self) -> dict[str, list[dict[str, Any]]]:
        """Rows grouped by :meth:`configuration`, each group sorted by world size."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in self:
            groups.setdefault(self.configuration(row), []).append(row)
        return {k: sorted(v, key=lambda r: r.get("world_size", 0)) for k, v in groups.items()}

    # ---- exports --------------------------------------------------------------------------
    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The rows as CSV (dict values as JSON); written to ``path`` if given."""
        return write_csv(self, path)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The rows as a JSON list; written to ``path`` if given. ``wall_time_s`` is left out
        so that equal sweeps give identical text."""
        rows = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in self]
        text = json.dumps(rows, indent=1, sort_keys=False, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` with one row per configuration (needs pandas:
        ``pip install 'fakepg-simddp[sweeps]'``)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError(f"SweepResult.to_pandas needs pandas ({e}); install the sweeps "
                              f"extra: pip install 'fakepg-simddp[sweeps]'") from e
        return pd.DataFrame(list(self))

    def table(self, width: int | None = None) -> str:
        """A text table (rich) of the varying knobs and the figures in ms (and the peak memory
        per rank, where rows carry it; the exposed communication per mesh dimension, a column
        each, where rows have several dimensions and the columns fit), ``width`` columns wide
        (default: ``$COLUMNS``, else 80)."""
        if width is None:
            width = terminal_width()
        knobs = ["world_size"] + self.varying()
        if "pp_schedule" in knobs and "stages_per_rank" in knobs and len(
                {(r.get("pp_schedule"), r.get("stages_per_rank")) for r in self}) == len(
                {r.get("pp_schedule") for r in self}):
            knobs.remove("stages_per_rank")  # each schedule's own: the schedule says it
        dims = sorted({d for r in self for d in (r.get("exposed_comm_by_dim") or {})})
        if len(dims) > 1:
            wide, needs = self._table(knobs, dims, width)
            if needs <= width:
                return wide
        return self._table(knobs, [], width)[0]

    def _table(self, knobs: list[str], dims: list[str], width: int) -> tuple[str, int]:
        """The table's text, and the width it needs to show every cell unfolded."""
        from rich.console import Console
        from rich.table import Table

        t = Table(title=self.title, box=None, pad_edge=False, padding=(0, 1),
                  header_style="bold")
        for k in knobs:  # short values (a schedule's name) unfolded, long ones folded
            widest = max((len(_fmt(r.get(k))) for r in self), default=0)
            t.add_column(_SHORT.get(k, k), justify="right", overflow="fold",
                         min_width=max(len(_SHORT.get(k, k)), widest if widest <= 16 else 0))
        memory = any(r.get("peak_memory_bytes") for r in self)
        bubble = any(r.get("bubble_fraction") is not None for r in self)
        # a pipeline's waits are mostly its bubble, shown instead; its slowest rank only
        # where it tells rows apart
        waits = ("wait_s",) if not bubble else ()
        slowest = not bubble or len({r.get("slowest_rank") for r in self}) > 1
        for col in ("iter ms", "exposed", *dims, "compute", *(("wait",) if waits else ()),
                    *(("slowest",) if slowest else ())) + (("bubble",) if bubble else ()) + \
                (("peak mem",) if memory else ()):
            t.add_column(col, justify="right", no_wrap=True)
        for r in self:
            by_dim = r.get("exposed_comm_by_dim") or {}
            t.add_row(*[_fmt(r.get(k)) for k in knobs],
                      *[f"{r[c] * 1e3:.3f}" if r.get(c) is not None else "-"
                        for c in ("iteration_time_s", "exposed_comm_s")],
                      *[f"{by_dim[d] * 1e3:.3f}" if d in by_dim else "-" for d in dims],
                      *[f"{r[c] * 1e3:.3f}" if r.get(c) is not None else "-"
                        for c in ("compute_s", *waits)],
                      *((_fmt(r.get("slowest_rank")),) if slowest else ()),
                      *((f"{r['bubble_fraction']:.1%}" if r.get("bubble_fraction") is not None
                         else "-",) if bubble else ()),
                      *((_memory(r),) if memory else ()))
        buf = io.StringIO()
        console = Console(file=buf, width=width, color_system=None, force_terminal=False,
                          soft_wrap=False)
        console.print(t)
        return buf.getvalue(), console.measure(t, options=console.options.update(
            width=10_000)).maximum

    def __str__(self) -> str:
        return self.table()

    # ---- plots ----------------------------------------------------------------------------
    def plot_scaling(self, path: str | os.PathLike, *, dpi: int = 110) -> str:
        """Iteration time (solid) and exposed communication (dashed) vs world size, one line
        per configuration (log-2 x axis); returns the path written."""
        from .plot import load_matplotlib

        FigureCanvasAgg, Figure, _ = load_matplotlib()
        fig = Figure(figsize=(9, 5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for k, (label, rows) in enumerate(self.configurations().items()):
            xs = [r["world_size"] for r in rows]
            line, = ax.plot(xs, [r["iteration_time_s"] * 1e3 for r in rows], "o-", label=label)
            ax.plot(xs, [r["exposed_comm_s"] * 1e3 for r in rows], "x--",
                    color=line.get_color(), alpha=0.7)
        if len({r["world_size"] for r in self}) > 1 and min(r["world_size"] for r in self) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("ms per iteration (solid) / exposed comm (dashed)")
        ax.set_title(self.title or "simddp what-if: iteration time vs world size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=dpi, format="png")
        return os.fspath(path)

    def plot_breakdown(self, path: str | os.PathLike, *, dpi: int = 110) -> str:
        """One stacked bar per row adding up to the iteration time — compute (the largest over
        ranks: the straggler's), exposed communication, other — with beside it the wait of the
        rank that waits most (for stragglers, or collectives); returns the path written."""
        from .plot import load_matplotlib

        FigureCanvasAgg, Figure, Patch = load_matplotlib()
        rows = [r for rows in self.configurations().values() for r in rows]
        labels = [f"{r['world_size']}: {self.configuration(r)}" for r in rows]
        fig = Figure(figsize=(max(6.0, 0.55 * len(rows) + 2), 5.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        xs = list(range(len(rows)))
        ms = [{c: (r.get(c) or 0.0) * 1e3 for c in ("iteration_time_s", "compute_s",
                                                    "exposed_comm_s", "wait_s")} for r in rows]
        # The stack adds up to the iteration time: the straggler's compute, the exposed
        # communication, then whatever else the slowest rank spent; the waits of the ranks
        # that wait for the others overlap that, so they stand beside it.
        comp = [m["compute_s"] for m in ms]
        exp = [min(m["exposed_comm_s"], max(0.0, m["iteration_time_s"] - c))
               for m, c in zip(ms, comp)]
        rest = [max(0.0, m["iteration_time_s"] - c - e) for m, c, e in zip(ms, comp, exp)]
        ax.bar(xs, comp, width=0.6, color="#4C72B0", label="compute (largest over ranks)")
        ax.bar(xs, exp, width=0.6, bottom=comp, color="#DA8BC3", label="exposed comm")
        ax.bar(xs, rest, width=0.6, bottom=[c + e for c, e in zip(comp, exp)],
               color="#BBBBBB", label="other")
        ax.bar([x + 0.38 for x in xs], [m["wait_s"] for m in ms], width=0.16,
               color="#C44E52", hatch="//", label="wait (rank waiting most)")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per iteration (mean over iterations)")
        top = max([m["iteration_time_s"] for m in ms] + [m["wait_s"] for m in ms] + [1e-9])
        ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
        ax.set_title("compute / exposed communication / wait per configuration")
        ax.legend(fontsize=8, loc="upper left", ncol=2)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=dpi, format="png")
        return os.fspath(path)

    # ---- re-running one row -----------------------------------------------------------------
    def replay(self, index: int, **changes: Any) -> Any:
        """Replay row ``index`` again (knobs as in the row, ``changes`` on top) and return
        the :class:`~simddp.ReplayResult`, timeline included."""
        if self.captured is None or self.configs is None:
            raise ValueError("this SweepResult has no capture (built from rows alone), so a "
                             "row cannot be replayed; use simddp.sweep(cap, ...)")
        if SweepResult.replayer is None:
            raise RuntimeError("no replay engine is loaded: import simddp.replay first")
        cap = self.captures[index] if self.captures is not None else self.captured
        return SweepResult.replayer(cap, **{**self.configs[index], **changes})

    @classmethod
    def concat(cls, parts: Sequence[SweepResult], title: str | None = None) -> SweepResult:
        """One result of several sweeps' rows (each row keeps its own capture)."""
        rows, configs, caps = [], [], []
        for part in parts:
            rows += list(part)
            configs += part.configs or [{} for _ in part]
            caps += part.captures or [part.captured] * len(part)
        return cls(rows, configs=configs, captures=caps, title=title)

    def select(self, predicate: Callable[[dict[str, Any]], bool]) -> SweepResult:
        """The rows for which ``predicate(row)`` is true, as a SweepResult."""
        keep = [i for i, r in enumerate(self) if predicate(r)]
        return SweepResult([self[i] for i in keep], captured=self.captured,
                           configs=None if self.configs is None else
                           [self.configs[i] for i in keep], title=self.title)
