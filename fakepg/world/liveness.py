"""Wall-clock liveness of a fake world: timed waits, cooperative ``time.sleep``, stopping ranks.

Everything here is about time the *program* asked for (a timeout, a sleep, a deadline for
the whole world); the scheduler's own hang verdict needs none of it. Timeouts raise what
the real backend raises, with its wording (kept in :data:`_WORDING`, keyed by backend name),
followed by fakepg's report.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from . import import_waits
from ..errors import BackendTimeoutError, FakePGError, WorldAbortedError, TimedOutError
from .scheduler import BLOCKED, DONE, NEW, RUNNING, Scheduler, helpers_sleeping, monotonic

_REAL_SLEEP = time.sleep

# The failing wait's first line, as each backend words it ({ms}: the timeout in ms).
_GLOO_RECV = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
              "Timed out waiting {ms}ms for recv operation to complete")
_WORDING: dict[str, dict[str, str]] = {
    "gloo": {
        "collective": _GLOO_RECV,
        "monitored_root": "[Rank 0]: Rank {rank} failed to pass monitoredBarrier in {ms} ms\n"
                          " Original exception: \n" + _GLOO_RECV,
        "monitored_root_all": "[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {ms} ms",
        # A zero timeout expires before rank 0 has heard from anyone.
        "monitored_root_expired": "[Rank 0]: Rank {rank} failed to pass monitoredBarrier in {ms} ms\n"
                                  " Original exception: \nRank 0 timed out in monitoredBarrier "
                                  "after {ms} ms.\nNo ranks successfully processed in "
                                  "monitoredBarrier.",
        "monitored_peer": "Rank {me} successfully reached monitoredBarrier, but received errors "
                          "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                          "faulty rank.\n Original exception: \n" + _GLOO_RECV,
    },
}
_WORDING["fakepg"] = _WORDING["gloo"]  # fakepg speaks gloo until told otherwise
# ProcessGroupNCCL's watchdog (SeqNum counts from 1). monitored_barrier does not exist there.
_WORDING["nccl"] = {"collective": "[Rank {rank}] Watchdog caught collective operation timeout: "
                                  "WorkNCCL(SeqNum={seq}, OpType={optype}, NumelIn={numel}, "
                                  "NumelOut={numel}, Timeout(ms)={ms}) ran for {ms} milliseconds "
                                  "before timing out."}


def timeout_message(backend: str, kind: str, **fields: Any) -> str:
    """The backend's message for a timed-out wait of ``kind`` (gloo's where it has none)."""
    table = _WORDING.get(backend, _WORDING["gloo"])
    return table.get(kind, _WORDING["gloo"][kind]).format(**fields)


def backend_of(cluster: Any) -> str:
    """The backend whose personality the world shows (one place to change when it varies)."""
    return getattr(cluster, "backend", "fakepg")


class TimedWait:
    """A scheduler wait's deadline and the errors it fails with (see ``Scheduler.block``)."""

    __slots__ = ("sched", "rank", "seconds", "deadline", "message", "error", "waits_for",
                 "peers_gone")

    def __init__(self, sched: Scheduler, rank: int, seconds: float, message: Callable[[], str],
                 error: type[TimedOutError] = BackendTimeoutError,
                 waits_for: Callable[[], list[int]] | None = None):
        self.sched, self.rank, self.seconds = sched, rank, seconds
        self.deadline = monotonic() + seconds
        self.message, self.error = message, error
        # A wait on named peers alone (monitored_barrier: a recv from each, with a timeout): the
        # ranks it still waits for. Once all of them have finished, only its own timeout can
        # end it, on this rank alone, as gloo's does; the rest of the world is not hung.
        self.waits_for = waits_for
        self.peers_gone = False

    def expired(self) -> TimedOutError:
        """The deadline passed while another rank could still have satisfied the wait (or the
        ranks it waits for have all finished: see ``waits_for``)."""
        if self.peers_gone:
            head = (f"fakepg: rank {self.rank}'s wait can never be satisfied: the ranks it waits "
                    f"for have finished, so it fails with its timeout's error now instead of "
                    f"after {self.seconds:g} s. Per rank at that moment:")
        else:
            head = (f"fakepg: rank {self.rank} gave up after its timeout of {self.seconds:g} s "
                    f"while other ranks were still running. Per rank at that moment:")
        return self.error(self.message(), head + "\n" + rank_states(self.sched), expired=True)

    def hung(self, report: str) -> TimedOutError:
        """The hang verdict: no rank can ever satisfy the wait; fail now, not at the deadline."""
        return self.error(self.message(), report + f"\n(rank {self.rank}'s wait had a timeout of "
                          f"{self.seconds:g} s; it fails at once because no rank can satisfy it)")


