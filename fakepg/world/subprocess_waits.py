"""A rank waiting on a process it started lets the other ranks run.

``Popen.wait()`` blocks in ``waitpid`` and ``Popen.communicate()`` in ``select``: in C, holding
the baton, so the other rank threads stood still while one rank's child ran (tests whose ranks
start subprocesses ran 10x slower than on gloo). On a rank thread, while a world runs, both
poll the child and sleep cooperatively in between (the scheduler's ``sleep``: the others run,
and a sleeping rank keeps the world from being judged hung).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Any, Iterator

from .binding import current_cluster

_REAL_WAIT = subprocess.Popen.wait
_REAL_COMMUNICATE = subprocess.Popen.communicate
_POLL = 0.002  # seconds between looks at the child


def _wait(self: subprocess.Popen, timeout: float | None = None) -> Any:
    binding = current_cluster()
    if binding is None or (timeout is not None and timeout <= 0):
        return _REAL_WAIT(self, timeout)
    cluster, rank = binding
    end = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
        if end is not None and time.monotonic() >= end:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        cluster.scheduler.sleep(rank, _POLL)
    return self.returncode


def _communicate(self: subprocess.Popen, input: Any = None, timeout: float | None = None) -> Any:
    binding = current_cluster()
    if binding is None or (timeout is not None and timeout <= 0):
        return _REAL_COMMUNICATE(self, input, timeout)
    cluster, rank = binding
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            # a short real look at the pipes; retrying loses no output (Popen's contract)
            return _REAL_COMMUNICATE(self, input, _POLL)
        except subprocess.TimeoutExpired:
            input = None  # sent (or being sent) already: a retry must not pass it again
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout) from None  # type: ignore[arg-type]
            cluster.scheduler.sleep(rank, _POLL)


@contextlib.contextmanager
def cooperative_subprocesses() -> Iterator[None]:
    """While a world runs: ``Popen.wait``/``communicate`` on a rank thread let the others run."""
    subprocess.Popen.wait = _wait  # type: ignore[method-assign]
    subprocess.Popen.communicate = _communicate  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.wait = _REAL_WAIT  # type: ignore[method-assign]
        subprocess.Popen.communicate = _REAL_COMMUNICATE  # type: ignore[method-assign]
