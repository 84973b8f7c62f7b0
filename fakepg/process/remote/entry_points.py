"""torch.distributed's entry points in a rank process, and the rank process's life.

:func:`install` makes a freshly forked process a rank of the parent's world: it patches
``init_process_group``, ``new_group``'s helper, ``monitored_barrier``, ``get_backend``, the
stores, ``time.sleep`` and ``torch.multiprocessing`` so that each of them goes to the rank's
proxy; :func:`run` runs the rank's function in that world.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import sys
import threading
import time
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ...fidelity import backends, foreign_backends
# torch's own entry points, as captured when fakepg was imported (not whatever a running
# world has patched in by the time this module is first imported)
from ...fidelity.originals import (TORCH_GET_BACKEND, TORCH_INIT_PROCESS_GROUP, TORCH_MONITORED_BARRIER,
                                   TORCH_NEW_GROUP_HELPER)
from ...fidelity.patches import monitored_barrier_arguments, world_group
from ...fidelity.store import native_store_guard
from . import waits
from ...world.python_group import BACKEND_NAME, keeping_join_work_alive, marking_join_shadow
from .. import mp_spawn
from ..mp_spawn import StartWorld
from ..wire import Channel, pack_exception
from . import rank as _rank
from .group import RemoteProcessGroup, create_remote
from .store import RemoteStore, StoreClass
from .work import RemoteFuture


# -- torch.distributed's entry points in a rank process ------------------------------------------

def _init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                        store=None, group_name="", pg_options=None, device_id=None, **kwargs):
    from ...sites import user_site

    me = _rank.me()
    site = user_site()
    if world_size not in (-1, None) and int(world_size) != me.nprocs:
        raise ValueError(f"rank {me.rank}: init_process_group(world_size={world_size}) at {site}, "
                         f"but the fake cluster has {me.nprocs} ranks (nprocs={me.nprocs}); "
                         f"make them agree")
    if rank not in (-1, None) and int(rank) != me.rank:
        raise ValueError(f"rank {me.rank}: init_process_group(rank={rank}) at {site} in the "
                         f"process of rank {me.rank}")
    if foreign_backends.foreign(backend):  # the program's own backend: torch creates it
        if c10d.is_initialized():
            if me.initialised_by_program is not None:
                raise ValueError("trying to initialize the default process group twice!")
            c10d.destroy_process_group(c10d._get_default_group())
        TORCH_INIT_PROCESS_GROUP(
            backend=backend, timeout=timeout, world_size=me.nprocs, rank=me.rank,
            store=RemoteStore("world", timeout=timeout or datetime.timedelta(minutes=30)),
            group_name=group_name, pg_options=pg_options, device_id=device_id, **kwargs)
        me.initialised_by_program = c10d._get_default_group()
        return None
    asked = backends.from_request(backend)
    if asked is not None:
        me.request("set_backend", asked)
    if c10d.is_initialized():
        default = c10d._get_default_group()
        if me.initialised_by_program is default:
            raise ValueError("trying to initialize the default process group twice!")
        me.initialised_by_program = default
        return None
    _start_world(timeout)
    me.initialised_by_program = c10d._get_default_group()
    return None


def _start_world(timeout: datetime.timedelta | None = None) -> None:
    me = _rank.me()
    timeout = timeout or datetime.timedelta(minutes=30)
    TORCH_INIT_PROCESS_GROUP(backend=BACKEND_NAME, rank=me.rank, world_size=me.nprocs,
                             store=RemoteStore("world", timeout=timeout), timeout=timeout)


@functools.wraps(TORCH_NEW_GROUP_HELPER)
def _pg_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
    return world_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)


@functools.wraps(TORCH_GET_BACKEND)
def _get_backend(group=None):
    name = TORCH_GET_BACKEND(group)
    pg = c10d._get_default_group() if group is None else group
    if str(name) not in backends.PERSONALITIES and str(name) != BACKEND_NAME:
        return name  # a backend the program registered (its creator may build a gloo group)
    return dist.Backend(pg.personality.name) if isinstance(pg, RemoteProcessGroup) else name


@functools.wraps(TORCH_MONITORED_BARRIER)
def _monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    args = monitored_barrier_arguments(group, timeout)
    if args is None:
        return None
    g, timeout = args
    return g._issue("monitored_barrier", (timeout, wait_all_ranks), {})


def _make_gloo_group(rank: int, size: int, timeout: datetime.timedelta) -> RemoteProcessGroup:
    """A rank process's fake gloo group (fakepg.fidelity.foreign_backends.GlooConstructor)."""
    me = _rank.me()
    if not hasattr(me, "direct_groups"):
        me.direct_groups = {}
    ranks, name = foreign_backends.membership(me.nprocs, me.rank, me.direct_groups, rank, size)
    pg = RemoteProcessGroup(rank, size, timeout)
    pg._fixed_membership = (ranks, name)
    return pg


