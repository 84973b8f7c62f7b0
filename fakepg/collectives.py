"""Matching and execution of collectives across the ranks of a fake world.

The k-th collective each member of a group issues forms one :class:`Collective`.
When the last member issues it, the members' fingerprints are compared and, if they
agree, the result is computed from all inputs in rank order and written to every
member's output tensors. Each member's Work completes later, on that member's own
thread, so future callbacks always run in the owning rank's context.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import FakePGError
from .reductions import check_supported, op_name, reduce_tensors
from .trace import CollectiveRecord


@dataclass(eq=False)
class Call:
    """One rank's part of a collective."""

    rank: int  # global rank
    grank: int  # rank within the group
    op: str
    inputs: list[Any]
    outputs: list[Any]
    site: str
    record: CollectiveRecord
    root: int | None = None  # group rank
    reduce_op: Any = None
    in_splits: list[int] | None = None
    out_splits: list[int] | None = None
    peer: int | None = None  # group rank of the p2p peer (None: any source)
    tag: int = 0
    work: Any = None
    result: list[Any] | None = None
    source: int | None = None  # for recv from any source: the group rank that sent
    per_rank_outputs: bool = False  # allgather_coalesced: the caller's lists are output_lists[rank][i]
    in_backward: bool = False  # issued inside autograd's backward (by the Reducer or a comm hook)
    # Settled before the issuing call returns: its wait happens in C++ (the Reducer's end of
    # backward, Join's shadow pass), where the scheduler cannot see it.
    hidden_wait: bool = False
    collective: "Collective | None" = None  # set when issued
    p2p_order: int = -1  # arrival order of an unmatched p2p call (recv from any source)
    ext: Any = None  # a slot for the layer above (a timing model's per-call state)

    def describe(self) -> str:
        return f"{self.record.describe()} at {self.site}"

    def written(self) -> list[torch.Tensor]:
        """Tensors this call's collective writes on this rank (for race detection)."""
        if self.op in ("all_reduce", "all_reduce_coalesced", "broadcast", "recv"):
            return [t for t in self.inputs if isinstance(t, torch.Tensor)]
        if self.op == "reduce":
            return list(self.inputs) if self.root == self.grank else []
        return [t for t in _flatten(self.outputs) if isinstance(t, torch.Tensor)]


@dataclass(eq=False)
class Collective:
    group: "GroupState"
    seq: int
    op: str
    calls: list[Call | None]
    p2p: bool = False
    arrived: int = 0
    matched: bool = False
    error: FakePGError | None = None

    @property
    def settled(self) -> bool:
        return self.matched or self.error is not None

    def members(self) -> list[Call]:
        return [c for c in self.calls if c is not None]

    def missing_ranks(self) -> list[int]:
        return [self.group.ranks[g] for g, c in enumerate(self.calls) if c is None]


class GroupState:
    """Cluster-wide state of one process group (shared by its members' PG objects)."""

    def __init__(self, name: str, ranks: Sequence[int], timeout: float = 1800.0):
        self.name = name
        self.timeout = timeout  # seconds, the group's timeout as c10d was given it
        self.ranks = tuple(ranks)
        self.size = len(ranks)
        self.next_seq = [0] * self.size
        self.next_p2p = [0] * self.size
        self.pending: dict[int, Collective] = {}
        self.last_done = [-1] * self.size
        self.sends: dict[tuple[int, int, int], collections.deque[Call]] = collections.defaultdict(collections.deque)
        self.recvs: dict[tuple[int, int, int], collections.deque[Call]] = collections.defaultdict(collections.deque)
        self.p2p_order = itertools.count()

    @property
    def label(self) -> str:
        return f"'{self.name}' (ranks {list(self.ranks)})"


# --------------------------------------------------------------------------------------
# Per-op rules: what must agree across ranks, and what the collective computes.
# --------------------------------------------------------------------------------------

def _flatten(xs: Any) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(_flatten(x))
        else:
            out.append(x)
    return out


def _sig(ts: Sequence[Any]) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type) for t in ts)


def fingerprint(call: Call) -> dict[str, Any]:
    """The properties of ``call`` that every member must agree on."""
    op = call.op
    fp: dict[str, Any] = {"op": op}
    if op in ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce"):
        fp["tensors"] = _sig(call.inputs)
    elif op in ("all_gather", "gather"):
        fp["tensors"] = _sig(call.inputs)
    elif op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        fp["input numel/dtype"] = tuple((t.numel(), t.dtype) for t in call.inputs)
    elif op in ("scatter", "reduce_scatter"):
        fp["tensors"] = _sig(call.outputs)
    elif op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        fp["input numel/dtype"] = tuple((t.numel(), t.dtype) for t in call.inputs)
    elif op in ("all_to_all", "all_to_all_single"):
        fp["dtypes"] = tuple(t.dtype for t in call.inputs)
        fp["tensor count"] = len(call.inputs)
    if call.reduce_op is not None:
        fp["reduce op"] = op_name(call.reduce_op)
        if fp["reduce op"] == "PREMUL_SUM":
            f = call.reduce_op.factor
            fp["premul factor"] = f.item() if isinstance(f, torch.Tensor) else f
    if call.root is not None:
        fp["root"] = call.root
    return fp


