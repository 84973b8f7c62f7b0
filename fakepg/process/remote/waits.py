"""Python's own waits in a rank process: the other ranks run meanwhile.

A rank process runs only while its proxy holds the baton. A wait on a ``threading.Condition``
(behind ``Event``, ``Queue``, futures' ``result``) that only another rank's progress can end
-- torchft's quorum, which needs every rank of the group to ask -- would hold the baton until
its own timeout. So on the rank's own thread such a wait alternates a short real wait with a
short cooperative sleep (a request to the proxy, during which the other ranks run), as thread
mode parks it in the scheduler. ``Popen.wait``/``communicate`` on a process the rank started
poll it with such sleeps in between, as a rank thread does
(:mod:`fakepg.world.subprocess_waits`): a rank process waiting on its child in ``waitpid``
would hold the baton, and, with collectives in flight, look blocked in C++ to the world's
inactivity fallback. Threads the rank started wait for real (they do not talk on the rank's
channel).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any, Callable

from . import rank as _rank
from ...world import subprocess_waits

_REAL_WAIT = threading.Condition.wait
_THREAD_START = threading.Thread.start.__code__
_SLICE = 0.005  # seconds of real waiting between turns given to the other ranks


def install(patch: Callable[[Any, str, Any], None]) -> None:
    """Patch ``threading.Condition.wait`` for this rank process's own thread."""
    _rank.me().thread_ident = threading.get_ident()
    patch(threading.Condition, "wait", _wait)
    patch(subprocess.Popen, "wait", _popen_wait)
    patch(subprocess.Popen, "communicate", _popen_communicate)


def _on_rank_thread() -> bool:
    return _rank.in_rank_process() and threading.get_ident() == getattr(_rank.me(), "thread_ident", None)


def _nap() -> None:
    _rank.me().request("sleep", subprocess_waits.POLL)  # the other ranks run meanwhile


def _popen_wait(self: subprocess.Popen, timeout: float | None = None) -> Any:
    if not _on_rank_thread() or (timeout is not None and timeout <= 0):
        return subprocess_waits.REAL_WAIT(self, timeout)
    return subprocess_waits.polling_wait(self, timeout, _nap)


def _popen_communicate(self: subprocess.Popen, input: Any = None, timeout: float | None = None) -> Any:
    if not _on_rank_thread() or (timeout is not None and timeout <= 0):
        return subprocess_waits.REAL_COMMUNICATE(self, input, timeout)
    return subprocess_waits.polling_communicate(self, input, timeout, _nap)


def _wait(self: threading.Condition, timeout: float | None = None) -> bool:
    if (not _on_rank_thread()
            or (timeout is not None and timeout <= 0) or _starting_a_thread()):
        return _REAL_WAIT(self, timeout)
    if not self._is_owned():  # type: ignore[attr-defined]
        raise RuntimeError("cannot wait on un-acquired lock")
    waiter = threading._allocate_lock()  # type: ignore[attr-defined]
    waiter.acquire()
    self._waiters.append(waiter)  # type: ignore[attr-defined]
    saved = self._release_save()  # type: ignore[attr-defined]
    got = False
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = _SLICE if end is None else min(_SLICE, end - time.monotonic())
            if left > 0 and waiter.acquire(True, left):
                got = True
                return True
            if end is not None and time.monotonic() >= end:
                return False
            _rank.me().request("sleep", _SLICE)  # the other ranks run meanwhile
    finally:
        self._acquire_restore(saved)  # type: ignore[attr-defined]
        if not got:
            try:
                self._waiters.remove(waiter)  # type: ignore[attr-defined]
            except ValueError:
                pass


def _starting_a_thread() -> bool:
    """``Thread.start`` waiting for its new thread (a moment, often under a module-wide lock)."""
    f = sys._getframe(3)
    return f is not None and f.f_code is _THREAD_START
