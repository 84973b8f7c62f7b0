"""Gather-like ops, which copy without reducing: broadcast, scatter, gather, all_gather."""

from __future__ import annotations

import functools

from typing import TYPE_CHECKING, Any

import torch

from .base import (Op, as_list, c10d_method, copy_into, flatten, gloo_future_value, register,
                   signature, tensor_bytes)

if TYPE_CHECKING:
    from .matching import Call


class Broadcast(Op):
    def written(self, call: "Call") -> list[torch.Tensor]:
        return [t for t in call.inputs if isinstance(t, torch.Tensor)]

    def execute(self, calls: list["Call"]) -> None:
        src = calls[calls[0].root]
        if len(src.inputs) > 1:  # gloo: the root's tensors[rootTensor] goes to every tensor
            s = src.inputs[src.root_tensor]
            for c in calls:
                for d in c.inputs:
                    if d is not s:
                        d.copy_(s)
        for c in calls:
            if c is not src and len(src.inputs) == 1:
                c.inputs[0].copy_(src.inputs[0])
            c.result = list(c.inputs)


class _GatherBytes(Op):
    def nbytes(self, call: "Call", group_size: int) -> int:
        return sum(tensor_bytes(t) for t in flatten(call.inputs)) * group_size


def _gathers_all_inputs(call: "Call", group_size: int) -> bool:
    """gloo's allgather of n > 1 inputs: each output list has world_size × n tensors and
    receives every rank's inputs in rank order."""
    n = len(call.inputs)
    return (n > 1 and not call.per_rank_outputs
            and all(len(outs) == group_size * n for outs in call.outputs)
            and all(o.numel() == call.inputs[0].numel() for outs in call.outputs for o in outs))


class AllGather(_GatherBytes):
    """``outputs[i][rank]`` receives ``rank``'s ``inputs[i]``."""

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        if _gathers_all_inputs(call, group_size):
            return None
        for i, outs in enumerate(call.outputs):
            if len(outs) != group_size:
                return f"output list {i} has {len(outs)} tensors; the group has {group_size} ranks"
            for o in outs:
                if o.numel() != call.inputs[i].numel():
                    return (f"output tensor of shape {tuple(o.shape)} cannot hold input "
                            f"{tuple(call.inputs[i].shape)}")
        return None

    def execute(self, calls: list["Call"]) -> None:
        n = len(calls)
        if _gathers_all_inputs(calls[0], n):
            sources = [t for c in calls for t in c.inputs]
            for c in calls:
                for outs in c.outputs:
                    for o, s in zip(outs, sources):
                        o.copy_(s)
                c.result = gloo_future_value(c.outputs)
            return
        for c in calls:
            for i, outs in enumerate(c.outputs):
                for j, o in enumerate(outs):
                    o.copy_(calls[j].inputs[i])
            if c.per_rank_outputs:  # back to the caller's output_lists[rank][i]
                c.result = gloo_future_value([[outs[j] for outs in c.outputs] for j in range(n)])
            else:
                c.result = gloo_future_value(c.outputs)


class AllGatherIntoTensor(_GatherBytes):
    """Flat outputs of world_size × input; only element counts and dtypes must agree."""

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        for o, i in zip(call.outputs, call.inputs):
            if o.numel() != i.numel() * group_size:
                return (f"output has {o.numel()} elements; it must hold world_size × input = "
                        f"{group_size} × {i.numel()}")
        return None

    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        return [("input numel/dtype", tuple((t.numel(), t.dtype) for t in call.inputs))]

    def execute(self, calls: list["Call"]) -> None:
        for i in range(len(calls[0].inputs)):
            full = torch.cat([c.inputs[i].reshape(-1) for c in calls])
            for c in calls:
                copy_into(c.outputs[i], full)
        for c in calls:  # made when asked: n chunk views per rank add up to n² in one process
            c.result = functools.partial(self.result, c.outputs, len(calls))

    def result(self, outputs: list[torch.Tensor], n: int) -> list[Any]:
        # gloo runs the single-tensor form as allgather into output.chunk(n)
        o = outputs[0]
        return list(o.chunk(n) if o.dim() and o.shape[0] % n == 0 else o.view(-1).chunk(n))


