"""One rank runs at a time: a baton passed between rank threads at blocking points.

A rank runs until it has to wait for something (a collective other ranks have not
issued yet, a point-to-point peer). It then saves its process state and hands the
baton to the next rank, in round-robin order, whose wait can be satisfied. Because
every choice depends only on program order, runs are deterministic, and "no rank can
take the baton" is an exact, immediate hang verdict -- no wall-clock timeout needed.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .errors import CollectiveHangError, FakePGError
from .isolation import ProcessState

NEW, RUNNING, BLOCKED, DONE = "new", "running", "blocked", "done"


class RankSlot:
    __slots__ = ("rank", "sem", "state", "ready", "waiting_for", "process", "thread", "outcome")

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


class Scheduler:
    """Passes the baton among ``len(processes)`` rank threads."""

    def __init__(self, processes: list[ProcessState], describe_world: Callable[[], str]):
        self.slots = [RankSlot(r, p) for r, p in enumerate(processes)]
        self.n = len(processes)
        self.current: int | None = None
        self.abort_error: FakePGError | None = None  # set once: every later wait raises it
        self.hang: CollectiveHangError | None = None
        self.finished = threading.Event()
        self.last_progress_time = time.monotonic()
        self._describe_world = describe_world
        self._mu = threading.Lock()

    # -- called on rank threads, by the baton holder ------------------------------
    def enter(self, rank: int) -> None:
        """Block until ``rank`` first gets the baton, then install its process state."""
        slot = self.slots[rank]
        slot.sem.acquire()
        slot.process.install()
        slot.state = RUNNING
        self.current = rank
        self._tick()

    def block(self, rank: int, ready: Callable[[], bool], waiting_for: Callable[[], str]) -> None:
        """Yield until ``ready()`` holds (evaluated by whichever rank hands over)."""
        if self.abort_error is not None:
            raise self.abort_error
        if ready():
            return
        slot = self.slots[rank]
        slot.ready, slot.waiting_for = ready, waiting_for
        slot.state = BLOCKED
        slot.process.save()
        self._hand_over(rank)
        slot.sem.acquire()
        slot.process.install()
        slot.state = RUNNING
        slot.ready = slot.waiting_for = None
        self.current = rank
        self._tick()
        if self.abort_error is not None:
            raise self.abort_error

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

    # -- internals --------------------------------------------------------------
    def _tick(self) -> None:
        self.last_progress_time = time.monotonic()

    def _runnable(self, slot: RankSlot) -> bool:
        if slot.state == NEW:
            return True
        if slot.state == BLOCKED:
            return self.abort_error is not None or bool(slot.ready())
        return False

    def _hand_over(self, rank: int) -> None:
        with self._mu:
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
            self.current = nxt
            self.slots[nxt].sem.release()

    def _pick(self, rank: int) -> int | None:
        for i in range(1, self.n + 1):
            r = (rank + i) % self.n
            if self._runnable(self.slots[r]):
                return r
        return None
