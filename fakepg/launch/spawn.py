"""``fakepg.spawn``: run ``fn(rank, *args)`` on N ranks of a fake cluster inside this process.

This module starts a world (its cluster, scheduler, per-rank process state and rank threads)
and ends it; :mod:`fakepg.world.watchdog` watches it run, :mod:`fakepg.world.outcome` says what it left.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed.distributed_c10d as c10d

from ..torch_private import set_thread_isolation_mode
from ..fidelity import backends
from ..world import isolation, liveness, module_hooks, subprocess_waits
from ..choices import faults as _faults
from ..arguments import function, integer, number, of_type
from ..world.binding import bind_thread, current_cluster
from ..world.checks import Checkers
from ..world.cluster import Cluster
from ..errors import FakePGError, SpawnTimeoutError
from ..world.hooks import WorldHooks
from ..fidelity.gloo_checks import ArgumentChecks
from ..fidelity.gloo_hazards import GlooHazards
from ..fidelity.nccl_hazards import NcclHazards, parse_modes
from ..world.isolation import ProcessState
from ..world.outcome import SpawnResult, during_hang, ended_how, raise_outcome
from ..fidelity.originals import PG_TIMEOUT, TORCH_INIT_PROCESS_GROUP
from ..fidelity.patches import world_patches
from ..process import mp_spawn
from ..world.process_group import BACKEND_NAME, FakeProcessGroup, register_backend
from ..fidelity.profiling import world_profilers
from ..choices.schedule import Schedule, as_schedule
from ..world.scheduler import Scheduler
from ..fidelity.store import native_store_guard, world_store, world_stores
from ..world.watchdog import run_to_end

try:  # numpy's global RNG is isolated per rank too; import it up front so all ranks see it
    import numpy  # noqa: F401
except ImportError:  # pragma: no cover
    pass

_SPAWN_LOCK = threading.Lock()
_STOPPED = (SpawnTimeoutError, liveness.WorldInterrupted)  # the world was stopped from outside


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, *, seed: int = 0,
          hooks: WorldHooks | None = None, hang_timeout: float = 1.0,
          master_port: int = 29500,
          env: Callable[[int], Mapping[str, str]] | Mapping[str, str] | None = None,
          timeout: float | None = None, backend: str = "fakepg",
          schedule: "Schedule | str | None" = None,
          nccl_hazards: str | Mapping[str, str] | None = None,
          faults: Sequence[Any] | None = None, isolation: str = "thread",
          gloo_hazards: str = "error", init_process_group: bool = True) -> SpawnResult:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks of a deterministic in-process cluster.

    Inside ``fn``, torch.distributed is already initialised with the ``"fakepg"`` backend
    (``dist.init_process_group`` by unmodified code is accepted and returns the same
    world). ``init_process_group=False`` starts each rank as torchrun starts a worker
    instead: nothing initialised until the program calls ``dist.init_process_group``, whose
    backend and timeout then hold (``fakerun`` and :mod:`fakepg.launch.suites` run ranks so).
    Ranks run one at a time, switching only where one must wait for another, so the same
    program and ``seed`` give bitwise-identical results and traces.

    ``seed`` fixes each rank's initial torch/Python/numpy RNG state (a function of seed
    and rank). ``hang_timeout`` bounds the inactivity fallback for waits hidden in C++.
    ``env`` adds environment variables for every rank (a mapping) or per rank (a function
    of the rank), over the launcher's RANK/WORLD_SIZE/...; each rank sees its own values.
    A rank starts with the intra-op thread count its ``OMP_NUM_THREADS`` gives (``env`` first,
    then the caller's environment); unset, one thread per rank in a world of several, as
    torchrun starts its workers (the caller's own count is back after the world).
    ``timeout`` (seconds of wall clock, default none) bounds the whole world: past it every
    rank is stopped and :class:`SpawnTimeoutError` reports each rank's state and stack.
    ``backend`` is the personality the world shows until the program asks for another with
    ``init_process_group`` (see :mod:`fakepg.fidelity.backends`): ``"fakepg"`` (permissive),
    ``"gloo"`` or ``"nccl"`` (their names, refusals and timeout wording). ``nccl_hazards``
    (``"error"``, ``"warn"``, ``"off"``, a mapping per hazard, or None for the defaults) says
    what NCCL's hazards do under the nccl personality (:mod:`fakepg.fidelity.nccl_hazards`:
    inconsistent order across communicators, unbatched crossing isend/irecv, CPU tensors).
    ``gloo_hazards`` (``"error"``, ``"warn"``, ``"off"``) does the same for gloo's: a
    collective issued from a future callback racing the program's own on that group
    (:mod:`fakepg.fidelity.gloo_hazards`).
    ``schedule`` (a token from :func:`fakepg.explore`, or a :class:`fakepg.choices.schedule.Schedule`)
    replays one alternative interleaving; None is the default schedule. ``faults`` (from
    :mod:`fakepg.faults`) crash a rank or make it raise at a chosen collective.
    ``isolation="process"`` runs each rank in its own OS process forked from this one
    (:mod:`fakepg.process.process_mode`): the same world, results and reports, with everything a
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
    function("fakepg.spawn: fn", fn, what="callable")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        hint = (f"; to run {args} ranks, write fakepg.spawn(fn, nprocs={args})"
                if isinstance(args, int) and not isinstance(args, bool) else "")
        raise TypeError(f"fakepg.spawn: args must be a tuple of fn's arguments after the rank, "
                        f"got {args!r} ({type(args).__name__}){hint}")
    nprocs = integer("fakepg.spawn: nprocs", nprocs, minimum=1)
    if env is not None and not callable(env):
        of_type("fakepg.spawn: env", env, Mapping, "a mapping of variable names to strings, a "
                "function of the rank returning one, or None", hint="e.g. env={'OMP_NUM_THREADS': '1'}")
    if hooks is not None:
        of_type("fakepg.spawn: hooks", hooks, WorldHooks, "a fakepg.WorldHooks (simddp's "
                "co-simulation passes one) or None")
    seed = integer("fakepg.spawn: seed", seed)
    hang_timeout = number("fakepg.spawn: hang_timeout", hang_timeout, positive=True,
                          hint="seconds of inactivity before a wait hidden in C++ counts as a hang")
    if current_cluster() is not None:
        raise FakePGError("fakepg.spawn cannot be nested inside a rank of another fake world")
    if timeout is not None:
        timeout = number("fakepg.spawn: timeout", timeout, positive=True, hint="seconds, or None")
    backends.get(backend)  # a clear error for an unknown name
    schedule = as_schedule(schedule)
    schedule.check_world(nprocs)
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
    if not isinstance(init_process_group, bool):
        raise TypeError(f"fakepg.spawn: init_process_group must be True (the world is initialised "
                        f"before fn runs) or False (fn initialises it), got {init_process_group!r}")
    if not _SPAWN_LOCK.acquire(blocking=False):
        raise FakePGError("another fakepg world is running in this process; worlds run one "
                          "after another (use pytest-xdist for parallelism)")
    try:
        result = _run_world(fn, tuple(args), nprocs, seed, hooks, hang_timeout, master_port, env,
                            timeout, backend, schedule, hazard_modes, faults, isolation, gloo,
                            init_process_group)
    except BaseException as failure:
        try:
            schedule.check_replayed()
        except ValueError as unfit:  # a token that did not fit explains the failure
            raise unfit from failure
        raise
    finally:
        _SPAWN_LOCK.release()
    schedule.check_replayed()
    return result


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
               isolation="thread", gloo_hazards=None, init=True) -> SpawnResult:
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    register_backend()
    module_hooks.declare()  # torch.nn's global module hooks: one set per rank, as per process
    t0 = time.perf_counter()
    cluster = Cluster(nprocs, seed, hooks)
    cluster.backend = backend
    cluster.personalities = backends.PERSONALITIES
    cluster.faults = faults
    # every check the world runs, in the order it runs them: torch looks at the devices before
    # the backend sees the call, so NCCL's device check comes before the refusals
    cluster.checkers = Checkers([ArgumentChecks(), NcclHazards(hazard_modes), backends.Refusals(),
                                 gloo_hazards if gloo_hazards is not None else GlooHazards()])
    extra = extra_env if callable(extra_env) else (lambda r: extra_env or {})  # noqa: E731
    processes = [ProcessState.for_rank(r, nprocs, seed,
                                       {**_rank_env(r, nprocs, master_port), **_str_env(extra(r))})
                 for r in range(nprocs)]
    host = ProcessState()
    host.save()
    if isolation == "process":  # fork the ranks' processes before any rank thread exists
        from ..process.process_mode import forked_ranks
        with forked_ranks(fn, args, processes, seed, ended_rank_thread_ids(),
                          spawn_nested, init) as children:  # each child initialises its own
            return _run_ranks(children.serve, (), nprocs, seed, hang_timeout, master_port,
                              timeout, backend, cluster, processes, host, schedule, t0, False)
    return _run_ranks(fn, args, nprocs, seed, hang_timeout, master_port, timeout, backend,
                      cluster, processes, host, schedule, t0, init)


def _run_ranks(fn, args, nprocs, seed, hang_timeout, master_port, timeout, backend, cluster,
               processes, host, schedule, t0, init=True) -> SpawnResult:
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    sched = Scheduler(processes, cluster.hang_report)
    sched.schedule = schedule
    sched.inactivity = hang_timeout
    cluster.scheduler = sched
    returns: list[Any] = [None] * nprocs
    failures: dict[int, BaseException] = {}

    def rank_thread(rank: int) -> None:
        sched.clocks.register(rank)  # its CPU clock is read only until it retires (cpu_clocks)
        try:
            rank_main(rank)
        finally:
            sched.clocks.retire(rank)

    def rank_main(rank: int) -> None:
        bind_thread(cluster, rank)
        sched.enter(rank)
        outcome = "returned"
        try:
            if isinstance(sched.abort_error, _STOPPED):
                raise sched.abort_error  # stopped before it ever ran
            cluster.hooks.rank_started(rank)
            if init:
                TORCH_INIT_PROCESS_GROUP(backend=BACKEND_NAME, rank=rank, world_size=nprocs,
                                         store=world_store(PG_TIMEOUT), timeout=PG_TIMEOUT)
            returns[rank] = fn(rank, *args)
            cluster.complete_ready(rank)
        except _faults.RankCrashed:
            outcome = "crashed (fakepg.faults.crash)"
        except BaseException as e:  # noqa: BLE001 - every rank failure is reported by spawn
            if sched.hang is not None and rank in sched.stuck:
                # freed from a lock after the hang verdict, it ran on without its process
                # state: whatever it raised then is the verdict's doing, not its own
                outcome = f"raised {type(e).__name__} after the hang verdict freed it"
                return
            failures[rank] = e
            # the world's own abort error is one object raised in every rank: its traceback
            # holds the other ranks' frames (and groups), so it says nothing about this rank's
            note = None if e is sched.abort_error else isolation.foreign_group_note(e, rank, FakeProcessGroup)
            if note is not None:
                e.add_note(note)
            outcome = f"raised {type(e).__name__}"
            ends_world = not isinstance(e, FakePGError) or getattr(e, "ends_world", False)
            ends_world = ends_world and not isinstance(sched.abort_error, _STOPPED)
            # raised while unwinding from the hang verdict (a `with lock:` whose lock the
            # verdict released): a consequence of the hang, which stays the reported cause
            ends_world = ends_world and not (sched.hang is not None and during_hang(e))
            if ends_world:
                # as a worker process that exits: the others run on until they need this rank
                # (their collective with it fails as gloo's does) or finish; the first rank to
                # fail is the root cause spawn reports, as torchrun's "first observed failure"
                if cluster.failed_rank is None:
                    cluster.failed_rank = rank
                cluster.rank_failed(rank, f"{ended_how(e)}")
        finally:
            try:
                cluster.hooks.rank_finished(rank)
                if c10d.is_initialized():
                    _destroy_quietly()
            finally:
                bind_thread(None)
                _free_stuck_locks(sched.stuck_locks)
                sched.finish(rank, outcome)

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"fakepg-rank{r}", daemon=True)
               for r in range(nprocs)]
    for r, t in enumerate(threads):
        sched.slots[r].thread = t
    try:
        _run_threads(threads, sched, cluster, hang_timeout, host, master_port, timeout)
    finally:
        _ENDED_RANK_THREADS[:] = [t.native_id for t in threads if t.native_id is not None]
    result = SpawnResult(returns, cluster.trace, nprocs, seed, time.perf_counter() - t0,
                         sorted(cluster.dead))
    if sched.hang is not None:
        result.hang_report = sched.hang.report
    if isinstance(sched.abort_error, SpawnTimeoutError):
        raise SpawnTimeoutError(sched.abort_error.report)
    raise_outcome(sched, cluster, failures)
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
    with world_patches(len(threads)) as patched, world_profilers(), \
            world_stores("127.0.0.1", master_port), liveness.cooperative_sleep(), \
            subprocess_waits.cooperative_subprocesses(), \
            isolation.import_snapshots(), \
            native_store_guard(lambda: True, cluster.refused_natively, ("127.0.0.1", str(master_port))):
        # (every thread: one a rank started, such as torchft's quorum thread, too)
        mp_spawn.warn_in_threads(patched)  # a rank's torch.multiprocessing launch: real processes
        torch.autograd.set_multithreading_enabled(False)  # backward runs on the rank's thread
        set_thread_isolation_mode(True)
        _DEPTH.append(cluster)
        try:
            run_to_end(sched, cluster, threads, hang_timeout, timeout)
        finally:
            _DEPTH.pop()
            if not _DEPTH:  # a world nested in a rank leaves its outer world's mode on
                set_thread_isolation_mode(False)
            torch.autograd.set_multithreading_enabled(multithreading)
            host.install()
            sys.excepthook = excepthook  # init_process_group prefixes it with "[rankN]"


def _str_env(env: Mapping[str, str]) -> dict[str, str]:
    bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"fakepg.spawn: env names and values must be strings, got {bad!r}")
    return dict(env)




def _free_stuck_locks(locks: list[Any]) -> None:
    """A hang verdict found a rank blocked on an RLock (only its owner can release it): the
    owner, ending, releases it, so that the blocked rank goes on to its next wait and ends."""
    for lock in locks:
        with contextlib.suppress(Exception):
            while lock._is_owned():
                lock.release()


def _destroy_quietly() -> None:
    with contextlib.suppress(Exception):
        c10d.destroy_process_group()
