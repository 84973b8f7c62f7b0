"""Watching a running world from the caller's thread: its end, its deadline, and the
inactivity fallback that catches the baton holder stuck in a wait inside C++."""

from __future__ import annotations

import builtins
import dis
import linecache
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from . import import_waits, liveness
from ..errors import CollectiveHangError, SpawnTimeoutError
from .scheduler import BLOCKED, ThreadActivity
from ..sites import STDLIB_DIRS, user_site

if TYPE_CHECKING:
    from .cluster import Cluster
    from .scheduler import Scheduler


def run_to_end(sched: "Scheduler", cluster: "Cluster", threads: list[threading.Thread],
               hang_timeout: float, timeout: float | None) -> None:
    """Run the world until every rank thread ended -- also on a timeout or Ctrl-C."""
    baton_given = False
    stuck: list[int] = []
    sched.clocks.watcher = threading.get_native_id()  # runnable while it looks: not a helper
    try:
        for t in threads:
            t.start()
        sched._hand_over(len(threads) - 1)  # baton to rank 0
        baton_given = True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not _watch(sched, cluster, hang_timeout, deadline):
            error = SpawnTimeoutError(liveness.timeout_report(sched, timeout))
            stuck = liveness.end_ranks(sched, cluster, error)
        for rank, t in enumerate(threads):
            if rank not in stuck and rank not in sched.stuck:
                t.join()
        give_up = time.monotonic() + _STUCK_GRACE  # an RLock's owner freed it as it ended
        for rank in sched.stuck:
            threads[rank].join(max(0.0, give_up - time.monotonic()))
    except BaseException:  # KeyboardInterrupt (or anything) in the caller: no rank outlives it
        error = liveness.WorldInterrupted(
            "fakepg: the caller was interrupted while the world ran; every rank was stopped")
        sched.abort(error)
        if not baton_given and sched.current is None:
            sched._hand_over(len(threads) - 1)  # started ranks end once they get the baton
        liveness.end_ranks(sched, cluster, error)
        raise
    left = [r for r in sched.stuck if threads[r].is_alive()]
    if left:  # blocked on a lock only its owner can release (an RLock), which did not
        stacks = liveness.rank_stacks(sched)
        raise CollectiveHangError(f"{sched.abort_error.report}\nrank {left[0]}'s thread could not "
                                  f"be stopped: only the lock's owner can release it, and its "
                                  f"owner did not as it ended; it is left running, at:\n"
                                  f"{stacks.get(left[0], '(no Python frame)')}")
    if stuck:  # in C code that never returns to Python: nothing more can be done
        raise SpawnTimeoutError(f"{sched.abort_error.report}\nranks {stuck} could not be stopped "
                                f"(they are inside C code: {liveness.stuck_sites(sched, stuck)}); "
                                f"their threads are left running, bound to this ended world "
                                f"(any wait they reach raises its error), and the next world "
                                f"starts without them")


def _watch(sched: "Scheduler", cluster: "Cluster", hang_timeout: float, deadline: float | None) -> bool:
    """Wait for the world to end (True) or its deadline to pass (False); catch the baton
    holder stuck in an invisible C++ wait."""
    # The loop allocates nothing and touches no rank's frames while the world is healthy:
    # both could shift when the garbage collector runs or how long a tensor stays referenced
    # (autograd then clones instead of stealing a gradient) and so break determinism.
    seen: tuple | None = None
    activity: ThreadActivity | None = None
    lock: Any = _UNKNOWN
    while not sched.finished.wait(0.05):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        holder = sched.current
        if holder is None or sched.abort_error is not None:
            seen = None
            continue
        idle = time.monotonic() - sched.last_progress_time
        hidden = bool(cluster.outstanding[holder])
        if idle < hang_timeout / 2:
            seen = None
            continue
        # Suspicious: no scheduler event for a while. A thread that burns CPU (Python code,
        # an import, a long kernel) is working; one blocked in a wait inside C++ (on its
        # outstanding Works) or on a lock burns none.
        thread = sched.slots[holder].thread
        cpu = _cpu_seconds(sched, holder)
        if seen is None or seen[0] != holder or cpu - seen[1] > 0.002 or not sched.clocks.asleep(holder):
            if seen is not None:
                sched.last_progress_time = time.monotonic()
            seen, activity, lock = (holder, cpu, time.monotonic()), None, _UNKNOWN
            continue
        blocked_import = import_waits.module_lock_holder(thread)
        if blocked_import is not None and _module_lock_verdict(sched, cluster, holder, blocked_import):
            continue
        if idle < hang_timeout or time.monotonic() - seen[2] < hang_timeout / 2:
            # (the second: seen asleep, without CPU, for half the timeout at least -- not
            # once or twice around a pause of this thread's own on a loaded machine)
            continue
        if not hidden:
            if activity is None:  # measure the other threads over the next poll first
                activity = ThreadActivity(sched.clocks)
                continue
            if activity.busy():  # another thread works: it may release the holder
                sched.last_progress_time = time.monotonic()
                continue
            waiting = sched.slots[holder].import_wait
            if waiting is not None:  # a real wait inside an import nothing will end
                _verdict(sched, cluster, import_waits.import_wait_verdict(holder, waiting, idle))
                continue
            if lock is _UNKNOWN:  # once per episode: the lock it is blocked on, or None
                lock = blocked_lock(thread)
            if lock is not None:
                _lock_verdict(sched, cluster, holder, idle, lock)
            continue
        # The holder has outstanding Works and has not touched the scheduler for
        # hang_timeout seconds: it is (almost certainly) waiting on one from C++.
        err = _verdict(sched, cluster, (
            f"rank {holder} made no scheduler progress "
            f"for {idle:.1f} s while it had outstanding collectives, so it is most likely "
            f"blocked in a wait inside C++ (torch.futures.wait_all, a C++ future) that fakepg "
            f"cannot see. Wait on the Work or its get_future() from Python instead."))
        for c in list(cluster.outstanding[holder]):
            if c.work is not None and not c.work._done:
                c.work._complete(err)  # unblocks the C++ wait with the error
    return True


