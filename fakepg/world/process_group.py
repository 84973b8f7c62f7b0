"""``FakeProcessGroup``: a torch.distributed ProcessGroup whose ranks are threads of one process.

It is registered as the backend ``"fakepg"``. torch's real DDP Reducer, comm hooks and
the Python collective API all call into it; each call becomes a :class:`~fakepg.ops.matching.Call`
that the shared :class:`~fakepg.world.cluster.Cluster` matches across ranks. The collective methods
themselves come from the op registry (:mod:`fakepg.ops`), which says what each one issues;
what they return is :mod:`fakepg.world.work`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..torch_private import current_autograd_node, current_graph_task_id, profiler_enabled
from .. import ops
from .binding import current_cluster, thread_binding
from .cluster import Cluster
from .liveness import collective_wait
from ..ops.matching import Call, GroupState
from ..errors import FakePGError, SharedStateError
from ..ops.base import dtype_name, tensors_of
from .events import collective_event
from .isolation import shared_object_message
# re-exported: the names other modules (and programs) import from here
from .python_group import (BACKEND_NAME, PythonProcessGroup, creating_backend,  # noqa: F401
                           gloo_backend_for_logging, in_join_shadow, requested_backend)
from ..ops.reductions import op_name
from ..sites import user_site
from ..ops.trace import CollectiveRecord
from .work import CoalescedWork, FakeFuture, FakeWork  # noqa: F401

if TYPE_CHECKING:
    from ..fidelity.backends import Personality

_forced = threading.local()  # process mode: the call's site and backward state, from the rank's process


_FUNCOL_FILE = os.path.join("distributed", "_functional_collectives.py")


def _from_functional_collectives() -> bool:
    """Whether this call comes from torch's functional collectives (``torch.distributed.
    _functional_collectives``: ``torch.ops._c10d_functional``, what DTensor issues), whose
    caller waits with ``wait_tensor`` in C++."""
    f = sys._getframe(2)
    for _ in range(24):  # the wrapper sits a few frames above the ProcessGroup method
        if f is None:
            return False
        if f.f_code.co_filename.endswith(_FUNCOL_FILE):
            return True
        f = f.f_back
    return False


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


def call_site(depth: int = 1) -> str:
    """The user's line that issued the call being made (the rank process's, in process mode)."""
    forced = getattr(_forced, "call", None)
    return user_site(depth + 1) if forced is None else forced[0]


def _global(ranks: tuple[int, ...], group_rank: int) -> int:
    """The global rank of ``group_rank``; as given when it is out of range (validation,
    which runs next, names it)."""
    return ranks[group_rank] if 0 <= group_rank < len(ranks) else group_rank


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
        # (patches.py); without one, at the end of backward (see Cluster.settle_before_backward_ends)
        self._settle_at_issue = False
        # new_group(backend=...) fixes a group's personality; else it follows the world's
        self._requested: str | None = creating_backend()
        # DDP's C++ logger reads the group's GLOO backend for its device list
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               gloo_backend_for_logging())

    @property
    def personality(self) -> "Personality":
        # the world's table of backends it can emulate (fidelity.backends, given by spawn)
        return self._cluster.personalities[self._requested or self._cluster.backend]

    @property
    def backend_name(self) -> str:  # type: ignore[override]  # what name() and c10d report
        return self.personality.name

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def _timeout_set(self, timeout: datetime.timedelta) -> None:
        if self._gstate is not None:  # (every member sets it, as every gloo rank does)
            self._gstate.timeout = timeout.total_seconds()

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
            ranks, name = self._ranks_and_name(self._cluster.nprocs)
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
        cluster = self._cluster
        if forced is None:
            site = user_site(2)
            binding = getattr(thread_binding, "binding", None)  # current_cluster(), inline
            if binding is not None and binding[1] != self._global_rank and binding[0] is cluster:
                raise SharedStateError(shared_object_message(
                    f"a process group ({op.name} at {site})", self, self._global_rank, binding[1]))
        else:
            site = forced[0]
        g = self._gstate or self._group_state()
        if self._destroyed:
            raise FakePGError(f"rank {self._global_rank}: {op.name} on group {g.label} at {site}, "
                              f"but that group was destroyed (destroy_process_group)")
        outputs = [] if outputs is None else list(outputs)
        shown = tensors_of(inputs) if shape_of is None else list(shape_of)
        rec = self._record(op, g, site, shown, outputs, reduce_op, root, peer, tag)
        call = Call(rank=self._global_rank, grank=self._grank, op=op.name, spec=op,
                    inputs=list(inputs), outputs=outputs, site=site, record=rec, root=root,
                    reduce_op=reduce_op, in_splits=in_splits, out_splits=out_splits,
                    peer=peer, tag=tag, per_rank_outputs=per_rank_outputs, root_tensor=root_tensor)
        rec.bytes = op.nbytes(call, g.size)
        work = FakeWork(cluster, call)
        defer = self._when_settled(call, forced)
        personality = self.personality
        call.personality = personality.name
        checkers = cluster.checkers
        checkers.issuing(call)  # the backend's refusals, NCCL's device check
        block = call.hidden_wait and not defer
        if profiler_enabled():
            event = "recvAnySource" if op.p2p and peer is None else op.name  # gloo's event names
            with collective_event(event, shown, personality.event_prefix):
                coll = cluster.issue(g, call, block=block)
        else:
            coll = cluster.issue(g, call, block=block)
        if defer and not coll.settled:
            cluster.settle_before_backward_ends(call)
        checkers.issued(call)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _record(self, op: ops.Op, g: GroupState, site: str, shown: list[Any], outputs: list[Any],
                reduce_op: Any, root: int | None, peer: int | None, tag: int) -> CollectiveRecord:
        """The trace's record of this call (its sequence number and size come later)."""
        p2p = op.p2p
        shapes, dtypes = [], []
        for t in shown:
            shapes.append(tuple(t.shape))
            dtypes.append(dtype_name(t.dtype))
        return CollectiveRecord(
            rank=self._global_rank, group=g.name, group_ranks=g.ranks, seq=-1, op=op.name,
            shapes=tuple(shapes), dtypes=tuple(dtypes), bytes=0, site=site,
            reduce_op=None if reduce_op is None else op_name(reduce_op),
            root=None if root is None else _global(g.ranks, root),
            peer=None if peer is None else _global(g.ranks, peer),
            tag=tag if p2p else None, async_op=True, p2p=p2p,
            output_shapes=tuple([tuple(t.shape) for t in tensors_of(outputs)]) if outputs else (),
        )

    def _when_settled(self, call: Call, forced: tuple | None) -> bool:
        """Mark where ``call`` is waited on; True when it settles at the end of backward
        (else at issue when its wait is hidden in C++, else when the program waits)."""
        if forced is not None:
            # A rank process's call (isolation="process"): its backward runs in that process,
            # where no end-of-backward callback of this thread can wait; settle at issue.
            call.in_backward, call.hidden_wait = forced[1], forced[2]
            return False
        # Inside backward the caller is the Reducer (or a comm hook it runs); it will wait
        # on the result from C++, where the scheduler cannot see it: settle it.
        in_backward = current_graph_task_id() != -1
        call.in_backward = in_backward
        # Join's shadow of the backward pass (a joined rank's DDP hook) runs the Reducer's
        # comm hook outside backward and waits on its future from C++ too: settle it as well.
        shadow = in_join_shadow()
        # A functional collective (DTensor's redistributions: tensor parallelism) is waited on
        # by its wait_tensor op, from C++, like the Reducer's: settle it too.
        call.hidden_wait = in_backward or shadow or _from_functional_collectives()
        # The Reducer's default all_reduce is waited on at the end of backward: settle it
        # then, not at issue, sparing a hand-over per bucket. Not with a comm hook (C++ ones
        # read typed futures, which only a settled work hands out; Python ones may wait
        # inside), not under a timing model (its clocks follow each settlement), and only
        # from a node's hook: in autograd's final callbacks (static_graph's delayed
        # all_reduce) the Reducer's own callback is queued ahead of ours.
        return (in_backward and not shadow and not self._settle_at_issue
                and self._cluster.plain and current_autograd_node() is not None)

    def wait_timed(self, work: FakeWork, timeout: datetime.timedelta | None,
                   wait_all_ranks: bool) -> None:
        """Wait for ``work`` with a timeout of its own (``monitored_barrier``'s; default the
        group's), failing past it as the backend fails; ``wait_all_ranks`` names every late rank."""
        seconds = (timeout if timeout is not None else self._timeout).total_seconds()
        call = work._call
        self._cluster.wait(call, timed=collective_wait(self._cluster, call, seconds, wait_all_ranks))

    def _start_coalescing(self, device=None):
        self._coalesced = []

    def _end_coalescing(self, device=None):
        works, self._coalesced = self._coalesced or [], None
        return CoalescedWork(self._cluster, works)


