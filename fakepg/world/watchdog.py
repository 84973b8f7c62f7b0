"""Watching a running world from the caller's thread: its end, its deadline, and the
inactivity fallback that catches the baton holder stuck in a wait inside C++."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from . import liveness
from ..errors import CollectiveHangError, SpawnTimeoutError

if TYPE_CHECKING:
    from .cluster import Cluster
    from .scheduler import Scheduler


def run_to_end(sched: "Scheduler", cluster: "Cluster", threads: list[threading.Thread],
               hang_timeout: float, timeout: float | None) -> None:
    """Run the world until every rank thread ended -- also on a timeout or Ctrl-C."""
    baton_given = False
    stuck: list[int] = []
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
            if rank not in stuck:
                t.join()
    except BaseException:  # KeyboardInterrupt (or anything) in the caller: no rank outlives it
        error = liveness.WorldInterrupted(
            "fakepg: the caller was interrupted while the world ran; every rank was stopped")
        sched.abort(error)
        if not baton_given and sched.current is None:
            sched._hand_over(len(threads) - 1)  # started ranks end once they get the baton
        liveness.end_ranks(sched, cluster, error)
        raise
    if stuck:  # in C code that never returns to Python: nothing more can be done
        raise SpawnTimeoutError(f"{sched.abort_error.report}\nranks {stuck} could not be stopped "
                                f"(they are inside C code); their threads are left running")


def _watch(sched: "Scheduler", cluster: "Cluster", hang_timeout: float, deadline: float | None) -> bool:
    """Wait for the world to end (True) or its deadline to pass (False); catch the baton
    holder stuck in an invisible C++ wait."""
    # The loop allocates nothing and touches no rank's frames while the world is healthy:
    # both could shift when the garbage collector runs or how long a tensor stays referenced
    # (autograd then clones instead of stealing a gradient) and so break determinism.
    seen: tuple | None = None
    while not sched.finished.wait(0.05):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        holder = sched.current
        if holder is None or sched.abort_error is not None:
            seen = None
            continue
        idle = time.monotonic() - sched.last_progress_time
        if idle < hang_timeout / 2 or not cluster.outstanding[holder]:
            seen = None
            continue
        # Suspicious: outstanding Works and no scheduler event for a while. A thread that
        # burns CPU (Python code, an import, a long kernel) is working; one blocked in a wait
        # inside C++ burns none.
        thread = sched.slots[holder].thread
        cpu = _cpu_seconds(thread)
        if seen is None or seen[0] != holder or cpu - seen[1] > 0.002 or not _asleep(thread):
            if seen is not None:
                sched.last_progress_time = time.monotonic()
            seen = (holder, cpu)
            continue
        if idle < hang_timeout:
            continue
        # The holder has outstanding Works and has not touched the scheduler for
        # hang_timeout seconds: it is (almost certainly) waiting on one from C++.
        report = cluster.hang_report() + (
            f"\nDetected by the inactivity fallback: rank {holder} made no scheduler progress "
            f"for {idle:.1f} s while it had outstanding collectives, so it is most likely "
            f"blocked in a wait inside C++ (torch.futures.wait_all, a C++ future) that fakepg "
            f"cannot see. Wait on the Work or its get_future() from Python instead.")
        err = CollectiveHangError(report)
        sched.hang = err
        sched.abort(err)
        for c in list(cluster.outstanding[holder]):
            if c.work is not None and not c.work._done:
                c.work._complete(err)  # unblocks the C++ wait with the error
    return True


def _cpu_seconds(thread: threading.Thread | None) -> float:
    """CPU time ``thread`` has used; without per-thread clocks, a value that keeps moving
    (so the fallback never mistakes work for a wait where it cannot tell)."""
    clock = getattr(thread, "fakepg_cpu_clock", None)  # a proxy thread: its child's CPU time
    if clock is not None:
        return clock()
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[union-attr]
    except (AttributeError, OSError, TypeError):
        return time.monotonic()


def _asleep(thread: threading.Thread | None) -> bool:
    """Whether the kernel has ``thread`` asleep in a wait (Linux state S). A thread that is
    runnable but starved of a core (R), or in disk I/O such as a cold import (D), burns no
    CPU either, yet is working. Where the state cannot be read: True (CPU time decides)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat", "rb") as f:  # type: ignore[union-attr]
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"S"
    except (AttributeError, OSError, ValueError, TypeError):
        return True