def _cpu_seconds(sched: "Scheduler", rank: int) -> float:
    """CPU time rank ``rank``'s thread has used (its child's, in process mode), read only while
    that thread is alive (see fakepg.world.cpu_clocks); where it cannot be read, a value that
    keeps moving (so the fallback never mistakes work for a wait where it cannot tell)."""
    cpu = sched.clocks.read(rank)
    return time.monotonic() if cpu is None else cpu


# -- a rank blocked on a lock ---------------------------------------------------------------
_CALLS = {"CALL", "PRECALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_KW", "BEFORE_WITH",
          "KW_NAMES", "PUSH_NULL", "CACHE"}
_BASES = {"LOAD_FAST", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF",
          "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"}


def blocked_lock(thread: threading.Thread | None) -> tuple[str, str, Any] | None:
    """(how the program spelled it, where, the lock) when ``thread`` is blocked acquiring a
    ``threading.Lock``/``RLock`` (``with x.lock:``, ``lock.acquire()``); else None."""
    frame = sys._current_frames().get(getattr(thread, "ident", None))
    try:
        if frame is None:
            return None
        code = frame.f_code
        before = [i for i in dis.get_instructions(code) if i.offset <= frame.f_lasti]
        entering = False  # `with x:` (the expression ends right before) or `x.acquire(...)`
        while before and before[-1].opname in _CALLS:
            entering = entering or before[-1].opname == "BEFORE_WITH"
            before.pop()
        if not entering:  # acquire(True), acquire(timeout=t): drop the arguments
            for back in range(1, min(len(before), 8) + 1):
                ins = before[-back]
                if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in ("acquire", "__enter__"):
                    del before[len(before) - back + 1:]
                    break
        chain: list[str] = []
        while before and before[-1].opname in ("LOAD_ATTR", "LOAD_METHOD"):
            chain.insert(0, str(before.pop().argval))
        if not before or before[-1].opname not in _BASES:
            return _locked_local(frame)
        base = str(before[-1].argval)
        scopes = (frame.f_locals, frame.f_globals, vars(builtins))
        obj = next((scope[base] for scope in scopes if base in scope), None)
        if chain and chain[-1] in ("acquire", "__enter__"):
            chain.pop()
        for name in chain:
            obj = getattr(obj, name, None)
        if isinstance(obj, threading.Condition):  # `with cond:` blocks on the lock inside it
            obj = obj._lock  # type: ignore[attr-defined]
        if not isinstance(obj, (_LOCK_TYPE, _RLOCK_TYPE)):
            return _locked_local(frame)
        spelled = ".".join([base, *chain])
        user = frame  # the program's frame: a Condition's `with` blocks inside threading.py
        while user.f_back is not None and user.f_code.co_filename.startswith(STDLIB_DIRS):
            user = user.f_back
        if user is not frame:
            owner = frame.f_locals.get("self")
            spelled = f"(inside a {type(owner).__module__}.{type(owner).__name__})"
        line = re.sub(r"\s+#.*$", "", linecache.getline(user.f_code.co_filename, user.f_lineno).strip())
        return spelled, f"{line}` at {user_site(frame=user)}", obj
    finally:
        del frame


