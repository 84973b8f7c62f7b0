"""``fakepg.spawn``: run ``fn(rank, *args)`` on N ranks of a fake cluster inside this process."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed.distributed_c10d as c10d

from . import backends, liveness
from . import faults as _faults
from . import trace as _trace
from .arguments import integer, number
from .cluster import Cluster, bind_thread, current_cluster
from .errors import (CollectiveHangError, CollectiveMismatchError, FakePGError, RankFailedError,
                     SpawnTimeoutError)
from .hooks import WorldHooks
from .gloo_hazards import GlooHazards
from .nccl_hazards import NcclHazards, parse_modes
from .isolation import ProcessState
from .patches import _ORIGINAL_INIT, _PG_TIMEOUT, world_patches
from .process_group import BACKEND_NAME, register_backend
from .profiling import world_profilers
from .schedule import Schedule, as_schedule
from .scheduler import Scheduler
from .sites import _short
from .store import world_store, world_stores
from .trace import CollectiveRecord

try:  # numpy's global RNG is isolated per rank too; import it up front so all ranks see it
    import numpy  # noqa: F401
except ImportError:  # pragma: no cover
    pass

_SPAWN_LOCK = threading.Lock()


@dataclass
class SpawnResult:
    """What a fake world leaves behind."""

    returns: list[Any]
    trace: list[list[CollectiveRecord]]
    nprocs: int
    seed: int
    wall_time: float = 0.0
    crashed: list[int] = field(default_factory=list)  # ranks an injected crash ended

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The collective trace as JSON (bitwise identical for identical runs)."""
        return _trace.to_json(self.trace, path)

    def dump_flight_recorder(self, directory: str | os.PathLike, prefix: str = "rank") -> list[str]:
        """Write torch Flight Recorder dumps, one per rank, readable by ``fr_trace``."""
        return _trace.dump_flight_recorder(self.trace, directory, prefix)

    def summary(self) -> str:
        """A per-rank table of collectives issued: op -> count, bytes."""
        lines = []
        for rank, recs in enumerate(self.trace):
            counts: dict[str, list[int]] = {}
            for r in recs:
                c = counts.setdefault(r.op, [0, 0])
                c[0] += 1
                c[1] += r.bytes
            parts = ", ".join(f"{op}×{n} ({b / 1e6:.2f} MB)" for op, (n, b) in sorted(counts.items()))
            lines.append(f"rank {rank}: {len(recs)} collectives: {parts}")
        return "\n".join(lines)


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, *, seed: int = 0,
          hooks: WorldHooks | None = None, hang_timeout: float = 1.0,
          master_port: int = 29500,
          env: Callable[[int], Mapping[str, str]] | Mapping[str, str] | None = None,
          timeout: float | None = None, backend: str = "fakepg",
          schedule: "Schedule | str | None" = None,
          nccl_hazards: str | Mapping[str, str] | None = None,
          faults: Sequence[Any] | None = None, isolation: str = "thread",
          gloo_hazards: str = "error") -> SpawnResult:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks of a deterministic in-process cluster.

    Inside ``fn``, torch.distributed is already initialised with the ``"fakepg"`` backend
    (``dist.init_process_group`` by unmodified code is accepted and returns the same
    world). Ranks run one at a time, switching only where one must wait for another, so
    the same program and ``seed`` give bitwise-identical results and traces.

    ``seed`` fixes each rank's initial torch/Python/numpy RNG state (a function of seed
    and rank). ``hang_timeout`` bounds the inactivity fallback for waits hidden in C++.
    ``env`` adds environment variables for every rank (a mapping) or per rank (a function
    of the rank), over the launcher's RANK/WORLD_SIZE/...; each rank sees its own values.
    ``timeout`` (seconds of wall clock, default none) bounds the whole world: past it every
    rank is stopped and :class:`SpawnTimeoutError` reports each rank's state and stack.
    ``backend`` is the personality the world shows until the program asks for another with
    ``init_process_group`` (see :mod:`fakepg.backends`): ``"fakepg"`` (permissive),
    ``"gloo"`` or ``"nccl"`` (their names, refusals and timeout wording). ``nccl_hazards``
    (``"error"``, ``"warn"``, ``"off"``, a mapping per hazard, or None for the defaults) says
    what NCCL's hazards do under the nccl personality (:mod:`fakepg.nccl_hazards`:
    inconsistent order across communicators, unbatched crossing isend/irecv, CPU tensors).
    ``gloo_hazards`` (``"error"``, ``"warn"``, ``"off"``) does the same for gloo's: a
    collective issued from a future callback racing the program's own on that group
    (:mod:`fakepg.gloo_hazards`).
    ``schedule`` (a token from :func:`fakepg.explore`, or a :class:`fakepg.schedule.Schedule`)
    replays one alternative interleaving; None is the default schedule. ``faults`` (from
    :mod:`fakepg.faults`) crash a rank or make it raise at a chosen collective.
    ``isolation="process"`` runs each rank in its own OS process forked from this one
    (:mod:`fakepg.process_mode`): the same world, results and reports, with everything a
    process owns (module globals, pid, cwd, signal handlers) really per rank.

    Example::

        def train(rank):
            t = torch.ones(2) * rank
            dist.all_reduce(t)
            return t

        result = fakepg.spawn(train, nprocs=4)
        assert result.returns[0].tolist() == [6.0, 6.0]
    """
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    if not callable(fn):
        raise TypeError(f"fakepg.spawn: fn must be callable, got {type(fn).__name__} {fn!r}")
    nprocs = integer("fakepg.spawn: nprocs", nprocs, minimum=1)
    seed = integer("fakepg.spawn: seed", seed)
    hang_timeout = number("fakepg.spawn: hang_timeout", hang_timeout, positive=True,
                          hint="seconds of inactivity before a wait hidden in C++ counts as a hang")
    if current_cluster() is not None:
        raise FakePGError("fakepg.spawn cannot be nested inside a rank of another fake world")
    if timeout is not None:
        timeout = number("fakepg.spawn: timeout", timeout, positive=True, hint="seconds, or None")
    backends.get(backend)  # a clear error for an unknown name
    schedule = as_schedule(schedule)
    hazard_modes = parse_modes(nccl_hazards)
    gloo = GlooHazards(gloo_hazards)  # a clear error for an unknown mode
    faults = _faults.check(faults, nprocs)
    if isolation not in ("thread", "process"):
        raise ValueError(f"fakepg.spawn: isolation must be 'thread' or 'process', got {isolation!r}")
    if isolation == "process" and hooks is not None:
        # World hooks (simddp's clocks) run on the rank's thread and watch its ops there; the
        # ops of a rank process run elsewhere, so their timing would be silently wrong.
        raise ValueError("fakepg.spawn: hooks (simddp's co-simulation) need isolation='thread': "
                         "a rank process's ops run outside the world's threads")
    if not _SPAWN_LOCK.acquire(blocking=False):
        raise FakePGError("another fakepg world is running in this process; worlds run one "
                          "after another (use pytest-xdist for parallelism)")
    try:
        return _run_world(fn, tuple(args), nprocs, seed, hooks, hang_timeout, master_port, env,
                          timeout, backend, schedule, hazard_modes, faults, isolation, gloo)
    finally:
        _SPAWN_LOCK.release()


def spawn_nested(fn: Callable[..., Any], args: Sequence[Any], nprocs: int, *, seed: int,
                 isolation: str, master_port: int) -> SpawnResult:
    """A whole new world run to its end from inside a rank (``torch.multiprocessing.spawn``
    called by the program): the launching rank waits in it, as ``mp.spawn(join=True)`` waits."""
    __tracebackhide__ = True
    nprocs = integer("torch.multiprocessing.spawn: nprocs", nprocs, minimum=1)
    return _run_world(fn, tuple(args), nprocs, seed, None, 1.0, master_port, None, None,
                      "fakepg", as_schedule(None), parse_modes(None), (), isolation)


def _run_world(fn, args, nprocs, seed, hooks, hang_timeout, master_port, extra_env,
               timeout, backend, schedule, hazard_modes=None, faults=(),
               isolation="thread", gloo_hazards=None) -> SpawnResult:
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    register_backend()
    t0 = time.perf_counter()
    cluster = Cluster(nprocs, seed, hooks)
    cluster.backend = backend
    cluster.faults = faults
    cluster.hazards = NcclHazards(hazard_modes)
    if gloo_hazards is not None:
        cluster.gloo_hazards = gloo_hazards
    extra = extra_env if callable(extra_env) else (lambda r: extra_env or {})  # noqa: E731
    processes = [ProcessState.for_rank(r, nprocs, seed,
                                       {**_rank_env(r, nprocs, master_port), **_str_env(extra(r))})
                 for r in range(nprocs)]
    host = ProcessState()
    host.save()
    children = None
    if isolation == "process":  # fork the ranks' processes before any rank thread exists
        from .process_mode import Children
        children = Children(fn, args, processes, seed)
        fn, args = children.serve, ()
    try:
        return _run_ranks(fn, args, nprocs, seed, hang_timeout, master_port, timeout, backend,
                          cluster, processes, host, schedule, t0)
    finally:
        if children is not None:
            children.close()


def _run_ranks(fn, args, nprocs, seed, hang_timeout, master_port, timeout, backend, cluster,
               processes, host, schedule, t0) -> SpawnResult:
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    sched = Scheduler(processes, cluster.hang_report)
    sched.schedule = schedule
    cluster.scheduler = sched
    returns: list[Any] = [None] * nprocs
    failures: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        bind_thread(cluster, rank)
        sched.enter(rank)
        outcome = "returned"
        try:
            if isinstance(sched.abort_error, _STOPPED):
                raise sched.abort_error  # stopped before it ever ran
            cluster.hooks.rank_started(rank)
            _ORIGINAL_INIT(backend=BACKEND_NAME, rank=rank, world_size=nprocs,
                           store=world_store(_PG_TIMEOUT), timeout=_PG_TIMEOUT)
            returns[rank] = fn(rank, *args)
            cluster.complete_ready(rank)
        except _faults.RankCrashed:
            outcome = "crashed (fakepg.faults.crash)"
        except BaseException as e:  # noqa: BLE001 - every rank failure is reported by spawn
            failures[rank] = e
            outcome = f"raised {type(e).__name__}"
            ends_world = not isinstance(e, FakePGError) or getattr(e, "ends_world", False)
            ends_world = ends_world and not isinstance(sched.abort_error, _STOPPED)
            if ends_world and cluster.failed_rank is None:
                cluster.failed_rank = rank
                site = _exception_site(e)
                sched.abort(RankFailedError(rank, f"rank {rank} raised {type(e).__name__}: {e} (at {site})"))
        finally:
            try:
                cluster.hooks.rank_finished(rank)
                if c10d.is_initialized():
                    _destroy_quietly()
            finally:
                bind_thread(None)
                sched.finish(rank, outcome)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"fakepg-rank{r}", daemon=True)
               for r in range(nprocs)]
    for r, t in enumerate(threads):
        sched.slots[r].thread = t
    try:
        _run_threads(threads, sched, cluster, hang_timeout, host, master_port, timeout)
    finally:
        _ENDED_RANK_THREADS[:] = [t.native_id for t in threads if t.native_id is not None]
    result = SpawnResult(returns, cluster.trace, nprocs, seed, time.perf_counter() - t0,
                         sorted(cluster.dead))
    if isinstance(sched.abort_error, SpawnTimeoutError):
        raise SpawnTimeoutError(sched.abort_error.report)
    _raise_outcome(sched, cluster, failures)
    return result


_DEPTH: list[Cluster] = []  # the worlds running in this process, outermost first
_ENDED_RANK_THREADS: list[int] = []  # OS thread ids of the last world's rank threads


def outermost_cluster() -> Cluster | None:
    """The world this process runs at top level (None when none runs)."""
    return _DEPTH[0] if _DEPTH else None


def ended_rank_thread_ids() -> list[int]:
    """The OS thread ids of the last world's rank threads (a fork waits for them to be gone)."""
    return list(_ENDED_RANK_THREADS)


