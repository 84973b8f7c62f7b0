"""One rank runs at a time: a baton passed between rank threads at blocking points.

A rank runs until it has to wait for something (a collective other ranks have not
issued yet, a point-to-point peer). It then saves its process state and hands the
baton to the next rank, in round-robin order, whose wait can be satisfied. Because
every choice depends only on program order, runs are deterministic, and "no rank can
take the baton" is an exact, immediate hang verdict -- no wall-clock timeout needed.

Wall-clock time enters only where the program asks for it: a rank in ``time.sleep`` or
in a wait with a timeout (a :class:`~fakepg.world.liveness.TimedWait`) is runnable again at its
deadline. While some rank sleeps, nobody is hung: when no rank can run, the scheduler
really sleeps until the earliest deadline. Without sleepers, timed waits do not delay the
verdict -- a wait nobody can ever satisfy fails at once, with its timeout's error.

A rank may also wait in Python's own synchronisation (a ``queue.Queue``, ``threading.Event``,
``Condition``, a future: :mod:`fakepg.world.liveness` makes those waits park here, as *python
waits*). Another rank, or a thread the ranks started, may release it; so when no rank can
run and one waits so, the verdict comes after an inactivity window (``inactivity`` seconds)
in which no other thread of the process did anything. A thread the program started during
the world that sits inside a native call (a C++/Rust client waiting on a server: torchft's
quorum over gRPC, held for seconds by its lighthouse) may still release them: while one does,
the verdict waits up to ``native_grace`` seconds instead, and then names it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

from ..errors import CollectiveHangError, FakePGError
from .cpu_clocks import ThreadClocks
from .isolation import ProcessState
from ..choices.schedule import Schedule

NEW, RUNNING, BLOCKED, DONE = "new", "running", "blocked", "done"

# The real clock, taken before fakepg.world.liveness makes time.monotonic a preemption point on
# rank threads: the scheduler's own reads of it must not preempt.
monotonic = time.monotonic
_real_sleep = time.sleep  # likewise, before rank threads' time.sleep hands the baton over
_INF = float("inf")
# Threads the ranks started that are in a real time.sleep (fakepg.world.liveness counts them):
# such a thread will do something, so the ranks' python waits are not over yet.
helpers_sleeping = [0]

# Where a waiting thread's innermost Python frame is Python's own synchronisation (or fakepg's
# own waits): such a thread waits on the process's objects, not on something outside it.
_SYNC_FILES = tuple(os.path.join(os.path.dirname(threading.__file__), name) for name in
                    ("threading.py", "queue.py", os.path.join("concurrent", "futures", ""),
                     os.path.join("multiprocessing", "")))
_FAKEPG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def native_waiters(skip: Any) -> list[str]:
    """Threads of this process (not in ``skip``, not the caller) whose innermost Python frame
    is in program or library code rather than Python's synchronisation or fakepg: asleep
    there, they are inside a native call (a C++ or Rust client waiting on a server), which
    may yet return. Each as ``"name at file:line"``."""
    frames = sys._current_frames()
    me = threading.get_ident()
    out = []
    for t in threading.enumerate():
        if t.ident == me or t in skip:
            continue
        frame = frames.get(t.ident)  # type: ignore[arg-type]
        if frame is None:
            continue
        path = frame.f_code.co_filename
        if path.startswith(_SYNC_FILES) or os.path.abspath(path).startswith(_FAKEPG_DIR):
            continue
        out.append(f"{t.name} at {path}:{frame.f_lineno}")
    return out


class _Wake:
    """A one-shot event on a bare lock: the scheduler's real waits run on rank threads, where
    threading.Event's (Condition.wait) is cooperative while a world runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def wait(self, seconds: float) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=max(0.0, seconds)):
            self._lock.release()
            return True
        return False


class ThreadActivity:
    """Whether threads other than the ranks' used CPU since the last call, or are runnable
    (they may yet release a rank that waits in Python's own synchronisation)."""

    def __init__(self, clocks: ThreadClocks) -> None:
        self.clocks = clocks  # read only while a rank thread is alive (see cpu_clocks)
        self.last = self._others()

    def _others(self) -> float:
        return time.process_time() - self.clocks.total()

    def busy(self, threshold: float = 0.002) -> bool:
        now = self._others()
        busy, self.last = now - self.last > threshold or helpers_sleeping[0] > 0, now
        # one that used no CPU may only be waiting for a core (a loaded machine): it works
        return busy or self.clocks.others_runnable()


