"""replay's progress display: a callback, or a rich progress bar on stderr."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

__all__ = ["progress_display"]


@contextlib.contextmanager
def progress_display(progress: Any) -> Iterator[Any]:
    """replay(progress=...) as a callback ``(done, total, description)`` or None."""
    if callable(progress):
        yield progress
        return
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                               TimeElapsedColumn)

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console, transient=console.is_terminal) as prog:
        task = prog.add_task("replay", total=None)

        def report(done: int, total: int, description: str) -> None:
            prog.update(task, completed=done, total=total, description=description)

        yield report
