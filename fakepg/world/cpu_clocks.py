"""CPU clocks of rank threads, read only while the thread is known to be alive.

``pthread_getcpuclockid(thread.ident)`` on a thread that has ended reads glibc's freed thread
descriptor: once glibc gives that stack back to the kernel the read is a SIGSEGV that takes
the whole process down (it did, every few dozen worlds, under torch's test_c10d_gloo.py).
So no clock here is read through a thread descriptor, and none after its thread ended:

- each rank thread registers its kernel thread id itself, when it starts, and retires it
  itself, before it ends, under the same lock every read holds: a registered thread cannot
  end between the check and the read;
- the read is a bare ``clock_gettime`` on Linux's clock id for that kernel thread id (a
  syscall that fails with EINVAL for a thread that is gone; it never touches user memory);
- at retirement the thread adds its own CPU time to ``retired``, so that the ranks' total
  does not drop when one leaves (which would look like another thread burning CPU).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

# Linux's clock id of a thread's CPU clock (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)).
_PERTHREAD_SCHED = 4 | 2


def _thread_clock_id(tid: int) -> int:
    return (~tid << 3) | _PERTHREAD_SCHED


class ThreadClocks:
    """The CPU clocks of a world's live rank threads (one per rank key)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._tids: dict[int, int] = {}  # rank -> kernel thread id, while the thread is alive
        self._custom: dict[int, Callable[[], float]] = {}  # rank -> a clock it named itself
        self._pids: dict[int, int] = {}  # rank -> the process that does its work (process mode)
        self._working: dict[int, Callable[[], bool]] = {}  # rank -> "works now", as it says itself
        self.retired = 0.0  # CPU seconds of rank threads that have retired
        self.watcher: int | None = None  # the kernel id of the thread watching the world

    def register(self, rank: int, clock: Callable[[], float] | None = None,
                 pid: int | None = None, working: Callable[[], bool] | None = None) -> None:
        """Called on the rank's own thread as it starts (``clock``: read instead of the
        thread's own, e.g. a process-mode proxy reports its child process's CPU time; ``pid``:
        the process whose threads' states say whether the rank works; ``working``: True while
        the rank is known to work whatever the kernel says, e.g. a proxy serving its child's
        request while the child sleeps waiting for the reply)."""
        with self._mu:
            self._tids[rank] = threading.get_native_id()
            if clock is not None:
                self._custom[rank] = clock
            if pid is not None:
                self._pids[rank] = pid
            if working is not None:
                self._working[rank] = working

    def retire(self, rank: int) -> None:
        """Called on the rank's own thread before it ends: no read of its clock after this."""
        with self._mu:
            if self._tids.pop(rank, None) is not None:
                self.retired += time.thread_time()
            self._custom.pop(rank, None)
            self._pids.pop(rank, None)
            self._working.pop(rank, None)

    def read(self, rank: int) -> float | None:
        """The CPU seconds rank ``rank`` used (its own clock if it named one); None when its
        thread is not (or no longer) registered."""
        with self._mu:
            custom = self._custom.get(rank)
            if custom is not None:
                return custom()
            tid = self._tids.get(rank)
            if tid is None:
                return None
            try:
                return time.clock_gettime(_thread_clock_id(tid))
            except OSError:
                return None

    def total(self) -> float:
        """CPU seconds used by the rank threads, live and retired (their own threads' CPU
        time, never a clock a rank named: this is what counts against the process's)."""
        with self._mu:
            total = self.retired
            for tid in self._tids.values():
                try:
                    total += time.clock_gettime(_thread_clock_id(tid))
                except OSError:
                    pass
            return total

    def others_runnable(self) -> bool:
        """Whether a thread of this process other than the ranks', the world's watcher and
        the caller is runnable or in disk I/O (R, D): it works, though it may not have had a
        core since it was last looked at."""
        with self._mu:
            skip = {*self._tids.values(), self.watcher, threading.get_native_id()}
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return False
        return any(_state(f"/proc/self/task/{t}/stat") in (b"R", b"D")
                   for t in tasks if int(t) not in skip)

    def asleep(self, rank: int) -> bool:
        """Whether the kernel has the rank's thread (in process mode: every thread of its
        process), and every thread of the processes it started, asleep in a wait (Linux state
        S), and the rank does not say it works. A thread that is runnable but starved of a
        core (R) -- as a rank process is on a loaded machine -- stopped (T, as by SIGSTOP), or
        in disk I/O such as a cold import (D) burns no CPU either, yet is not blocked; nor is
        a rank waiting in C (``os.system``, ``waitpid``) on a child process of its own that
        works. Where the state cannot be read: True (CPU time decides)."""
        with self._mu:
            pid = self._pids.get(rank)
            tid = self._tids.get(rank)
            working = self._working.get(rank)
        if pid is None and tid is None:
            return True
        if working is not None and working():
            return False
        me = os.getpid()
        if pid is None:  # the rank's thread, and the processes that thread started
            tasks = [(me, str(tid))] + [(p, t) for c in _children(me, str(tid))
                                        for p in _tree(c) for t in _tasks(p)]
        else:
            tasks = [(p, t) for p in _tree(pid) for t in _tasks(p)]
        return all(_state(f"/proc/{p}/task/{t}/stat") in _WAITING for p, t in tasks)


# States of a task that does nothing until something else happens: asleep in a wait (S), or
# ended (a zombie not yet reaped, Z; dead, X; gone, None).
_WAITING = (b"S", b"Z", b"X", None)


def _state(path: str) -> bytes | None:
    """A task's Linux state letter (R, S, D, T, ...) from its stat file; None when gone."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rindex(b")")
    return stat[end + 2:end + 3]


def _children(pid: int, tid: str) -> list[int]:
    """The processes thread ``tid`` of ``pid`` started (Linux's /proc/PID/task/TID/children)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return []


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendant processes."""
    out, todo = [], [pid]
    while todo and len(out) < 256:  # a bound: a fork bomb must not stall the watchdog
        p = todo.pop()
        out.append(p)
        for t in _tasks(p):
            todo.extend(_children(p, t))
    return out


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
