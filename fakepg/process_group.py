"""``FakeProcessGroup``: a torch.distributed ProcessGroup whose ranks are threads of one process.

It is registered as the backend ``"fakepg"``. torch's real DDP Reducer, comm hooks and
the Python collective API all call into it; each call becomes a :class:`~fakepg.collectives.Call`
that the shared :class:`~fakepg.cluster.Cluster` matches across ranks. The collective methods
themselves come from the op registry (:mod:`fakepg.ops`), which says what each one issues.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import backends, ops
from .cluster import Cluster, _fresh, current_cluster
from .collectives import Call
from .errors import FakePGError, InvalidCollectiveError
from .gloo_hazards import running_callback_of
from .ops.base import dtype_name, tensors_of
from .profiling import collective_event
from .reductions import op_name
from .sites import user_site
from .trace import CollectiveRecord

BACKEND_NAME = "fakepg"
_JOIN_SHADOW_CODE = torch.nn.parallel.DistributedDataParallel._match_all_reduce_for_bwd_pass.__code__


class FakeFuture(torch.futures.Future):
    """A future whose ``wait`` is visible to the scheduler (a C++ wait would stall the baton)."""

    def __init__(self, work: "FakeWork | None" = None):
        super().__init__()
        self._work = work

    def wait(self) -> Any:
        if self._work is not None:  # even when done: the wait is an event (for virtual clocks)
            self._work.wait()
        return super().wait()

    def done(self) -> bool:
        if self._work is not None and not super().done():
            self._work._poll()
        return super().done() and (self._work is None or self._work._visible())

    def then(self, callback):  # type: ignore[override]
        child = FakeFuture(self._work)
        call = getattr(self._work, "_call", None)
        hooks = self._work._cluster.hooks if call is not None else None  # type: ignore[union-attr]

        def run(fut: torch.futures.Future) -> None:
            if hooks is not None:
                hooks.completion_started(call)
            try:
                with running_callback_of(call):
                    value = callback(fut)
                child.set_result(value)
            except BaseException as e:  # noqa: BLE001 - forwarded to whoever waits on child
                child.set_exception(e)
            finally:
                if hooks is not None:
                    hooks.completion_finished(call)

        self.add_done_callback(run)
        return child


class FakeWork(dist.Work):
    """What every fakepg collective returns; completes on its owner's thread."""

    def __init__(self, cluster: Cluster, call: Call | None):
        super().__init__()
        self._cluster = cluster
        self._call = call
        # Made on first use: most works (the Reducer's, settled before it asks) never need one.
        self._fake_future: FakeFuture | None = None
        self._done = call is None
        self._error: BaseException | None = None
        self._typed_future: torch.futures.Future | None = None
        if call is not None:
            call.work = self

    @property
    def _future(self) -> FakeFuture:
        fut = self._fake_future
        if fut is None:
            fut = self._fake_future = FakeFuture(self)
            if self._done:
                self._resolve(fut)
        return fut

    def _resolve(self, fut: FakeFuture) -> None:
        if self._error is not None:
            fut.set_exception(_fresh(self._error))  # type: ignore[arg-type]
        else:
            fut.set_result(self._call.value() if self._call is not None else [])

    def _complete(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error
        if self._fake_future is not None:
            self._resolve(self._fake_future)

    def _poll(self) -> None:
        binding = current_cluster()
        if self._call is not None and binding is not None and binding[1] == self._call.rank:
            self._cluster.complete_ready(self._call.rank)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: ARG002
        if self._call is not None:
            self._cluster.wait(self._call)
        return True

    def is_completed(self) -> bool:
        self._poll()
        return self._done and self._visible()

    def _visible(self) -> bool:
        """Whether a finished collective shows as completed yet (a choice under a schedule:
        on a real backend the peer's data may still be on its way)."""
        sched = self._cluster.scheduler
        return not sched.schedule.active or not sched.schedule.choose("completed", 2)

    def is_success(self) -> bool:
        self._poll()
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        res = self._call.value() if self._call is not None else []
        if any(isinstance(x, list) for x in res):  # as gloo's AsyncWork::result()
            raise RuntimeError("work result does not support list of lists, use .getFuture() and value()")
        return list(res)

    def source_rank(self) -> int:
        if self._call is None or self._call.source is None:
            raise FakePGError("source_rank() is only available on a completed recv from any source")
        return self._call.source

    _source_rank = source_rank  # the name torch's dist.recv(src=None) calls

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        if self._done and self._error is None and self._call is not None \
                and self._call.hidden_wait:
            # Completed: hand out a future typed List[Tensor], as gloo's is. C++ consumers
            # (the built-in FP16_COMPRESS hook) assert on that type; a Python-made future
            # can only hold a PyObject. Pending works keep the FakeFuture, whose wait the
            # scheduler must see; so do works issued from Python outside backward (no C++
            # consumer), whose then-callbacks the world hooks must see (for virtual clocks).
            if self._typed_future is None:
                res = self._call.value()
                if res and all(isinstance(t, torch.Tensor) for t in res):
                    self._typed_future = torch._C.fork(_as_is, list(res))
                else:
                    self._typed_future = self._future
                self._cluster.gloo_hazards.note_future(self._typed_future, self._call)
            return self._typed_future
        return self._future

    _get_future = get_future


class _CoalescedWork(FakeWork):
    def __init__(self, cluster: Cluster, works: list[FakeWork]):
        super().__init__(cluster, None)
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self._works:
            w.wait()
        return True


def _in_join_shadow() -> bool:
    """Whether DDP's Join hook (``_match_all_reduce_for_bwd_pass``) is on this thread's stack."""
    frame = sys._getframe(2)
    for _ in range(32):
        if frame is None:
            return False
        if frame.f_code is _JOIN_SHADOW_CODE:
            return True
        frame = frame.f_back
    return False


def _global(ranks: tuple[int, ...], group_rank: int) -> int:
    """The global rank of ``group_rank``; as given when it is out of range (validation,
    which runs next, names it)."""
    return ranks[group_rank] if 0 <= group_rank < len(ranks) else group_rank


def _as_is(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


class PythonProcessGroup(dist.ProcessGroup):
    """A ``dist.ProcessGroup`` implemented in Python, with the identity c10d expects of it.

    A Python ProcessGroup has no C++ backend to keep its name and description, so they live
    here (c10d sets them through the C++ trampoline after creating the group).
    """

    backend_name = BACKEND_NAME

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - C++ trampoline name
        return self.backend_name

    def name(self) -> str:
        return self.backend_name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc


_creating = threading.local()
_forced = threading.local()  # process mode: the call's site and backward state, from the rank's process


@contextlib.contextmanager
def forced_call(site: str, in_backward: bool, hidden_wait: bool):
    """Issue calls made in this block as if from ``site`` (isolation="process": the proxy
    thread issues for a rank process, whose stack and autograd state are elsewhere)."""
    saved = getattr(_forced, "call", None)
    _forced.call = (site, in_backward, hidden_wait)
    try:
        yield
    finally:
        _forced.call = saved
_GLOO_FOR_LOGGING: list[Any] = []


def _gloo_backend_for_logging() -> Any:
    if not _GLOO_FOR_LOGGING:  # one per process, made on first use (about a millisecond)
        _GLOO_FOR_LOGGING.append(dist.ProcessGroupGloo(dist.HashStore(), 0, 1,
                                                       datetime.timedelta(minutes=30)))
    return _GLOO_FOR_LOGGING[0]


@contextlib.contextmanager
def requested_backend(name: str | None):
    """The personality a group created inside this block asks for (None: the world's)."""
    saved = getattr(_creating, "name", None)
    _creating.name = name
    try:
        yield
    finally:
        _creating.name = saved


class FakeProcessGroup(PythonProcessGroup):
    """One rank's handle on one group of the fake world.

    Its collective methods (``allreduce``, ``_allgather_base``, ...) are the op registry's
    (:func:`fakepg.ops.c10d_methods`); each parses c10d's arguments and calls :meth:`issue`.
    """

    def __init__(self, cluster: Cluster, global_rank: int, rank: int, size: int,
                 timeout: datetime.timedelta | None = None):
        super().__init__(rank, size)
        self._cluster = cluster
        self._global_rank = global_rank
        self._timeout = timeout or datetime.timedelta(minutes=30)
        self._gstate = None
        self._destroyed = False
        self._grank = rank
        self._coalesced: list[FakeWork] | None = None
        # DDP registered a comm hook on this group: its Reducer's collectives settle at issue
        # (world.py); without one, at the end of backward (see Cluster.settle_before_backward_ends)
        self._settle_at_issue = False
        # new_group(backend=...) fixes a group's personality; else it follows the world's
        self._requested: str | None = getattr(_creating, "name", None)
        # DDP's C++ logger, seeing backend name "gloo", reads the group's GLOO backend for its
        # device list: give it a real (one-rank, never used for collectives) gloo backend.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               _gloo_backend_for_logging())

    @property
    def personality(self) -> backends.Personality:
        return backends.get(self._requested or self._cluster.backend)

    @property
    def backend_name(self) -> str:  # type: ignore[override]  # what name() and c10d report
        return self.personality.name

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def shutdown(self) -> None:
        # destroy_process_group's graceful end: a finished rank's groups stop taking calls,
        # and peers still waiting on it keep their hang verdict (unlike abort)
        self._destroyed = True

    def abort(self) -> None:
        """As NCCL's abort: this rank's pending works on the group fail, and so do the
        collectives that wait for it; the group takes no more calls (a new group can)."""
        self._destroyed = True
        if self._gstate is not None:
            self._cluster.abort_group(self._gstate, self._global_rank)

    def _group_state(self):
        if self._gstate is None:
            mapping = c10d._world.pg_group_ranks.get(self)
            if mapping:
                ranks = tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))
            else:
                ranks = tuple(range(self.size()))
            try:
                name = self.group_name
            except Exception:  # noqa: BLE001 - unnamed groups get a positional name
                name = ""
            if not name:
                name = "default" if len(ranks) == self._cluster.nprocs else f"group{list(ranks)}"
            self._gstate = self._cluster.group(name, ranks, self._timeout.total_seconds())
        return self._gstate

    # -- the one path every collective takes ------------------------------------------
    def issue(self, op: ops.Op, inputs: list[Any], outputs: list[Any] | None = None, *,
              root: int | None = None, reduce_op: Any = None, in_splits: list[int] | None = None,
              out_splits: list[int] | None = None, peer: int | None = None, tag: int = 0,
              shape_of: Sequence[Any] | None = None, per_rank_outputs: bool = False,
              root_tensor: int = 0) -> FakeWork:
        """Issue this rank's part of ``op`` (the registry's c10d methods call this).

        ``root`` and ``peer`` are group ranks; ``shape_of`` names the tensors the trace
        shows (default: the inputs).
        """
        forced = getattr(_forced, "call", None)
        site = user_site(2) if forced is None else forced[0]
        g = self._gstate or self._group_state()
        if self._destroyed:
            raise FakePGError(f"rank {self._global_rank}: {op.name} on group {g.label} at {site}, "
                              f"but that group was destroyed (destroy_process_group)")
        outputs = [] if outputs is None else list(outputs)
        shown = tensors_of(inputs) if shape_of is None else list(shape_of)
        p2p = op.p2p
        rec = CollectiveRecord(
            rank=self._global_rank, group=g.name, group_ranks=g.ranks, seq=-1, op=op.name,
            shapes=tuple([tuple(t.shape) for t in shown]),
            dtypes=tuple([dtype_name(t.dtype) for t in shown]),
            bytes=0, site=site,
            reduce_op=None if reduce_op is None else op_name(reduce_op),
            root=None if root is None else _global(g.ranks, root),
            peer=None if peer is None else _global(g.ranks, peer),
            tag=tag if p2p else None, async_op=True, p2p=p2p,
            output_shapes=tuple([tuple(t.shape) for t in tensors_of(outputs)]),
        )
        call = Call(rank=self._global_rank, grank=self._grank, op=op.name, spec=op,
                    inputs=list(inputs), outputs=outputs, site=site, record=rec, root=root,
                    reduce_op=reduce_op, in_splits=in_splits, out_splits=out_splits,
                    peer=peer, tag=tag, per_rank_outputs=per_rank_outputs, root_tensor=root_tensor)
        rec.bytes = op.nbytes(call, g.size)
        work = FakeWork(self._cluster, call)
        # Inside backward the caller is the Reducer (or a comm hook it runs); it will wait
        # on the result from C++, where the scheduler cannot see it: settle it now.
        if forced is None:
            in_backward = torch._C._current_graph_task_id() != -1
            call.in_backward = in_backward
            # Join's shadow of the backward pass (a joined rank's DDP hook) runs the Reducer's
            # comm hook outside backward and waits on its future from C++ too: settle it as well.
            shadow = _in_join_shadow()
            call.hidden_wait = in_backward or shadow
            # The Reducer's default all_reduce is waited on at the end of backward: settle it
            # then, not at issue, sparing a hand-over per bucket. Not with a comm hook (C++ ones
            # read typed futures, which only a settled work hands out; Python ones may wait
            # inside), not under a timing model (its clocks follow each settlement), and only
            # from a node's hook: in autograd's final callbacks (static_graph's delayed
            # all_reduce) the Reducer's own callback is queued ahead of ours.
            defer = (in_backward and not shadow and not self._settle_at_issue
                     and self._cluster.plain and torch._C._current_autograd_node() is not None)
        else:
            # A rank process's call (isolation="process"): its backward runs in that process,
            # where no end-of-backward callback of this thread can wait; settle at issue.
            call.in_backward, call.hidden_wait = forced[1], forced[2]
            defer = False
        personality = self.personality
        call.personality = personality.name
        self._cluster.hazards.check_devices(call)  # torch dispatches on the device first
        refusal = personality.refuse(call)
        if refusal is not None:
            raise InvalidCollectiveError(backends.refusal_text(call, refusal))
        event = "recvAnySource" if p2p and peer is None else op.name  # gloo's event names
        with collective_event(event, shown, personality.event_prefix):
            coll = self._cluster.issue(g, call, block=call.hidden_wait and not defer)
        if defer and not coll.settled:
            self._cluster.settle_before_backward_ends(call)
        self._cluster.hazards.collective_issued(call)
        self._cluster.gloo_hazards.collective_issued(call)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _start_coalescing(self, device=None):
        self._coalesced = []

    def _end_coalescing(self, device=None):
        works, self._coalesced = self._coalesced or [], None
        return _CoalescedWork(self._cluster, works)


# The collective methods (allreduce, broadcast, ...), as the op registry defines them.
for _name, _method in ops.c10d_methods().items():
    setattr(FakeProcessGroup, _name, _method)


def _create_fakepg(store, rank, world_size, timeout):
    binding = current_cluster()
    if binding is None:
        raise FakePGError(
            "the 'fakepg' backend exists only inside a fake world: run your function with "
            "fakepg.spawn(fn, nprocs=N) or your script with `fakerun --nproc-per-node N script.py`")
    cluster, global_rank = binding
    return FakeProcessGroup(cluster, global_rank, rank, world_size, timeout)


def register_backend() -> None:
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, _create_fakepg, devices=["cpu", "cuda"])