_REAL_SLEEP = time.sleep


def _sleep(seconds: float) -> None:
    if not _rank.in_rank_process() or threading.get_ident() != getattr(_rank.me(), "thread_ident", None):
        # a process the rank forked, or a thread the rank started: not the rank, whose
        # channel only its own thread may use; a real sleep
        return _REAL_SLEEP(seconds)
    seconds = float(seconds)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _rank.me().request("sleep", seconds)  # the other ranks run meanwhile (a real sleep would stall them)
    return None


def _settling(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def wrapper(futures):
        for f in futures:
            if isinstance(f, RemoteFuture):
                f.wait()
        return original(futures)

    return wrapper


def _set_num_threads(n: int) -> None:
    # A forked child must not start an OpenMP team (libgomp's pool does not survive fork):
    # the count is remembered and reported, the work runs on one thread.
    _rank.me().num_threads = int(n)


def install(rank: int, nprocs: int, channel: Channel, seed: int,
            start_world: StartWorld) -> contextlib.ExitStack:
    """Make this (freshly forked) process rank ``rank`` of the parent's world; its
    ``torch.multiprocessing`` launches become worlds run by ``start_world``."""
    me = _rank.Rank(rank, nprocs, channel, seed)
    me.nested = _rank.current() is not None  # forked from a rank process: a world that rank started
    me.num_threads = torch.get_num_threads()
    _rank.become(me)
    torch.set_num_threads(1)
    stack = contextlib.ExitStack()
    patch = lambda obj, name, value: stack.enter_context(mock.patch.object(obj, name, value))  # noqa: E731
    plugin = dist.Backend._plugins[BACKEND_NAME.upper()]
    dist.Backend._plugins[BACKEND_NAME.upper()] = type(plugin)(create_remote, plugin.extended_api)
    for mod in (dist, c10d):
        patch(mod, "init_process_group", _init_process_group)
        patch(mod, "monitored_barrier", _monitored_barrier)
        patch(mod, "get_backend", _get_backend)
    patch(c10d, "_new_process_group_helper", _pg_helper)
    gloo = foreign_backends.GlooConstructor(c10d.ProcessGroupGloo, _make_gloo_group)
    for mod in (dist, c10d):  # a registered creator's (or a test's) own gloo group
        patch(mod, "ProcessGroupGloo", gloo)
    from torch.nn.parallel import DistributedDataParallel as DDP
    patch(DDP, "_match_all_reduce_for_bwd_pass", marking_join_shadow(DDP._match_all_reduce_for_bwd_pass))
    from torch.distributed.algorithms.join import Join
    patch(Join, "notify_join_context", staticmethod(keeping_join_work_alive(Join.notify_join_context)))
    if not hasattr(torch._C, "_nccl_version"):
        from torch.cuda import nccl
        patch(nccl, "version", lambda: (0, 0, 0))
    for name in ("wait_all", "collect_all"):
        patch(torch.futures, name, _settling(getattr(torch.futures, name)))
    patch(time, "sleep", _sleep)
    waits.install(patch)  # Python's own waits on the rank's thread let the other ranks run
    stack.enter_context(native_store_guard(_rank.in_rank_process))
    mp_spawn.patch(stack, "process", start_world)
    patch(torch, "set_num_threads", _set_num_threads)
    patch(torch, "get_num_threads", lambda: _rank.me().num_threads)
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    for mod in (dist, c10d, rendezvous):
        if mod is None:
            continue
        for name, kind in (("TCPStore", "tcp"), ("FileStore", "file"), ("HashStore", "hash")):
            if name in vars(mod):
                patch(mod, name, StoreClass(vars(mod)[name], kind))
    return stack


def run(fn: Callable[..., Any], args: tuple, init: bool = True) -> tuple[bool, Any]:
    """Run the rank's function (in an initialised world unless ``init`` is False: then the
    program initialises it); (True, pickled return value) or (False, packed exception)."""
    import pickle

    me = _rank.me()
    try:
        if init:
            _start_world()
        value = fn(me.rank, *args)
        try:
            outcome: tuple[bool, Any] = (True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - an unpicklable return value fails the rank
            raise TypeError(f"rank {me.rank}'s return value cannot be sent back from its "
                            f"process (isolation='process'): {e}") from e
    except BaseException as e:  # noqa: BLE001 - every outcome goes back to the proxy
        outcome = (False, pack_exception(e))
    with contextlib.suppress(BaseException):
        if c10d.is_initialized():
            c10d.destroy_process_group()
    return outcome


__all__ = ["install", "run"]
