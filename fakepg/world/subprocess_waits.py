"""A rank waiting on a process it started lets the other ranks run.

``Popen.wait()`` blocks in ``waitpid`` and ``Popen.communicate()`` in ``select``: in C, holding
the baton, so the other rank threads stood still while one rank's child ran (tests whose ranks
start subprocesses ran 10x slower than on gloo). On a rank thread, while a world runs, both
poll the child and sleep cooperatively in between (the scheduler's ``sleep``: the others run,
and a sleeping rank keeps the world from being judged hung). A rank process does the same
(:mod:`fakepg.process.remote.waits`), its naps being sleeps its proxy takes in the world.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Any, Callable, Iterator

from .binding import current_cluster

REAL_WAIT = subprocess.Popen.wait
REAL_COMMUNICATE = subprocess.Popen.communicate
POLL = 0.002  # seconds between looks at the child


def polling_wait(popen: subprocess.Popen, timeout: float | None, nap: Callable[[], None]) -> Any:
    """``Popen.wait`` as polls of the child with ``nap()`` (a cooperative sleep) in between."""
    end = None if timeout is None else time.monotonic() + timeout
    while popen.poll() is None:
        if end is not None and time.monotonic() >= end:
            raise subprocess.TimeoutExpired(popen.args, timeout)  # type: ignore[arg-type]
        nap()
    return popen.returncode


def polling_communicate(popen: subprocess.Popen, input: Any, timeout: float | None,
                        nap: Callable[[], None]) -> Any:
    """``Popen.communicate`` as short real looks at the pipes with ``nap()`` in between."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            # a short real look at the pipes; retrying loses no output (Popen's contract)
            return REAL_COMMUNICATE(popen, input, POLL)
        except subprocess.TimeoutExpired:
            input = None  # sent (or being sent) already: a retry must not pass it again
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(popen.args, timeout) from None  # type: ignore[arg-type]
            nap()


def _wait(self: subprocess.Popen, timeout: float | None = None) -> Any:
    binding = current_cluster()
    if binding is None or (timeout is not None and timeout <= 0):
        return REAL_WAIT(self, timeout)
    cluster, rank = binding
    return polling_wait(self, timeout, lambda: cluster.scheduler.sleep(rank, POLL))


def _communicate(self: subprocess.Popen, input: Any = None, timeout: float | None = None) -> Any:
    binding = current_cluster()
    if binding is None or (timeout is not None and timeout <= 0):
        return REAL_COMMUNICATE(self, input, timeout)
    cluster, rank = binding
    return polling_communicate(self, input, timeout, lambda: cluster.scheduler.sleep(rank, POLL))


@contextlib.contextmanager
def cooperative_subprocesses() -> Iterator[None]:
    """While a world runs: ``Popen.wait``/``communicate`` on a rank thread let the others run."""
    subprocess.Popen.wait = _wait  # type: ignore[method-assign]
    subprocess.Popen.communicate = _communicate  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.wait = REAL_WAIT  # type: ignore[method-assign]
        subprocess.Popen.communicate = REAL_COMMUNICATE  # type: ignore[method-assign]