def _pairwise_all_to_all(calls: Sequence[Call]) -> str | None:
    """all_to_all lets shapes differ per rank; only what i sends j must fit what j expects."""
    for c in calls:
        for d in calls:
            if c.op == "all_to_all":
                sent, expected = c.inputs[d.grank], d.outputs[c.grank]
                if sent.numel() != expected.numel():
                    return (f"rank {c.rank} sends {tuple(sent.shape)} to rank {d.rank}, "
                            f"which expects {tuple(expected.shape)}")
            else:
                if c.in_splits[d.grank] != d.out_splits[c.grank]:
                    return (f"rank {c.rank} sends {c.in_splits[d.grank]} rows to rank {d.rank} "
                            f"(input_split_sizes={c.in_splits}), which expects "
                            f"{d.out_splits[c.grank]} (output_split_sizes={d.out_splits})")
                if tuple(c.inputs[0].shape[1:]) != tuple(d.outputs[0].shape[1:]):
                    return (f"rank {c.rank}'s rows have shape {tuple(c.inputs[0].shape[1:])}, "
                            f"rank {d.rank}'s {tuple(d.outputs[0].shape[1:])}")
    return None


def check_match(coll: Collective) -> str | None:
    """None when the members agree, else the list of differing properties."""
    calls = coll.members()
    fps = [fingerprint(c) for c in calls]
    keys = sorted({k for fp in fps for k in fp}, key=lambda k: (k != "op", k))
    differing = [k for k in keys if any(fp.get(k) != fps[0].get(k) for fp in fps)]
    if differing:
        return ", ".join(differing)
    if calls[0].op in ("all_to_all", "all_to_all_single"):
        return _pairwise_all_to_all(calls)
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        src = src.reshape(dst.shape)
    dst.copy_(src)


def _gloo_future_value(lists: list[list[Any]]) -> list[Any]:
    """What gloo's future yields for a vector of output lists: [] when there is none,
    the one list itself when there is one, else the list of lists (ProcessGroupGloo's
    returnFutureWithOutput)."""
    if not lists:
        return []
    return list(lists[0]) if len(lists) == 1 else [list(x) for x in lists]


def execute(coll: Collective) -> None:
    """Compute the collective from all members' inputs; write outputs; set each call's result."""
    calls: list[Call] = coll.members()  # type: ignore[assignment]
    op = coll.op
    n = len(calls)
    if op in ("all_reduce", "all_reduce_coalesced"):
        for i in range(len(calls[0].inputs)):
            red = reduce_tensors([c.inputs[i] for c in calls], calls[0].reduce_op)
            if red.is_sparse:
                for c in calls:
                    c.inputs[i] = red.clone()
            else:
                for c in calls:
                    c.inputs[i].copy_(red)
        for c in calls:
            c.result = list(c.inputs)
    elif op == "broadcast":
        src = calls[calls[0].root]
        for c in calls:
            if c is not src:
                for d, s in zip(c.inputs, src.inputs):
                    d.copy_(s)
            c.result = list(c.inputs)
    elif op == "reduce":
        root = calls[calls[0].root]
        for i in range(len(root.inputs)):
            red = reduce_tensors([c.inputs[i] for c in calls], calls[0].reduce_op)
            root.inputs[i].copy_(red)
        for c in calls:
            c.result = list(c.inputs)
    elif op == "all_gather":
        for c in calls:
            for i, outs in enumerate(c.outputs):
                for j, o in enumerate(outs):
                    o.copy_(calls[j].inputs[i])
            if c.per_rank_outputs:  # back to the caller's output_lists[rank][i]
                c.result = _gloo_future_value([[outs[j] for outs in c.outputs] for j in range(n)])
            else:
                c.result = _gloo_future_value(c.outputs)
    elif op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        for i in range(len(calls[0].inputs)):
            full = torch.cat([c.inputs[i].reshape(-1) for c in calls])
            for c in calls:
                _copy(c.outputs[i], full)
        for c in calls:
            if op == "all_gather_into_tensor":  # gloo runs it as allgather into output.chunk(n)
                o = c.outputs[0]
                c.result = list(o.chunk(n) if o.dim() and o.shape[0] % n == 0 else o.view(-1).chunk(n))
            else:
                c.result = list(c.outputs)
    elif op == "gather":
        root = calls[calls[0].root]
        for j, c in enumerate(calls):
            root.outputs[0][j].copy_(c.inputs[0])
        for c in calls:
            c.result = _gloo_future_value(c.outputs) if c is root else []
    elif op == "scatter":
        root = calls[calls[0].root]
        for j, c in enumerate(calls):
            c.outputs[0].copy_(root.inputs[0][j])
            c.result = list(c.outputs)
    elif op == "reduce_scatter":
        for i in range(len(calls[0].outputs)):
            for j, c in enumerate(calls):
                c.outputs[i].copy_(reduce_tensors([d.inputs[i][j] for d in calls], calls[0].reduce_op))
        for c in calls:
            c.result = list(c.outputs)
    elif op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        for i in range(len(calls[0].inputs)):
            red = reduce_tensors([c.inputs[i].reshape(-1) for c in calls], calls[0].reduce_op)
            for c, chunk in zip(calls, red.chunk(n)):
                _copy(c.outputs[i], chunk)
        for c in calls:
            c.result = list(c.outputs)
    elif op == "all_to_all":
        for c in calls:
            for d in calls:
                _copy(d.outputs[c.grank], c.inputs[d.grank])
        for c in calls:
            c.result = list(c.outputs)
    elif op == "all_to_all_single":
        pieces = [list(c.inputs[0].split(c.in_splits, dim=0)) for c in calls]
        for d in calls:
            d.outputs[0].copy_(torch.cat([pieces[c.grank][d.grank] for c in calls], dim=0))
            d.result = list(d.outputs)
    elif op in ("barrier", "monitored_barrier"):
        for c in calls:
            c.result = []
    elif op == "p2p":
        send, recv = calls
        _copy(recv.inputs[0], send.inputs[0])
        recv.source = send.grank
        send.result, recv.result = list(send.inputs), list(recv.inputs)
    else:  # pragma: no cover - issue() validates op names first
        raise FakePGError(f"fakepg cannot execute unknown op {op!r}")


