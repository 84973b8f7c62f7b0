"""The torch.distributed entry points a running fake world replaces, and why each.

While a world runs (``fakepg.spawn``), the program's own calls reach the fake cluster:
``init_process_group`` maps onto the world spawn made (or makes it), ``new_group`` of any
backend is a group of the world, ``get_backend`` answers the personality, ``monitored_barrier``
is fakepg's, DDP's comm-hook registration decides when the Reducer's collectives settle,
``torch.futures.wait_all``/``collect_all`` settle their works first, DDP's Join shadow of the
backward pass flags its thread, the Work Join hands DDP's Reducer is kept alive, large worlds check DDP's parameters in linear memory, and
c10d's debug log leaves out fakepg's own errors (spawn raises them). Each is undone when the world ends.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import sys
import warnings
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..torch_private import check_valid_timeout, get_default_group, rank_not_in_group, warn_not_in_group
from ..errors import FakePGError, RankOsExit
from . import backends, ddp_checks, foreign_backends
from ..world.binding import current_cluster
from ..world.checks import running_callback_of
from ..world.process_group import BACKEND_NAME, FakeFuture, FakeProcessGroup, requested_backend
from ..world.python_group import keeping_join_work_alive, marking_join_shadow
from ..sites import user_site
from .originals import (PG_TIMEOUT, TORCH_GET_BACKEND, TORCH_INIT_PROCESS_GROUP,
                        TORCH_MONITORED_BARRIER, TORCH_NEW_GROUP_HELPER)
from .store import world_store



def world_patches(nprocs: int) -> contextlib.ExitStack:
    """torch.distributed entry points that must see the fake world while it runs."""
    stack = contextlib.ExitStack()
    init = _fake_init_process_group(nprocs)
    for mod in (dist, c10d):
        stack.enter_context(mock.patch.object(mod, "init_process_group", init))
        stack.enter_context(mock.patch.object(mod, "monitored_barrier", _fake_monitored_barrier))
    stack.enter_context(mock.patch.object(c10d, "_new_process_group_helper", _fake_pg_helper))
    gloo = foreign_backends.GlooConstructor(c10d.ProcessGroupGloo,
                                           foreign_backends.make_thread_group)
    for mod in (dist, c10d):  # a registered creator's (or a test's) own gloo group
        stack.enter_context(mock.patch.object(mod, "ProcessGroupGloo", gloo))
    for mod in (dist, c10d):
        stack.enter_context(mock.patch.object(mod, "get_backend", _fake_get_backend))
    if not hasattr(torch._C, "_nccl_version"):
        # A CPU build has no NCCL, but c10d's error logging asks for its version whenever a
        # collective of an "nccl" group fails, and would hide the real error behind that one.
        from torch.cuda import nccl
        stack.enter_context(mock.patch.object(nccl, "version", lambda: (0, 0, 0)))
    if nprocs >= ddp_checks.LARGE_WORLD:
        import torch.nn.parallel.distributed as ddp_module

        stack.enter_context(mock.patch.object(ddp_module, "_verify_param_shape_across_processes",
                                              ddp_checks.verify_params_across_processes))
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name in ("register_comm_hook", "_register_builtin_comm_hook"):
        stack.enter_context(mock.patch.object(DDP, name, _settle_at_issue(getattr(DDP, name))))
    stack.enter_context(mock.patch.object(torch._C.Future, "then",  # torch.futures.Future's too
                                          _callbacks_marked(torch._C.Future.then)))
    stack.enter_context(mock.patch.object(DDP, "_match_all_reduce_for_bwd_pass", marking_join_shadow(
        DDP._match_all_reduce_for_bwd_pass)))
    from torch.distributed.algorithms.join import Join

    stack.enter_context(mock.patch.object(Join, "notify_join_context", staticmethod(
        keeping_join_work_alive(Join.notify_join_context))))
    for name, original in (("wait_all", torch.futures.wait_all),
                           ("collect_all", torch.futures.collect_all)):
        stack.enter_context(mock.patch.object(torch.futures, name, _settling(original)))
    from torch.distributed import c10d_logger

    c10d_log = getattr(c10d_logger, "_c10d_logger", None) or logging.getLogger("c10d-NullHandler-default")
    c10d_log.addFilter(_no_fakepg_errors)
    stack.callback(c10d_log.removeFilter, _no_fakepg_errors)
    stack.enter_context(mock.patch.object(os, "_exit", _rank_os_exit(os._exit, os.getpid())))
    return stack


def _rank_os_exit(original: Callable[[int], Any], pid: int) -> Callable[[int], Any]:
    """``os._exit`` on a rank thread ends that rank, as its process would end under torchrun
    (the world reports its exit code and the other ranks run on); anywhere else -- another
    thread, a process forked from this one -- it is the real one."""

    def _exit(status: int) -> Any:
        if os.getpid() == pid and current_cluster() is not None:
            raise RankOsExit(int(status))
        return original(status)

    return _exit


def _no_fakepg_errors(record: logging.LogRecord) -> bool:
    """c10d logs every failing call at DEBUG with its error's text, from inside the except
    block. A fakepg error (a hang or mismatch report) reaches the user through spawn; pytest
    shows a failed test's DEBUG records, so its report came twice, the echo led by the blocked
    rank's wording of its 30-minute group timeout. Drop the echo; other records pass."""
    return not isinstance(sys.exc_info()[1], FakePGError)


