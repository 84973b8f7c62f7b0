"""fakerun's output: every line a rank writes, prefixed with its rank, to the console and to
its torchrun-style log files (``--redirects``/``--tee``)."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Sequence, TextIO

from ..process.remote import child_rank
from ..world.binding import current_cluster


class _Sink:
    """One rank's stdout or stderr: whole lines to the console with the rank's prefix, and
    everything as written to its log file."""

    def __init__(self, console: TextIO | None, prefix: str, path: str | None):
        self.console, self.prefix, self.partial = console, prefix, ""
        self.file = open(path, "w", buffering=1) if path else None  # noqa: SIM115 - closed by close()

    def write(self, s: str) -> None:
        if self.file is not None:
            self.file.write(s)
        if self.console is None:
            return
        head, newline, self.partial = (self.partial + s).rpartition("\n")
        if newline:
            p = self.prefix
            self.console.write("".join(f"{p}{line}\n" for line in head.split("\n")))
            self.console.flush()  # torchrun runs workers unbuffered (python -u)

    def close(self) -> None:
        if self.partial and self.console is not None:
            self.console.write(f"{self.prefix}{self.partial}\n")
            self.console.flush()
        self.partial = ""
        if self.file is not None:
            self.file.close()


def _rank_of_this_run() -> int | None:
    """The rank of fakerun's world writing here (a rank thread or rank process); None for any
    other thread, and for the ranks of worlds a rank started (torch.multiprocessing.spawn),
    whose output goes, unprefixed, where their launching rank's would."""
    me = child_rank()
    if me is not None:
        return me if current_cluster() is None else None
    binding = current_cluster()
    if binding is None:
        return None
    from .spawn import outermost_cluster
    return binding[1] if binding[0] is outermost_cluster() else None


class _RankStream:
    """Stands in for sys.stdout/sys.stderr during the run: a rank thread's writes go to its
    sink, any other thread's straight to the original stream."""

    def __init__(self, original: TextIO, sinks: list[_Sink]):
        self._original, self._sinks = original, sinks

    def write(self, s: str) -> int:
        rank = _rank_of_this_run()
        if rank is None:
            return self._original.write(s)
        self._sinks[rank].write(s)
        return len(s)

    def close_rank(self, rank: int) -> None:
        """A rank process ends: write out its last partial line and close its log."""
        self._sinks[rank].close()

    def writelines(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str):
        return getattr(self._original, name)


@contextlib.contextmanager
def rank_output(prefixes: list[str], show_out: list[bool], show_err: list[bool],
                files: list[tuple[str | None, str | None]]) -> Iterator[None]:
    """While entered, each rank's stdout/stderr lines go to the console with its prefix
    (where shown) and to its log files (where given)."""
    out, err = sys.stdout, sys.stderr
    n = len(prefixes)
    sinks_out = [_Sink(out if show_out[r] else None, prefixes[r], files[r][0]) for r in range(n)]
    sinks_err = [_Sink(err if show_err[r] else None, prefixes[r], files[r][1]) for r in range(n)]
    sys.stdout, sys.stderr = _RankStream(out, sinks_out), _RankStream(err, sinks_err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
        for sink in sinks_out + sinks_err:
            sink.close()
