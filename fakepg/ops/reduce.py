"""Reduce-like ops: all_reduce, reduce, reduce_scatter and their coalesced/tensor forms.

Reductions add in gloo's order under the gloo personality and in rank order 0..n-1 under
fakepg's own and nccl (:mod:`fakepg.ops.reductions`): either way the result is bitwise the same
whatever order the ranks issued in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..torch_private import foreach_copy
from .reductions import GLOO_REDUCE, gloo_all_reduce, order_of, reduce_tensors
from .base import (Op, as_list, c10d_method, copy_into, flatten, reduce_op_of, register,
                   signature, tensor_bytes)

if TYPE_CHECKING:
    from .matching import Call


class AllReduce(Op):
    def written(self, call: "Call") -> list[torch.Tensor]:
        return [t for t in call.inputs if isinstance(t, torch.Tensor)]

    def execute(self, calls: list["Call"]) -> None:
        first = calls[0]
        order = order_of(first.personality)
        if order != "rank" and len(first.inputs) > 1 and gloo_all_reduce(
                [c.inputs for c in calls], first.reduce_op, first.record.reduce_op,
                self.name == "all_reduce_coalesced"):
            for c in calls:
                c.result = list(c.inputs)
            return
        for i in range(len(first.inputs)):
            if self.name == "all_reduce_coalesced" and any(
                    first.inputs[i] is t for t in first.inputs[:i]):
                continue  # gloo reduces a tensor listed twice once
            ins = [c.inputs[i] for c in calls]
            red = reduce_tensors(ins, first.reduce_op, first.record.reduce_op, order)
            if red.is_sparse:  # sparse too: gloo replaces the input's indices and values in place
                for t in ins:
                    t.copy_(red)
            else:
                foreach_copy(ins, [red] * len(ins))  # one op for every rank's copy
        for c in calls:
            c.result = list(c.inputs)


class Reduce(Op):
    def written(self, call: "Call") -> list[torch.Tensor]:
        return list(call.inputs) if call.root == call.grank else []

    def execute(self, calls: list["Call"]) -> None:
        root = calls[calls[0].root]
        for i in range(len(root.inputs)):
            root.inputs[i].copy_(reduce_tensors([c.inputs[i] for c in calls], calls[0].reduce_op,
                                                calls[0].record.reduce_op,
                                                order_of(calls[0].personality, GLOO_REDUCE)))
        for c in calls:
            c.result = list(c.inputs)


class ReduceScatter(Op):
    """Lists of per-rank input tensors; rank j receives the reduction of everyone's j-th."""

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        for ins in call.inputs:
            if len(ins) != group_size:
                return f"input list has {len(ins)} tensors; the group has {group_size} ranks"
        for out, ins in zip(call.outputs, call.inputs):
            mine = ins[call.grank]
            if out.numel() != mine.numel() or out.dtype != mine.dtype:
                return (f"output {tuple(out.shape)} {out.dtype} does not fit this rank's input "
                        f"slot {tuple(mine.shape)} {mine.dtype}")
        return None

    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        # outputs may differ in size per rank (gloo allows it); the input lists must agree
        return [("tensors", signature(flatten(call.inputs)))]

    def nbytes(self, call: "Call", group_size: int) -> int:
        return sum(tensor_bytes(t) for t in flatten(call.outputs)) * group_size

    def execute(self, calls: list["Call"]) -> None:
        op, name = calls[0].reduce_op, calls[0].record.reduce_op
        order = order_of(calls[0].personality)
        for i in range(len(calls[0].outputs)):
            for j, c in enumerate(calls):
                c.outputs[i].copy_(reduce_tensors([d.inputs[i][j] for d in calls], op, name, order))
        for c in calls:
            c.result = list(c.outputs)


class ReduceScatterTensor(Op):
    """One flat input per tensor, world_size × the output; the output tensors need only
    agree in element count and dtype."""

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        for o, i in zip(call.outputs, call.inputs):
            if i.numel() != o.numel() * group_size:
                return (f"input has {i.numel()} elements; it must be world_size × output = "
                        f"{group_size} × {o.numel()}")
        return None

    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        return [("input numel/dtype", tuple((t.numel(), t.dtype) for t in call.inputs))]

    def execute(self, calls: list["Call"]) -> None:
        n = len(calls)
        for i in range(len(calls[0].inputs)):
            red = reduce_tensors([c.inputs[i].reshape(-1) for c in calls], calls[0].reduce_op,
                                 calls[0].record.reduce_op, order_of(calls[0].personality))
            for c, chunk in zip(calls, red.chunk(n)):
                copy_into(c.outputs[i], chunk)
        for c in calls:
            c.result = list(c.outputs)


ALL_REDUCE = register(AllReduce.named("all_reduce"))
ALL_REDUCE_COALESCED = register(AllReduce.named("all_reduce_coalesced"))
REDUCE = register(Reduce.named("reduce"))
REDUCE_SCATTER = register(ReduceScatter.named("reduce_scatter"))
REDUCE_SCATTER_TENSOR = register(ReduceScatterTensor.named("reduce_scatter_tensor"))
REDUCE_SCATTER_TENSOR_COALESCED = register(
    ReduceScatterTensor.named("reduce_scatter_tensor_coalesced"))


# -- the ProcessGroup methods (names as torch 2.11-2.13 call them) -------------------------

@c10d_method("allreduce")
def _allreduce(pg, tensors, opts=None):
    return pg.issue(ALL_REDUCE, as_list(tensors), reduce_op=reduce_op_of(opts))


@c10d_method("allreduce_coalesced")
def _allreduce_coalesced(pg, tensors, opts=None):
    return pg.issue(ALL_REDUCE_COALESCED, tensors, reduce_op=reduce_op_of(opts))


@c10d_method("reduce")
def _reduce(pg, tensors, opts=None):
    return pg.issue(REDUCE, tensors, root=opts.rootRank, reduce_op=opts.reduceOp)


@c10d_method("reduce_scatter")
def _reduce_scatter(pg, output_tensors, input_tensors, opts=None):
    return pg.issue(REDUCE_SCATTER, input_tensors, output_tensors, reduce_op=reduce_op_of(opts),
                    shape_of=output_tensors)


@c10d_method("reduce_scatter_single", "_reduce_scatter_base")
def _reduce_scatter_single(pg, output, input, opts=None):
    return pg.issue(REDUCE_SCATTER_TENSOR, [input], [output], reduce_op=reduce_op_of(opts))


@c10d_method("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
def _reduce_scatter_single_coalesced(pg, outputs, inputs, opts=None):
    return pg.issue(REDUCE_SCATTER_TENSOR_COALESCED, inputs, outputs, reduce_op=reduce_op_of(opts))