def _callbacks_marked(then: Callable[..., Any]) -> Callable[..., Any]:
    """A callback on a fakepg work's future (or a future chained on it) runs marked as that
    work's: gloo runs it on its own thread, racing the program (fakepg.fidelity.gloo_hazards)."""
    @functools.wraps(then)
    def marked_then(self: Any, callback: Callable[..., Any]) -> Any:
        binding = current_cluster()
        call = binding[0].checkers.call_of(self, binding[1]) if binding is not None else None
        if call is None:
            return then(self, callback)

        def run(fut: Any) -> Any:
            with running_callback_of(call):
                return callback(fut)
        child = then(self, run)
        binding[0].checkers.future_made(child, call)
        return child
    return marked_then


def _settle_at_issue(register: Callable[..., Any]) -> Callable[..., Any]:
    """A DDP comm hook makes its group settle the Reducer's collectives at issue (see
    FakeProcessGroup.issue)."""
    @functools.wraps(register)
    def register_comm_hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(self.process_group, "_settle_at_issue"):
            self.process_group._settle_at_issue = True
        return register(self, *args, **kwargs)
    return register_comm_hook


def _fake_init_process_group(nprocs: int) -> Callable[..., Any]:
    @functools.wraps(TORCH_INIT_PROCESS_GROUP)
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, group_name="", pg_options=None, device_id=None,
                           **kwargs):
        binding = current_cluster()
        if binding is None:
            return TORCH_INIT_PROCESS_GROUP(backend, init_method, timeout, world_size, rank, store,
                                            group_name, pg_options, device_id, **kwargs)
        cluster, me = binding
        site = user_site()
        if world_size not in (-1, None) and int(world_size) != nprocs:
            raise ValueError(f"rank {me}: init_process_group(world_size={world_size}) at {site}, "
                             f"but the fake cluster has {nprocs} ranks (nprocs={nprocs}); "
                             f"make them agree")
        if rank not in (-1, None) and int(rank) != me:
            raise ValueError(f"rank {me}: init_process_group(rank={rank}) at {site} on the "
                             f"thread of rank {me}")
        if foreign_backends.foreign(backend):
            return _init_foreign(cluster, me, nprocs, backend, timeout, group_name, pg_options,
                                 device_id, **kwargs)
        asked = backends.from_request(backend)
        if asked is not None:
            cluster.backend = asked
        if c10d.is_initialized():
            # spawn initialised the world: the program's own first call maps onto it
            default = get_default_group()
            if cluster.initialised_by_program.get(me) is default:
                raise ValueError("trying to initialize the default process group twice!")
            cluster.initialised_by_program[me] = default
            return None
        TORCH_INIT_PROCESS_GROUP(backend=BACKEND_NAME, rank=me, world_size=nprocs,
                                 store=world_store(timeout or PG_TIMEOUT),
                                 timeout=timeout or PG_TIMEOUT)
        cluster.initialised_by_program[me] = get_default_group()
        return None

    return init_process_group