def _checked(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (the op registry's ProcessGroup method ``name``) behind the world's checkers'
    ``calling`` hook, which sees the program's own arguments (gloo's argument checks:
    fakepg.fidelity.gloo_checks)."""

    @functools.wraps(method)
    def checked(pg: "FakeProcessGroup", *args: Any, **kwargs: Any) -> Any:
        pg._cluster.checkers.calling(pg, name, args, kwargs)
        return method(pg, *args, **kwargs)

    return checked


# The collective methods (allreduce, broadcast, ...), as the op registry defines them, behind
# the argument checks of the door a call comes through.
for _name, _method in ops.c10d_methods().items():
    setattr(FakeProcessGroup, _name, _checked(_name, _method))


def create_fake_group(store, rank, world_size, timeout):
    binding = current_cluster()
    if binding is None:
        raise FakePGError(
            "the 'fakepg' backend exists only inside a fake world: run your function with "
            "fakepg.spawn(fn, nprocs=N) or your script with `fakerun --nproc-per-node N script.py`")
    cluster, global_rank = binding
    return FakeProcessGroup(cluster, global_rank, rank, world_size, timeout)


def register_backend() -> None:
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, create_fake_group, devices=["cpu", "cuda"])
    if type(dist.Backend.backend_list) is list:
        dist.Backend.backend_list = _BackendList(dist.Backend.backend_list)


class _BackendList(list):
    """torch's ``Backend.backend_list`` as a program sees it: without fakepg's own name when
    listed, iterated, counted, indexed or compared (torch's tests iterate it and expect only
    the backends they know), while ``"fakepg" in backend_list`` -- the check torch makes when a
    group is created with it -- stays true."""

    def _shown(self) -> list[str]:
        return [b for b in list.__iter__(self) if b != BACKEND_NAME]

    def __iter__(self):  # type: ignore[override]
        return iter(self._shown())

    def __len__(self) -> int:
        return len(self._shown())

    def __getitem__(self, index):  # type: ignore[override]
        return self._shown()[index]

    def __eq__(self, other: object) -> bool:
        return self._shown() == (list(other) if isinstance(other, list) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return repr(self._shown())

    def copy(self) -> list[str]:  # type: ignore[override]
        return self._shown()

    def index(self, value, *args) -> int:  # type: ignore[override]
        return self._shown().index(value, *args)

    def count(self, value) -> int:  # type: ignore[override]
        return self._shown().count(value)

    __hash__ = None  # type: ignore[assignment]