def _rank_env(rank: int, nprocs: int, master_port: int) -> dict[str, str]:
    """The launcher's environment variables, as torchrun sets them for ``rank``."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port)}


def _run_threads(threads: list[threading.Thread], sched: Scheduler, cluster: Cluster,
                 hang_timeout: float, host: ProcessState, master_port: int,
                 timeout: float | None) -> None:
    """Run the rank threads to their end under the world's patches; restore the host."""
    multithreading = torch.autograd.is_multithreading_enabled()
    excepthook = sys.excepthook
    with world_patches(len(threads)), world_profilers(), world_stores("127.0.0.1", master_port), \
            liveness.cooperative_sleep():
        torch.autograd.set_multithreading_enabled(False)  # backward runs on the rank's thread
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _DEPTH.append(cluster)
        try:
            _run_to_end(sched, cluster, threads, hang_timeout, timeout)
        finally:
            _DEPTH.pop()
            if not _DEPTH:  # a world nested in a rank leaves its outer world's mode on
                torch._C._distributed_c10d._set_thread_isolation_mode(False)
            torch.autograd.set_multithreading_enabled(multithreading)
            host.install()
            sys.excepthook = excepthook  # init_process_group prefixes it with "[rankN]"


def _str_env(env: Mapping[str, str]) -> dict[str, str]:
    bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"fakepg.spawn: env names and values must be strings, got {bad!r}")
    return dict(env)


