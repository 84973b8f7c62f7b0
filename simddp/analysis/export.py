"""Timeline exports: Chrome trace JSON, the breakdown as CSV, a text summary table."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .timeline import CommSpan, Timeline

__all__ = ["chrome_trace", "breakdown_csv", "summary", "write_csv", "terminal_width"]


def chrome_trace(tl: Timeline, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Chrome trace-event JSON of ``tl`` (see :meth:`Timeline.to_chrome_trace`)."""
    def track(c: CommSpan) -> str:  # p2p transfers have channels of their own
        return f"{c.group} p2p" if c.p2p else c.group

    groups = sorted({track(c) for c in tl.comms})
    gtid = {g: 10 + i for i, g in enumerate(groups)}
    ev: list[dict[str, Any]] = []
    for r in range(tl.nranks):
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
    for s in tl.spans:
        ev.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": s.rank,
                   "tid": 1 if s.kind == "callback" else 0,
                   "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
    for c in tl.comms:
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
    for r, bounds in enumerate(tl.boundaries):
        for i, t in enumerate(bounds):
            ev.append({"ph": "i", "s": "p", "name": f"iteration {i} end", "cat": "iteration",
                       "pid": r, "tid": 0, "ts": t * 1e6})
    doc = {"traceEvents": ev, "displayTimeUnit": "ms",
           "otherData": {"generator": "simddp", "clock": "virtual time, microseconds"}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


def breakdown_csv(tl: Timeline, path: str | os.PathLike | None = None) -> str:
    """``tl.breakdown()`` as CSV text, written to ``path`` if given."""
    buf = io.StringIO()
    cols = ["iteration", "rank", "start", "end", "duration", "forward", "backward",
            "optimizer", "compute", "wait", "comm", "overlap", "exposed_comm"]
    w = csv.writer(buf)
    w.writerow(cols)
    for row in tl.breakdown():
        w.writerow([getattr(row, c) for c in cols])
    text = buf.getvalue()
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def terminal_width() -> int:
    """The width tables are printed at: ``$COLUMNS``, else 80 (a piped CI log has no terminal)."""
    try:
        return int(os.environ.get("COLUMNS", "80"))
    except ValueError:
        return 80


def summary(tl: Timeline, max_rows: int = 12, width: int | None = None) -> str:
    """The per-iteration table of :meth:`Timeline.summary`, ``width`` columns wide (default:
    ``$COLUMNS``, else 80 — a piped CI log)."""
    from rich.console import Console
    from rich.table import Table

    its = dict(enumerate(tl.iteration_figures()))
    table = Table(title=f"simddp: {tl.nranks} ranks, {len(its)} iterations, "
                        f"makespan {tl.makespan * 1e3:.3f} ms (virtual)",
                  box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for col in ("iter", "time ms", "compute ms", "comm ms", "exposed ms", "overlap",
                "wait ms", "most compute"):
        table.add_column(col, justify="right")

    def line(label: str, g: dict[str, Any]) -> list[str]:
        comm, ov = g["comm_sum"], g["overlap_sum"]
        return [label, f"{g['duration'] * 1e3:.3f}", f"{g['compute'] * 1e3:.3f}",
                f"{g['comm'] * 1e3:.3f}", f"{g['exposed'] * 1e3:.3f}",
                f"{100.0 * ov / comm:.0f} %" if comm > 0 else "-",
                f"{g['wait'] * 1e3:.3f}", f"rank {g['most_compute']}"]

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
        table.add_row(f"mean 1–{keys[-1]}", mean(lambda g: g["duration"]),
                      mean(lambda g: g["compute"]), mean(lambda g: g["comm"]),
                      mean(lambda g: g["exposed"]), "", mean(lambda g: g["wait"]), "")
    buf = io.StringIO()
    Console(file=buf, width=terminal_width() if width is None else width, color_system=None,
            force_terminal=False, soft_wrap=False).print(table)
    return buf.getvalue()


def write_csv(rows: Any, path: str | os.PathLike | None = None) -> str:
    """Rows (dicts) as CSV text, columns in first-seen order (dict and list values as JSON);
    written to ``path`` if given."""
    cols: list[str] = []
    for row in rows:
        for k in row:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for row in rows:
        w.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
                    for k, v in row.items()})
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", newline="") as f:
            f.write(text)
    return text