def _locked_local(frame: Any) -> tuple[str, str, Any] | None:
    """Where the statement does not say which lock (an unusual spelling): the one lock held
    by somebody among the frame's local variables, if there is exactly one."""
    held = [(name, v) for name, v in frame.f_locals.items()
            if isinstance(v, (_LOCK_TYPE, _RLOCK_TYPE)) and _held(v)]
    if len(held) != 1:
        return None
    name, lock = held[0]
    line = re.sub(r"\s+#.*$", "", linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip())
    return name, f"{line}` at {user_site(frame=frame)}", lock


def _held(lock: Any) -> bool:
    return lock.locked() if isinstance(lock, _LOCK_TYPE) else "<locked" in repr(lock)


_LOCK_TYPE = type(threading.Lock())
_UNKNOWN = object()
_STUCK_GRACE = 2.0  # seconds a rank blocked on an RLock gets once its owner has ended
_RLOCK_TYPE = type(threading.RLock())


def _verdict(sched: "Scheduler", cluster: "Cluster", why: str) -> CollectiveHangError:
    """End the world with the inactivity fallback's hang verdict, explained by ``why``."""
    err = CollectiveHangError(f"{cluster.hang_report()}\nDetected by the inactivity fallback: {why}")
    sched.hang = err
    sched.abort(err)
    return err


def _lock_verdict(sched: "Scheduler", cluster: "Cluster", holder: int, idle: float,
                  found: tuple[str, str, Any]) -> None:
    spelled, where, lock = found
    kind = "threading.Lock" if isinstance(lock, _LOCK_TYPE) else "threading.RLock"
    sched.slots[holder].waiting_for = lambda: f"acquiring {kind} {spelled} in `{where}"
    _verdict(sched, cluster, (
        f"rank {holder} has been blocked for {idle:.1f} s "
        f"acquiring {kind} {spelled} in `{where}, while no other rank could run and no other "
        f"thread of the process did anything: only a rank that cannot run could release it. "
        f"Between processes each rank has its own lock; one that is a module global is shared "
        f"by the ranks only in thread mode: run the ranks as processes (fakerun --isolation "
        f"process, or fakepg.spawn(..., isolation='process'))."))
    if isinstance(lock, _LOCK_TYPE) and lock.locked():
        lock.release()  # the world is over: let the rank go on to its next wait, which fails
    else:  # an RLock: only its owner can release it, as it unwinds (spawn's rank threads do)
        sched.stuck.append(holder)
        sched.stuck_locks.append(lock)
        owner = re.search(r"owner=(\d+)", repr(lock))
        ident = int(owner.group(1)) if owner else None
        parked = [s.rank for s in sched.slots if s.rank != holder and s.state == BLOCKED]
        first = next((s.rank for s in sched.slots if s.thread is not None
                      and s.thread.ident == ident and s.rank in parked), None)
        for rank in ([first] if first is not None else []) + parked:
            if sched.wake_after_verdict(rank):  # the owner first: it unwinds, frees the lock
                break


def _module_lock_verdict(sched: "Scheduler", cluster: "Cluster", holder: int,
                         found: tuple[str, int | None]) -> bool:
    """The baton holder is blocked on the import lock of a module another rank is importing
    while parked: that rank can never run again to finish the import. End the world naming
    both, and let the importing rank unwind (which frees the lock, and so the holder)."""
    module, owner_ident = found
    owner = next((s for s in sched.slots if s.thread is not None and s.thread.ident == owner_ident
                  and s.rank != holder), None)
    if owner is None or owner.state != BLOCKED:
        return False  # another thread imports it (it will finish), or a rank that runs
    what = owner.waiting_for() if owner.waiting_for is not None else "a wait"
    _verdict(sched, cluster, (
        f"rank {holder} is blocked importing module {module}, which rank {owner.rank} is "
        f"importing: rank {owner.rank} waits, inside {module}'s top-level code, on {what}, and "
        f"holds Python's import lock for {module} meanwhile. In thread mode the ranks share "
        f"one import system, so rank {holder} cannot import {module} until rank {owner.rank} "
        f"has finished, which needs rank {holder}. Import {module} before the ranks start "
        f"(before fakepg.spawn), or run the ranks as processes (fakerun --isolation process, "
        f"or fakepg.spawn(..., isolation='process'))."))
    sched.wake_after_verdict(owner.rank)  # it raises the verdict, unwinds, frees the lock
    return True