def collective_wait(cluster: Any, call: Any, seconds: float | None = None,
                    wait_all_ranks: bool = False) -> TimedWait | None:
    """The timed wait of ``call``'s collective: the group's timeout unless ``seconds`` is given
    (a monitored barrier's zero timeout expires at once; elsewhere zero means none)."""
    coll = call.collective
    expired = call.op == "monitored_barrier" and seconds is not None and seconds <= 0
    seconds = coll.group.timeout if seconds is None else seconds
    if not expired and (not seconds or seconds <= 0):
        return None
    backend = backend_of(cluster)

    def message() -> str:
        ms = int(seconds * 1000)
        if call.op != "monitored_barrier":
            numel = sum(t.numel() for t in call.inputs if hasattr(t, "numel"))
            return timeout_message(backend, "collective", ms=ms, rank=call.rank,
                                   seq=call.record.seq + 1, optype=call.spec.nccl_optype,
                                   numel=numel)
        if call.grank != 0:
            return timeout_message(backend, "monitored_peer", ms=ms, me=call.grank)
        missing = [coll.group.ranks.index(r) for r in coll.missing_ranks()]
        if wait_all_ranks:
            return timeout_message(backend, "monitored_root_all", ms=ms,
                                   ranks=", ".join(map(str, missing)))
        if expired:
            return timeout_message(backend, "monitored_root_expired", ms=0,
                                   rank=missing[0] if missing else "?")
        return timeout_message(backend, "monitored_root", ms=ms, rank=missing[0] if missing else "?")

    waits_for = coll.missing_ranks if call.op == "monitored_barrier" else None
    return TimedWait(cluster.scheduler, call.rank, max(seconds, 1e-9), message,
                     waits_for=waits_for)


# -- time.sleep, the clocks and Python's own waits on rank threads ---------------------------
def _cooperative_sleep(seconds: float) -> None:
    from .binding import current_cluster
    binding = current_cluster()
    if binding is None:  # a thread a rank started (or a process it forked): really sleep
        helpers_sleeping[0] += 1
        try:
            return _REAL_SLEEP(seconds)
        finally:
            helpers_sleeping[0] -= 1
    seconds = float(seconds)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    cluster, rank = binding
    module = import_waits.importing_module()
    if module is not None:  # holding an import lock: keep the baton (see import_waits)
        return import_waits.real_sleep(cluster.scheduler, rank, seconds, _REAL_SLEEP, module,
                                       f"time.sleep({seconds:g})")
    cluster.scheduler.sleep(rank, seconds)
    return None


def _preempting(clock: Callable[[], Any]) -> Callable[[], Any]:
    """``clock`` that, on a rank thread, lets another rank whose timed wait expired fail
    first: a rank busy-waiting on the clock would otherwise hold the baton past every
    deadline (gloo fails the waiting rank at its deadline)."""
    from .binding import thread_binding  # read inline: clocks are read in hot loops

    def read() -> Any:
        binding = getattr(thread_binding, "binding", None)
        if binding is not None and monotonic() >= binding[0].scheduler.next_deadline:
            binding[0].scheduler.preempt_expired(binding[1])
        return clock()

    read.__name__, read.__doc__ = clock.__name__, clock.__doc__
    return read


_REAL_COND_WAIT = threading.Condition.wait
_REAL_JOIN = threading.Thread.join
# The standard library's modules whose waits are Python's own synchronisation: the outermost
# of their frames under the program's names the primitive it called.
_PRIMITIVES = {"threading.py": "threading", "queue.py": "queue", "_base.py": "concurrent.futures",
               "thread.py": "concurrent.futures", "pool.py": "multiprocessing.pool"}


def python_wait_site(frame: Any, primitive: str) -> tuple[str, str]:
    """(primitive, the program's line) of a wait on Python's own synchronisation made at
    ``frame`` (``primitive``: its name when no standard-library frame says more)."""
    from ..sites import FAKEPG_DIR, STDLIB_DIRS, user_site

    f = frame
    while f is not None:
        filename = f.f_code.co_filename
        if not filename.startswith(FAKEPG_DIR):
            module = _PRIMITIVES.get(filename.rsplit("/", 1)[-1])
            if module is None or not filename.startswith(STDLIB_DIRS):
                break
            owner = f.f_locals.get("self")
            name = f.f_code.co_name
            primitive = (f"{module}.{type(owner).__name__}.{name}" if owner is not None
                         else f"{module}.{name}")
        f = f.f_back
    return primitive, user_site(frame=frame)