def mismatch_message(coll: Collective, differing: str) -> str:
    lines = [f"collective #{coll.seq} on group {coll.group.label} does not match across ranks "
             f"(differs in: {differing}):"]
    for c in coll.members():
        lines.append(f"  rank {c.rank}: {c.describe()}")
    lines.append("Every rank of a group must issue the same sequence of collectives with "
                 "matching op, shapes, dtypes, reduce op and root.")
    return "\n".join(lines)


def validate_local(call: Call, group_size: int) -> str | None:
    """Errors a single rank's call has on its own (bad input, before any matching)."""
    op = call.op
    tensors = [t for t in _flatten(call.inputs) + _flatten(call.outputs) if isinstance(t, torch.Tensor)]
    if call.reduce_op is not None:
        for t in tensors:
            why = check_supported(call.reduce_op, t.dtype)
            if why:
                return why
    if call.root is not None and not 0 <= call.root < group_size:
        return f"root {call.root} is not a rank of a group of size {group_size}"
    if op == "all_gather":
        for i, outs in enumerate(call.outputs):
            if len(outs) != group_size:
                return f"output list {i} has {len(outs)} tensors; the group has {group_size} ranks"
            for o in outs:
                if o.numel() != call.inputs[i].numel():
                    return f"output tensor of shape {tuple(o.shape)} cannot hold input {tuple(call.inputs[i].shape)}"
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        for o, i in zip(call.outputs, call.inputs):
            if o.numel() != i.numel() * group_size:
                return (f"output has {o.numel()} elements; it must hold world_size × input = "
                        f"{group_size} × {i.numel()}")
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        for o, i in zip(call.outputs, call.inputs):
            if i.numel() != o.numel() * group_size:
                return (f"input has {i.numel()} elements; it must be world_size × output = "
                        f"{group_size} × {o.numel()}")
    if op == "reduce_scatter":
        for ins in call.inputs:
            if len(ins) != group_size:
                return f"input list has {len(ins)} tensors; the group has {group_size} ranks"
    if op in ("all_to_all",) and (len(call.inputs) != group_size or len(call.outputs) != group_size):
        return f"all_to_all needs {group_size} input and output tensors, got {len(call.inputs)} and {len(call.outputs)}"
    if op == "all_to_all_single":
        for name, splits, t in (("input", call.in_splits, call.inputs[0]), ("output", call.out_splits, call.outputs[0])):
            if len(splits) != group_size:
                return f"{name}_split_sizes has {len(splits)} entries; the group has {group_size} ranks"
            if sum(splits) != t.shape[0]:
                return f"{name}_split_sizes sum to {sum(splits)} but the {name} has {t.shape[0]} rows"
    if op == "gather" and call.root == call.grank:
        if len(call.outputs) != 1 or len(call.outputs[0]) != group_size:
            return f"gather_list on the destination must have {group_size} tensors"
    if op == "scatter" and call.root == call.grank:
        if len(call.inputs) != 1 or len(call.inputs[0]) != group_size:
            return f"scatter_list on the source must have {group_size} tensors"
    return None
