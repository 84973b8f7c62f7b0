"""A rank process's process groups: each collective is a request to the rank's proxy.

Its default group and every group it makes are :class:`RemoteProcessGroup`\\ s, registered
under the same backend name ``"fakepg"``; the proxy performs each call on the parent's fake
world, so matching, validation, rank-order results, hang verdicts and traces are exactly
thread mode's.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...torch_private import (current_graph_task_id, profiler_enabled, record_function_with_args_enter,
                              record_function_with_args_exit)
from ...fidelity import backends
from ... import ops
from ...ops.base import tensors_of
from ...world.python_group import (PythonProcessGroup, creating_backend, gloo_backend_for_logging,
                            in_join_shadow)
from ...sites import user_site
from ..wire import decode
from . import rank as _rank
from .work import RemoteWork

_group_ids = itertools.count()


class RemoteProcessGroup(PythonProcessGroup):
    """One rank's handle on one group of the parent's fake world."""

    def __init__(self, rank: int, size: int, timeout: datetime.timedelta | None = None):
        super().__init__(rank, size)
        self._gid = next(_group_ids)
        self._timeout = timeout or datetime.timedelta(minutes=30)
        self._requested: str | None = creating_backend()
        self._desc: tuple | None = None
        self._coalescing = False
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               gloo_backend_for_logging())

    @property
    def personality(self) -> backends.Personality:
        return backends.get(self._requested or _rank.me().backend)

    @property
    def backend_name(self) -> str:  # type: ignore[override]
        return self.personality.name

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def _describe(self) -> tuple:
        """(id, name, ranks, timeout, requested personality, group rank, built as a bare
        ProcessGroupGloo): what the proxy needs to stand in for this group (named as FakeProcessGroup names it)."""
        if self._desc is None:
            ranks, name = self._ranks_and_name(_rank.me().nprocs)
            self._desc = (self._gid, name, ranks, self._timeout.total_seconds(), self._requested,
                          self.rank(), self._bare_backend)
        return self._desc

    def _issue(self, method: str, args: tuple, kwargs: dict) -> Any:
        site = user_site(3)
        in_backward = current_graph_task_id() != -1
        hidden = in_backward or in_join_shadow()
        opts = next((a for a in (*args, *kwargs.values()) if hasattr(a, "asyncOp")), None)
        sync = opts is not None and opts.asyncOp is False and not self._coalescing
        out: list = []
        with _collective_event(self, method, args):
            reply = _rank.me().request("call", self._describe(), method, args, kwargs, site,
                                       (in_backward, hidden), sync, tensors_out=out)
        kind, value = reply
        if kind == "work":
            wid, state = value
            work = RemoteWork(wid, out[0], out[1], hidden)
            work._apply(state)
            return work
        return decode(value, out[0])

    def _start_coalescing(self, device=None):
        self._coalescing = True
        _rank.me().request("pg", self._describe(), "_start_coalescing", (device,))

    def _end_coalescing(self, device=None):
        self._coalescing = False
        wid, state = _rank.me().request("pg", self._describe(), "_end_coalescing", (device,))
        work = RemoteWork(wid, [], [], False)
        work._apply(state)
        return work

    def _timeout_set(self, timeout: datetime.timedelta) -> None:
        _rank.me().request("pg", self._describe(), "_set_default_timeout", (timeout,))

    def shutdown(self) -> None:
        _rank.me().request("pg", self._describe(), "shutdown", ())

    def abort(self) -> None:
        _rank.me().request("pg", self._describe(), "abort", ())


def _collective_event(pg: RemoteProcessGroup, method: str, args: tuple):
    """The profiler range thread mode records for a collective (``gloo:all_reduce``), in this
    rank's own profiler; shapes are those of every tensor argument."""
    if not profiler_enabled():
        return contextlib.nullcontext()
    try:
        name = ops.lookup(method).name
    except ValueError:
        name = method
    if method == "recv_anysource":  # gloo's event name, as thread mode records it
        name = "recvAnySource"
    # the event shows the inputs, as thread mode's (and the backends') do: the second argument
    # of the c10d methods that take their outputs first
    inputs = args[1] if method in _OUTPUTS_FIRST and len(args) > 1 else args[:1]
    return _ended_elsewhere(f"{pg.personality.event_prefix}:{name}", tensors_of([inputs]))


_OUTPUTS_FIRST = frozenset({
    "allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base"})


@contextlib.contextmanager
def _ended_elsewhere(name: str, tensors: list[Any]):
    """A profiler range begun on this thread and ended on another, as a backend's collective
    is (gloo's ends on its worker thread): torch's real profiler then reports it async, as
    thread mode's per-rank profiler does."""
    handle = record_function_with_args_enter(
        name, *[t for t in tensors if isinstance(t, torch.Tensor)])
    try:
        yield
    finally:
        ender = threading.Thread(target=record_function_with_args_exit,
                                 args=(handle,), name="fakepg-collective-end")
        ender.start()
        ender.join()


def _forwarder(name: str) -> Callable[..., Any]:
    def method(self: RemoteProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return self._issue(name, args, kwargs)

    method.__name__ = name
    return method


for _name in ops.c10d_methods():
    setattr(RemoteProcessGroup, _name, _forwarder(_name))


def create_remote(store, rank, world_size, timeout):
    """The ``"fakepg"`` backend's constructor in a rank process."""
    from ...world.binding import current_cluster
    from ...world.process_group import create_fake_group

    if current_cluster() is not None:  # a rank of a world nested in this process (mp.spawn)
        return create_fake_group(store, rank, world_size, timeout)
    return RemoteProcessGroup(rank, world_size, timeout)