class AllGatherIntoTensorCoalesced(AllGatherIntoTensor):
    def result(self, outputs: list[torch.Tensor], n: int) -> list[Any]:
        return list(outputs)


class Gather(_GatherBytes):
    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        if call.root == call.grank and (len(call.outputs) != 1 or len(call.outputs[0]) != group_size):
            return f"gather_list on the destination must have {group_size} tensors"
        return None

    def execute(self, calls: list["Call"]) -> None:
        root = calls[calls[0].root]
        for j, c in enumerate(calls):
            root.outputs[0][j].copy_(c.inputs[0])
        for c in calls:
            c.result = gloo_future_value(c.outputs) if c is root else []


class Scatter(Op):
    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        if call.root == call.grank and (len(call.inputs) != 1 or len(call.inputs[0]) != group_size):
            return f"scatter_list on the source must have {group_size} tensors"
        return None

    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        return [("tensors", signature(call.outputs))]

    def nbytes(self, call: "Call", group_size: int) -> int:
        return sum(tensor_bytes(t) for t in flatten(call.outputs)) * group_size

    def execute(self, calls: list["Call"]) -> None:
        root = calls[calls[0].root]
        for j, c in enumerate(calls):
            c.outputs[0].copy_(root.inputs[0][j])
            c.result = list(c.outputs)


BROADCAST = register(Broadcast.named("broadcast"))
ALL_GATHER = register(AllGather.named("all_gather"))
ALL_GATHER_INTO_TENSOR = register(AllGatherIntoTensor.named("all_gather_into_tensor"))
ALL_GATHER_INTO_TENSOR_COALESCED = register(
    AllGatherIntoTensorCoalesced.named("all_gather_into_tensor_coalesced"))
GATHER = register(Gather.named("gather"))
SCATTER = register(Scatter.named("scatter"))


# -- the ProcessGroup methods ------------------------------------------------------------

@c10d_method("broadcast")
def _broadcast(pg, tensors, opts=None, root=None):
    # the bindings: broadcast(tensors, opts) and broadcast(tensor, root)
    if root is None:
        root = opts.rootRank if opts is not None and not isinstance(opts, int) else (opts or 0)
    root_tensor = getattr(opts, "rootTensor", 0) if not isinstance(opts, (int, type(None))) else 0
    return pg.issue(BROADCAST, as_list(tensors), root=root, root_tensor=root_tensor)


@c10d_method("allgather")
def _allgather(pg, output_tensors, input_tensors, opts=None):
    return pg.issue(ALL_GATHER, input_tensors, output_tensors)


@c10d_method("allgather_coalesced")
def _allgather_coalesced(pg, output_lists, input_list, opts=None):
    # torch passes output_lists[rank][i] (rank's copy of input i); all_gather wants outputs[i][rank]
    per_input = [[outs[i] for outs in output_lists] for i in range(len(input_list))]
    return pg.issue(ALL_GATHER, input_list, per_input, per_rank_outputs=True)


@c10d_method("all_gather_single", "_allgather_base")
def _all_gather_single(pg, output, input, opts=None):
    return pg.issue(ALL_GATHER_INTO_TENSOR, [input], [output])


@c10d_method("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
def _all_gather_single_coalesced(pg, outputs, inputs, opts=None):
    return pg.issue(ALL_GATHER_INTO_TENSOR_COALESCED, inputs, outputs)


@c10d_method("gather")
def _gather(pg, output_tensors, input_tensors, opts=None):
    return pg.issue(GATHER, input_tensors, output_tensors, root=opts.rootRank)


@c10d_method("scatter")
def _scatter(pg, output_tensors, input_tensors, opts=None):
    return pg.issue(SCATTER, input_tensors, output_tensors, root=opts.rootRank,
                    shape_of=output_tensors)