class RankSlot:
    __slots__ = ("rank", "sem", "state", "ready", "waiting_for", "process", "thread", "outcome",
                 "deadline", "timed", "sleeping", "python_wait", "preempted", "import_wait",
                 "handed")

    def __init__(self, rank: int, process: ProcessState) -> None:
        self.rank = rank
        self.sem = threading.Lock()
        self.sem.acquire()  # released when this rank is given the baton
        self.state = NEW
        self.ready: Callable[[], bool] | None = None
        self.waiting_for: Callable[[], str] | None = None
        self.process = process
        self.thread: threading.Thread | None = None
        self.outcome = "running"  # "returned", "raised <Exc>" when done
        self.deadline: float | None = None  # time.monotonic() at which a timed wait/sleep ends
        self.timed: Any = None  # the TimedWait of the current wait, if it has a timeout
        self.sleeping = False  # in time.sleep: runnable at its deadline, keeps the world live
        self.python_wait = False  # in Python's own synchronisation (see Scheduler.python_wait)
        self.preempted = False  # busy on the clock, paused for another rank's expired wait
        self.import_wait: str | None = None  # a real wait inside an import (import_waits)
        self.handed = False  # given the baton, not yet awake: no second hand-over may pick it


class Scheduler:
    """Passes the baton among ``len(processes)`` rank threads."""

    # The longest a python-wait verdict waits for a thread the program started that is inside
    # a native call (see the module's doc): torchft's lighthouse holds a quorum for seconds
    # while an earlier job's replica still heartbeats (5 s by default).
    native_grace = 15.0

    def __init__(self, processes: list[ProcessState], describe_world: Callable[[], str]):
        self.slots = [RankSlot(r, p) for r, p in enumerate(processes)]
        self.n = len(processes)
        self.current: int | None = None
        self.abort_error: FakePGError | None = None  # set once: every later wait raises it
        self.hang: CollectiveHangError | None = None
        self.finished = threading.Event()
        self.last_progress_time = monotonic()
        self.inactivity = 1.0  # seconds of a world idle but for python waits before the verdict
        self.python_verdict = False  # the hang verdict came from the inactivity window
        self.stuck: list[int] = []  # ranks blocked on a lock only its owner can release
        self.stuck_locks: list[Any] = []  # those RLocks: their owner rank frees them as it ends
        self.next_deadline = _INF  # earliest deadline of a parked timed wait (for preemption)
        self._describe_world = describe_world
        self._mu = threading.Lock()
        self._wake = _Wake()  # set by abort: ends a real sleep until a deadline
        self.schedule = Schedule()  # the controlled choices (fakepg.choices.schedule); default: none
        self.clocks = ThreadClocks()  # the rank threads' CPU clocks, while they live
        self.native_waiters: list[str] = []  # those the verdict waited for, for its report
        self._threads_before = weakref.WeakSet(threading.enumerate())  # not the program's

    # -- called on rank threads, by the baton holder ------------------------------
    def enter(self, rank: int) -> None:
        """Block until ``rank`` first gets the baton, then install its process state."""
        slot = self.slots[rank]
        slot.sem.acquire()
        slot.handed = False
        slot.process.install()
        slot.state = RUNNING
        self.current = rank
        self._tick()

    def block(self, rank: int, ready: Callable[[], bool], waiting_for: Callable[[], str],
              timed: Any = None) -> None:
        """Yield until ``ready()`` holds (evaluated by whichever rank hands over).

        ``timed`` (a :class:`~fakepg.world.liveness.TimedWait`) gives the wait a deadline: past
        it, while ``ready()`` still fails, ``timed.expired()`` is raised; when the hang
        verdict ends the world, ``timed.hung(report)`` is raised instead of the plain
        hang error, so the rank sees its backend's timeout error at once.
        """
        if self.abort_error is not None:
            raise self._abort_error_for(timed)
        if ready():
            return
        self._park(rank, ready, waiting_for, timed, None if timed is None else timed.deadline)
        if self.abort_error is not None:
            raise self._abort_error_for(timed)
        if timed is not None and not ready():
            raise timed.expired()

    def sleep(self, rank: int, seconds: float) -> None:
        """``time.sleep`` on a rank thread: let the others run; runnable again at the deadline."""
        if self.abort_error is not None:
            raise self.abort_error
        until = monotonic() + max(0.0, seconds)
        self._park(rank, lambda: False, lambda: f"time.sleep({seconds:g})",
                   None, until, sleeping=True)
        if self.abort_error is not None:
            raise self.abort_error

    def python_wait(self, rank: int, ready: Callable[[], bool], waiting_for: Callable[[], str],
                    timeout: float | None) -> bool:
        """A wait in Python's own synchronisation: yield until ``ready()`` holds (True) or
        ``timeout`` seconds passed (False). While it waits the others run; if none can, the
        world is hung once nothing else in the process moved for ``inactivity`` seconds."""
        if self.abort_error is not None:
            return self._python_wait_after_end(ready, timeout)
        if ready():
            return True
        deadline = None if timeout is None else monotonic() + max(0.0, timeout)
        self._park(rank, ready, waiting_for, None, deadline, sleeping=deadline is not None,
                   python_wait=True)
        if self.abort_error is not None:
            raise self.abort_error
        return bool(ready())

    def _python_wait_after_end(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """A python wait once the world has ended (a rank that caught its hang or timeout
        error cleans up, as torch's test harness joins its pipe-listener thread): no baton
        to hand over, so wait for real, for the inactivity window at most; what has not
        happened by then never will, and the world's error is raised."""
        window = self.inactivity if timeout is None else min(max(0.0, timeout), self.inactivity)
        end = monotonic() + window
        while not ready():
            if monotonic() >= end:
                if timeout is not None and timeout <= self.inactivity:
                    return False  # the program's own timeout passed first
                raise self.abort_error  # type: ignore[misc]
            _real_sleep(0.001)
        return True

    def preempt_expired(self, rank: int) -> None:
        """A point where a busy rank looks at the clock: if another rank's timed wait has
        passed its deadline meanwhile, let that rank fail now, as it would on its own
        process, before going on."""
        now = monotonic()
        if now < self.next_deadline or self.abort_error is not None or self.current != rank:
            return
        later = [s.deadline for s in self.slots if s.state == BLOCKED and s.deadline is not None
                 and (s.timed is not None or s.python_wait) and s.deadline > now]
        self.next_deadline = min(later, default=_INF)
        if any(s.state == BLOCKED and s.rank != rank and s.deadline is not None
               and (s.timed is not None or s.python_wait) and s.deadline <= now for s in self.slots):
            slot = self.slots[rank]
            slot.preempted = True
            try:
                self.sleep(rank, 0.0)
            finally:
                slot.preempted = False

    def preempt(self, rank: int) -> None:
        """A point where another process could have run first (a store operation): under an
        active schedule, the choice ``"preempt"`` may hand the baton on before going on."""
        if not self.schedule.active or self.abort_error is not None:
            return
        if not any(s.rank != rank and self._runnable(s) for s in self.slots):
            return
        if self.schedule.choose("preempt", 2):
            self.sleep(rank, 0.0)

    def _park(self, rank: int, ready: Callable[[], bool], waiting_for: Callable[[], str],
              timed: Any, deadline: float | None, sleeping: bool = False,
              python_wait: bool = False) -> None:
        slot = self.slots[rank]
        slot.ready, slot.waiting_for = ready, waiting_for
        slot.timed, slot.deadline, slot.sleeping = timed, deadline, sleeping
        slot.python_wait = python_wait
        if deadline is not None and (timed is not None or python_wait) and deadline < self.next_deadline:
            self.next_deadline = deadline
        slot.state = BLOCKED
        slot.process.save()
        self._hand_over(rank)
        slot.sem.acquire()
        slot.handed = False
        slot.process.install()
        slot.state = RUNNING
        slot.ready = slot.waiting_for = slot.timed = slot.deadline = None
        slot.sleeping = slot.python_wait = False
        self.current = rank
        self._tick()

    def _skip_threads(self) -> set:
        """Threads that are not the program's helpers: those alive before the world started
        (the caller's, the watchdog's) and the ranks'."""
        return {*self._threads_before, *(s.thread for s in self.slots if s.thread is not None)}

    def _abort_error_for(self, timed: Any) -> BaseException:
        err = self.abort_error
        if timed is not None and err is self.hang and err is not None:
            return timed.hung(err.report)
        return err  # type: ignore[return-value]

    def finish(self, rank: int, outcome: str) -> None:
        slot = self.slots[rank]
        slot.state = DONE
        slot.outcome = outcome
        slot.process.save()
        self._hand_over(rank)

    def abort(self, error: FakePGError) -> None:
        """End the world: every blocked wait, and every later one, raises ``error``."""
        if self.abort_error is None:
            self.abort_error = error
        self._wake.set()

    # -- internals --------------------------------------------------------------
    def _tick(self) -> None:
        self.last_progress_time = monotonic()

    def _runnable(self, slot: RankSlot) -> bool:
        if slot.handed:
            return False
        if slot.state == NEW:
            return True
        if slot.state == BLOCKED:
            return (self.abort_error is not None or bool(slot.ready())
                    or (slot.deadline is not None and monotonic() >= slot.deadline))
        return False

    def _hand_over(self, rank: int) -> None:
        with self._mu:
            nxt = self._pick(rank)
            activity: ThreadActivity | None = None
            idle_since = 0.0
            while nxt is None and self.abort_error is None:
                sleepers = any(s.state == BLOCKED and s.sleeping for s in self.slots)
                python = any(s.state == BLOCKED and s.python_wait for s in self.slots)
                if not sleepers and not python:
                    break
                # Nobody can run now, but a sleeper will at its deadline, and a python wait
                # may be released by a thread the ranks started: wait (really).
                self.current = None
                now = monotonic()
                pause = min((s.deadline for s in self.slots
                             if s.state == BLOCKED and s.deadline is not None), default=_INF) - now
                if python:
                    if activity is None or activity.busy():
                        activity = activity or ThreadActivity(self.clocks)
                        idle_since = now
                        self.native_waiters = []
                    elif not sleepers and now - idle_since >= self.inactivity:
                        if now - idle_since < self.native_grace:
                            self.native_waiters = native_waiters(self._skip_threads())
                        if not self.native_waiters or now - idle_since >= self.native_grace:
                            self.python_verdict = True
                            break
                    pause = min(pause, 0.01)
                self._wake.wait(max(0.0, pause))
                nxt = self._pick(rank)
            if nxt is None and self._expire_waits_on_finished_peers():
                nxt = self._pick(rank)
            if nxt is None and any(s.state == BLOCKED for s in self.slots):
                # Nobody can run, somebody waits: a hang, decided exactly.
                report = self._describe_world()
                self.hang = CollectiveHangError(report)
                self.abort(self.hang)
                nxt = self._pick(rank)
            if nxt is None:
                self.current = None
                self.finished.set()
                return
            self._give(nxt)

    def _give(self, rank: int) -> None:
        """Hand the baton to ``rank`` (under ``_mu``): it is no longer a candidate at once, so
        that no other hand-over gives it a second time before it wakes."""
        slot = self.slots[rank]
        slot.handed = True
        self.current = rank
        slot.sem.release()

    def wake_after_verdict(self, rank: int) -> bool:
        """The world has ended while its baton holder is blocked in C (on a lock, an import):
        wake ``rank``, parked, so that it raises the verdict and unwinds (freeing what the
        holder waits for); the ranks' own hand-overs then end the rest."""
        with self._mu:
            slot = self.slots[rank]
            if self.abort_error is None or slot.state not in (BLOCKED, NEW) or slot.handed:
                return False
            self._give(rank)
            return True

    def _expire_waits_on_finished_peers(self) -> bool:
        """Timed waits on peers that have all finished (see ``TimedWait.waits_for``) end now
        with their timeout's error, on their ranks alone; True if there was one."""
        found = False
        for slot in self.slots:
            timed = slot.timed
            if slot.state != BLOCKED or timed is None or timed.waits_for is None:
                continue
            if all(self.slots[r].state == DONE for r in timed.waits_for()):
                timed.peers_gone = True
                slot.deadline = 0.0  # runnable now; its block() raises timed.expired()
                found = True
        return found

    def _pick(self, rank: int) -> int | None:
        if self.schedule.active:  # every runnable rank is an option, round-robin order first
            options = [(rank + i) % self.n for i in range(1, self.n + 1)
                       if self._runnable(self.slots[(rank + i) % self.n])]
            return options[self.schedule.choose("run", len(options))] if options else None
        for i in range(1, self.n + 1):
            r = (rank + i) % self.n
            if self._runnable(self.slots[r]):
                return r
        return None