_STOPPED = (SpawnTimeoutError, liveness.WorldInterrupted)  # the world was stopped from outside


def _run_to_end(sched: Scheduler, cluster: Cluster, threads: list[threading.Thread],
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


def _watch(sched: Scheduler, cluster: Cluster, hang_timeout: float, deadline: float | None) -> bool:
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


def _raise_outcome(sched: Scheduler, cluster: Cluster, failures: dict[int, BaseException]) -> None:
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    if cluster.failed_rank is not None:
        r = cluster.failed_rank
        e = failures[r]
        raise RankFailedError(r, f"rank {r} failed: {type(e).__name__}: {e}\n"
                                 f"(raised at {_exception_site(e)})") from e
    if sched.hang is not None:
        raise CollectiveHangError(sched.hang.report)
    for e in failures.values():
        if isinstance(e, CollectiveMismatchError):
            raise CollectiveMismatchError(*e.args)
    for r, e in failures.items():
        raise RankFailedError(r, f"rank {r} failed: {type(e).__name__}: {e}") from e


def _exception_site(e: BaseException) -> str:
    remote = getattr(e, "_fakepg_site", None)  # raised in a rank's process (isolation="process")
    if remote is not None:
        return remote
    frames = traceback.extract_tb(e.__traceback__)
    for fr in reversed(frames):
        if "/torch/" not in fr.filename and "/fakepg/" not in fr.filename:
            return f"{_short(fr.filename)}:{fr.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "<unknown>"


def _destroy_quietly() -> None:
    with contextlib.suppress(Exception):
        c10d.destroy_process_group()