def _init_foreign(cluster: Any, me: int, nprocs: int, backend: Any, timeout: Any,
                  group_name: str, pg_options: Any, device_id: Any, **kwargs: Any) -> None:
    """``init_process_group`` of a backend that is not a personality (a registered one, or
    one torch lacks): torch's own, on the world's store, rank and size. A default group that
    spawn made for the program's convenience gives way to it."""
    if c10d.is_initialized():
        default = get_default_group()
        if cluster.initialised_by_program.get(me) is not None:
            raise ValueError("trying to initialize the default process group twice!")
        c10d.destroy_process_group(default)
    store = world_store(timeout or PG_TIMEOUT)
    TORCH_INIT_PROCESS_GROUP(backend=backend, timeout=timeout, world_size=nprocs, rank=me,
                             store=store, group_name=group_name, pg_options=pg_options,
                             device_id=device_id, **kwargs)
    cluster.initialised_by_program[me] = get_default_group()


@functools.wraps(TORCH_NEW_GROUP_HELPER)
def _fake_pg_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
    # new_group(backend="gloo"/"nccl"/...) inside a world is a group of the fake world, as
    # init_process_group is: a real ProcessGroupGloo would rendezvous in C++ through the world
    # store and deadlock against ranks parked by the scheduler.
    if current_cluster() is None:
        return TORCH_NEW_GROUP_HELPER(group_size, group_rank, global_ranks_in_group, backend,
                                          *args, **kwargs)
    return world_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)


def world_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
    """torch's ``_new_process_group_helper`` inside a world (both isolation modes): a backend
    the program registered is created by torch as registered; any other name is a group of the
    fake world with that backend's personality."""
    if foreign_backends.foreign(backend):  # the program's own backend: torch creates it
        return foreign_backends.torch_creates(TORCH_NEW_GROUP_HELPER, group_size, group_rank,
                                              global_ranks_in_group, backend, *args, **kwargs)
    # fakepg's own init_process_group calls name BACKEND_NAME: that group follows the world
    asked = None if backend == BACKEND_NAME else backends.from_request(backend)
    with requested_backend(asked):
        return TORCH_NEW_GROUP_HELPER(group_size, group_rank, global_ranks_in_group, BACKEND_NAME,
                                      *args, **kwargs)


@functools.wraps(TORCH_GET_BACKEND)
def _fake_get_backend(group=None):
    name = TORCH_GET_BACKEND(group)  # torch's own checks and errors first
    if current_cluster() is None:
        return name
    pg = get_default_group() if group is None else group
    if str(name) not in backends.PERSONALITIES and str(name) != BACKEND_NAME:
        return name  # a backend the program registered (its creator may build a gloo group)
    return dist.Backend(pg.personality.name) if isinstance(pg, FakeProcessGroup) else name


@functools.wraps(TORCH_MONITORED_BARRIER)
def _fake_monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    if current_cluster() is None:
        return TORCH_MONITORED_BARRIER(group, timeout, wait_all_ranks)
    args = monitored_barrier_arguments(group, timeout)
    if args is None:
        return None
    group, timeout = args
    return group.monitored_barrier(timeout, wait_all_ranks)


def monitored_barrier_arguments(group: Any, timeout: Any) -> tuple[Any, Any] | None:
    """torch's own argument handling of ``monitored_barrier`` (with the personality's name in
    its backend check): (group, timeout as a timedelta), or None on a non-member (a no-op)."""
    if rank_not_in_group(group):
        warn_not_in_group("monitored_barrier")
        return None
    g = group or get_default_group()
    if not g.personality.monitored_barrier:
        raise ValueError("monitored_barrier is only implemented for GLOO backend.")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        warnings.warn("Please specify timeout arg as a timedelta. Converting current value of "
                      f"{timeout} assuming it represents seconds", stacklevel=3)
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None:
        check_valid_timeout(timeout)
    return g, timeout


def _settling(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``torch.futures.wait_all``/``collect_all`` that first wait on fakepg futures where
    the scheduler can see it, before torch waits in C++."""
    @functools.wraps(original)
    def wrapper(futures):
        if current_cluster() is not None:
            for f in futures:
                if isinstance(f, FakeFuture):
                    f.wait()
        return original(futures)

    return wrapper