def _describe(frame: Any, primitive: str) -> Callable[[], str]:
    primitive, site = python_wait_site(frame, primitive)
    text = f"{primitive} at {site} (Python's own synchronisation)"
    return lambda: text


def _starting_a_thread() -> bool:
    """Whether this wait is ``Thread.start`` waiting for its new thread to run (a moment; it is
    often called under a module-wide lock, such as ThreadPoolExecutor.submit's, where handing
    over would let another rank block on that lock in C)."""
    f = sys._getframe(3)  # _cooperative_wait <- Event.wait <- Thread.start
    return f is not None and f.f_code is _THREAD_START


_THREAD_START = threading.Thread.start.__code__


def _cooperative_wait(self: threading.Condition, timeout: float | None = None) -> bool:
    """``Condition.wait`` on a rank thread (and so ``Event.wait``, ``Queue.get``/``put``,
    ``Semaphore``, ``Barrier``, futures' ``result``): the others run while it waits."""
    from .binding import current_cluster
    binding = current_cluster()
    if binding is None or (timeout is not None and timeout <= 0) or _starting_a_thread():
        # a zero timeout only looks (Semaphore.acquire(timeout=0) in ThreadPoolExecutor.submit,
        # under a module-wide lock): handing over there would let a rank block on that lock
        return _REAL_COND_WAIT(self, timeout)
    if not self._is_owned():  # type: ignore[attr-defined]
        raise RuntimeError("cannot wait on un-acquired lock")
    cluster, rank = binding
    module = import_waits.importing_module()
    if module is not None:  # holding an import lock: keep the baton (see import_waits)
        primitive, site = python_wait_site(sys._getframe(1), "threading.Condition.wait")
        return import_waits.wait_for_real(cluster.scheduler, rank,
                                          lambda left: _REAL_COND_WAIT(self, left), timeout,
                                          module, f"{primitive} at {site}")
    waiter = threading._allocate_lock()  # type: ignore[attr-defined]
    waiter.acquire()
    self._waiters.append(waiter)  # type: ignore[attr-defined]
    saved = self._release_save()  # type: ignore[attr-defined]
    got = False
    try:
        got = cluster.scheduler.python_wait(rank, lambda: not waiter.locked(),
                                            _describe(sys._getframe(1), "threading.Condition.wait"), timeout)
        return got
    finally:
        self._acquire_restore(saved)  # type: ignore[attr-defined]
        if not got:
            try:
                self._waiters.remove(waiter)  # type: ignore[attr-defined]
            except ValueError:
                pass


def _cooperative_join(self: threading.Thread, timeout: float | None = None) -> None:
    """``Thread.join`` on a rank thread: the others run while the thread finishes."""
    from .binding import current_cluster
    binding = current_cluster()
    if binding is None or not self._started.is_set() or self is threading.current_thread() \
            or (timeout is not None and timeout <= 0):  # type: ignore[attr-defined]
        return _REAL_JOIN(self, timeout)
    cluster, rank = binding
    module = import_waits.importing_module()
    if module is not None:  # holding an import lock: keep the baton (see import_waits)
        primitive, site = python_wait_site(sys._getframe(1), "threading.Thread.join")

        def joined(left: float) -> bool:
            _REAL_JOIN(self, left)
            return not self.is_alive()

        import_waits.wait_for_real(cluster.scheduler, rank, joined, timeout, module,
                                   f"{primitive} at {site}")
        return None
    cluster.scheduler.python_wait(rank, lambda: not self.is_alive(),
                                  _describe(sys._getframe(1), "threading.Thread.join"), timeout)
    if not self.is_alive():
        _REAL_JOIN(self, 0)
    return None


@contextlib.contextmanager
def cooperative_sleep() -> Iterator[None]:
    """While a world runs, ``time.sleep`` and Python's own waits on a rank thread let the
    other ranks run, and a rank reading the clock lets one whose timed wait expired fail."""
    saved = {name: getattr(time, name) for name in ("sleep", "time", "monotonic", "perf_counter")}
    time.sleep = _cooperative_sleep
    for name in ("time", "monotonic", "perf_counter"):
        setattr(time, name, _preempting(saved[name]))
    threading.Condition.wait = _cooperative_wait  # type: ignore[method-assign]
    threading.Thread.join = _cooperative_join  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(time, name, value)
        threading.Condition.wait = _REAL_COND_WAIT  # type: ignore[method-assign]
        threading.Thread.join = _REAL_JOIN  # type: ignore[method-assign]


