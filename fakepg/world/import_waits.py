"""Waits inside an import: a rank that holds Python's import lock keeps the baton.

A module being imported is locked (``importlib._bootstrap._ModuleLock``) until its top-level
code has run. If that code waits -- a sleep, a thread pool's result, an event -- and the rank
handed the baton over there, the next rank to import the same module would block on the lock
*in C*, holding the baton, and the world would stop for good (torchft waits so in its
telemetry module). So, inside an import, a rank's sleep and Python waits are the real ones:
the rank keeps the baton until the import is done, as a process would, and the other ranks
run once it is. A wait that only another rank could end then gets a verdict naming the wait
and the module (the watchdog, :func:`import_wait_verdict`), after the usual inactivity window.

A rank whose import waits for another rank through the scheduler (a collective in a module's
top-level code) hands the baton over as any wait does; a rank that then blocks on that
module's lock is reported at once by the watchdog (:func:`module_lock_holder`), naming both.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .scheduler import Scheduler

_BOOTSTRAP = "<frozen importlib._bootstrap>"
_SLICE = 0.02  # seconds between looks at the world's end while waiting for real


def importing_module(frame: Any = None) -> str | None:
    """The innermost module the calling thread is importing (and so holds the lock of)."""
    f = sys._getframe(1) if frame is None else frame
    while f is not None:
        code = f.f_code
        if code.co_name == "_find_and_load" and code.co_filename == _BOOTSTRAP:
            name = f.f_locals.get("name")
            return name if isinstance(name, str) else "?"
        f = f.f_back
    return None


def real_sleep(sched: "Scheduler", rank: int, seconds: float, sleep: Callable[[float], Any],
               module: str, text: str) -> None:
    """``time.sleep`` inside an import: really sleep, keeping the baton."""
    wait_for_real(sched, rank, lambda: False, max(0.0, seconds), module, text, sleep)


def wait_for_real(sched: "Scheduler", rank: int, ready: Callable[[float], bool],
                  timeout: float | None, module: str, text: str,
                  sleep: Callable[[float], Any] | None = None) -> bool:
    """Wait for ``ready(slice)`` (which may itself block up to ``slice`` seconds) or the
    timeout, keeping the baton; the world's end (a verdict) raises its error."""
    slot = sched.slots[rank]
    slot.import_wait = f"{text}, inside `import {module}` (holding its import lock)"
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            if sched.abort_error is not None:
                raise sched.abort_error
            left = _SLICE if end is None else min(_SLICE, end - time.monotonic())
            if left <= 0:
                return False
            if sleep is not None:
                sleep(left)
                sched.last_progress_time = time.monotonic()  # a sleep ends by itself
            elif ready(left):
                return True
    finally:
        slot.import_wait = None


def import_wait_verdict(holder: int, text: str, idle: float) -> str:
    """Why the world is hung when the baton holder waits inside an import on something no
    other thread did anything about."""
    return (f"rank {holder} has waited {idle:.1f} s in {text}, while no other thread of the "
            f"process did anything. A rank keeps the baton while it imports a module (another "
            f"rank importing the same module would block on its lock), so no other rank can "
            f"run meanwhile: a wait there that needs another rank never ends in thread mode. "
            f"Import the module before the ranks start (before fakepg.spawn, at the top of a "
            f"conftest), or run the ranks as processes (fakerun --isolation process, or "
            f"fakepg.spawn(..., isolation='process')).")


def module_lock_holder(thread: threading.Thread | None) -> tuple[str, int | None] | None:
    """(module, the ident of the thread importing it) when ``thread`` is blocked acquiring a
    module's import lock; else None."""
    frame = sys._current_frames().get(getattr(thread, "ident", None))
    try:
        f = frame
        while f is not None and f.f_code.co_filename == _BOOTSTRAP:
            lock = f.f_locals.get("self")
            if f.f_code.co_name == "acquire" and hasattr(lock, "owner") and hasattr(lock, "name"):
                return str(lock.name), getattr(lock, "owner", None)
            f = f.f_back
        return None
    finally:
        del frame, f
