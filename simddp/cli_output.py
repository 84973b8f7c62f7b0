"""What ``simddp whatif`` and ``simddp replay`` show and write: the progress display on stderr
(rich), the table on stdout and the files of ``--out`` / ``--json``."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any, Callable, Iterator

__all__ = ["progress", "write_outputs", "finish"]


@contextlib.contextmanager
def progress(enabled: bool) -> Iterator[tuple[Callable[[str], None], Any, Any]]:
    """(status, rows, replay) callbacks drawing a rich progress display on stderr: stages,
    configurations done, and how far the running replay got (a million ranks take a while)."""
    if not enabled:
        yield (lambda text: None), None, None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=console.is_terminal) as prog:
        state: dict[str, Any] = {"task": None, "rows": None, "replay": None}

        def status(text: str) -> None:
            if state["task"] is not None:
                prog.update(state["task"], completed=1, total=1)
            state["task"] = prog.add_task(text, total=None)
            if not console.is_terminal:
                console.print(f"simddp: {text}")

        def rows(done: int, total: int, row: dict) -> None:
            if state["rows"] is None:
                if state["task"] is not None:
                    prog.update(state["task"], completed=1, total=1)
                state["rows"] = prog.add_task("replaying configurations", total=total)
            prog.update(state["rows"], completed=done)

        def replay(done: int, total: int, description: str) -> None:
            if state["replay"] is None:
                state["replay"] = prog.add_task(description, total=total)
            prog.update(state["replay"], completed=done, total=total, description=description)
            if done >= total:  # the next replay starts a fresh bar
                prog.remove_task(state["replay"])
                state["replay"] = None

        yield status, rows, replay


def write_outputs(res: Any, args: argparse.Namespace) -> list[str]:
    written = []
    if args.json:
        res.to_json(args.json)
        written.append(args.json)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        written.append(res.to_csv(os.path.join(args.out, "rows.csv")) and
                       os.path.join(args.out, "rows.csv"))
        written.append(res.plot_scaling(os.path.join(args.out, "scaling.png")))
        written.append(res.plot_breakdown(os.path.join(args.out, "breakdown.png")))
        # the slowest configuration at the largest world: where stragglers show most
        top = max(r["world_size"] for r in res)
        i = max((k for k, r in enumerate(res) if r["world_size"] == top),
                key=lambda k: (res[k]["iteration_time_s"], -k))
        tl = res.replay(i).timeline
        written.append(tl.plot(os.path.join(args.out, "timeline.png"),
                               title=f"simddp timeline: {res.configuration(res[i])}, "
                                     f"{top} ranks (notable ranks)"
                               if tl.nranks > 16 else None))
        path = os.path.join(args.out, "capture.json")
        res.captured.save(path)
        written.append(path)
    return written


def finish(res: Any, args: argparse.Namespace) -> int:
    print(res.table(), end="")
    for path in write_outputs(res, args):
        print(f"wrote {path}")
    return 0