# -- reports ---------------------------------------------------------------------------------
def _state(slot: Any) -> str:
    if slot.import_wait is not None:
        return f"waiting in {slot.import_wait}"
    if slot.preempted:
        return "running (a loop reading the clock, paused while timed-out ranks fail)"
    if slot.state == BLOCKED and slot.sleeping:
        return f"sleeping in {slot.waiting_for()}"
    if slot.state == BLOCKED:
        return f"blocked waiting on {slot.waiting_for()}" if slot.waiting_for else "blocked"
    if slot.state == DONE:
        return f"finished ({slot.outcome})"
    return "never started" if slot.state == NEW else "running"


def rank_states(sched: Scheduler) -> str:
    return "\n".join(f"  rank {s.rank}: {_state(s)}" for s in sched.slots)


def rank_stacks(sched: Scheduler, limit: int = 12) -> dict[int, str]:
    """Each live rank's current Python stack, formatted at once (no frame is kept)."""
    frames = sys._current_frames()
    try:
        out = {}
        for slot in sched.slots:
            ident = slot.thread.ident if slot.thread is not None else None
            frame = frames.get(ident) if ident is not None else None
            if frame is not None and slot.state != DONE:
                entries = [e for e in traceback.extract_stack(frame)
                           if not e.filename.endswith("threading.py")]
                out[slot.rank] = "".join(traceback.format_list(entries[-limit:]))
            frame = None
        return out
    finally:
        del frames


def timeout_report(sched: Scheduler, seconds: float) -> str:
    stacks = rank_stacks(sched)  # first: the moment of expiry, before anything else runs
    lines = [f"fakepg: the world ran past its timeout of {seconds:g} s (spawn(timeout=...)); "
             f"every rank was stopped. Per rank, its state and Python stack at that moment:"]
    for slot in sched.slots:
        lines.append(f"  rank {slot.rank}: {_state(slot)}")
        if slot.rank in stacks:
            lines.append("    " + stacks[slot.rank].rstrip().replace("\n", "\n    "))
    lines.append("A rank in a busy loop or a long sleep never reaches a point where another "
                 "rank can run; a hang between ranks is reported at once, without a timeout.")
    return "\n".join(lines)


# -- ending every rank thread ----------------------------------------------------------------
class WorldInterrupted(WorldAbortedError):
    """What the ranks' waits raise when the caller was interrupted (Ctrl-C) during spawn."""


class RankInterrupt(BaseException):
    """Injected into a running rank thread to end it (world timeout, Ctrl-C)."""


def _inject(thread: threading.Thread) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(RankInterrupt))


def end_ranks(sched: Scheduler, cluster: Any, error: FakePGError, grace: float = 0.5) -> list[int]:
    """Abort the world with ``error`` and end every rank thread; returns ranks that would not end.

    Blocked and sleeping ranks are released with ``error`` by the scheduler; the rank that
    runs Python code is interrupted with :class:`RankInterrupt` (again, should it swallow
    it); one stuck on a fakepg Work from C++ sees that Work fail."""
    sched.abort(error)
    threads = [s.thread for s in sched.slots if s.thread is not None]
    last_shot: dict[int, float] = {}
    give_up = time.monotonic() + grace
    while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
        if sched.current is not None and sched.slots[sched.current].state == RUNNING \
                and time.monotonic() - last_shot.get(sched.current, time.monotonic()) > 0.1:
            # the baton holder does not come back from C code: wake a parked rank, which
            # raises the error and hands over to the next as it ends
            for slot in sched.slots:
                if slot.state in (BLOCKED, NEW) and sched.wake_after_verdict(slot.rank):
                    break
        for slot in sched.slots:
            t = slot.thread
            if t is None or not t.is_alive() or slot.state != RUNNING:
                continue
            now = time.monotonic()
            if now - last_shot.get(slot.rank, -1e9) > 0.1:
                last_shot[slot.rank] = now
                _inject(t)
                for c in list(cluster.outstanding[slot.rank]):
                    if c.work is not None and not c.work._done:
                        c.work._complete(error)
        for t in threads:
            if t.is_alive():  # not one whose start() the interrupt cut short (join would raise)
                t.join(0.02)
    return [s.rank for s in sched.slots if s.thread is not None and s.thread.is_alive()]


def stuck_sites(sched: Scheduler, ranks: list[int]) -> str:
    """Where each of ``ranks`` (threads that could not be stopped) is: the program's line."""
    from ..sites import user_site

    frames = sys._current_frames()
    try:
        out = []
        for r in ranks:
            t = sched.slots[r].thread
            frame = frames.get(t.ident) if t is not None else None
            out.append(f"rank {r} at {user_site(frame=frame) if frame is not None else '?'}")
            frame = None
        return "; ".join(out)
    finally:
        del frames
