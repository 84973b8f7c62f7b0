"""All-to-all ops: every rank sends a piece to every rank; shapes may differ per rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from .base import Op, c10d_method, copy_into, register

if TYPE_CHECKING:
    from .matching import Call


class _AllToAll(Op):
    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        return [("dtypes", tuple(t.dtype for t in call.inputs)), ("tensor count", len(call.inputs))]


class AllToAll(_AllToAll):
    """``outputs[j]`` on rank i receives rank j's ``inputs[i]``."""

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        if len(call.inputs) != group_size or len(call.outputs) != group_size:
            return (f"all_to_all needs {group_size} input and output tensors, got "
                    f"{len(call.inputs)} and {len(call.outputs)}")
        return None

    def check_members(self, calls: Sequence["Call"]) -> str | None:
        # Only what i sends j must fit what j expects.
        for c in calls:
            for d in calls:
                sent, expected = c.inputs[d.grank], d.outputs[c.grank]
                if sent.numel() != expected.numel():
                    return (f"rank {c.rank} sends {tuple(sent.shape)} to rank {d.rank}, "
                            f"which expects {tuple(expected.shape)}")
        return None

    def execute(self, calls: list["Call"]) -> None:
        for c in calls:
            for d in calls:
                copy_into(d.outputs[c.grank], c.inputs[d.grank])
        for c in calls:
            c.result = list(c.outputs)


class AllToAllSingle(_AllToAll):
    """One input and one output tensor, split along dim 0 by per-rank row counts."""

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        for name, splits, t in (("input", call.in_splits, call.inputs[0]),
                                ("output", call.out_splits, call.outputs[0])):
            if len(splits) != group_size:
                return f"{name}_split_sizes has {len(splits)} entries; the group has {group_size} ranks"
            if sum(splits) != t.shape[0]:
                return f"{name}_split_sizes sum to {sum(splits)} but the {name} has {t.shape[0]} rows"
        return None

    def check_members(self, calls: Sequence["Call"]) -> str | None:
        for c in calls:
            for d in calls:
                if c.in_splits[d.grank] != d.out_splits[c.grank]:
                    return (f"rank {c.rank} sends {c.in_splits[d.grank]} rows to rank {d.rank} "
                            f"(input_split_sizes={c.in_splits}), which expects "
                            f"{d.out_splits[c.grank]} (output_split_sizes={d.out_splits})")
                if tuple(c.inputs[0].shape[1:]) != tuple(d.outputs[0].shape[1:]):
                    return (f"rank {c.rank}'s rows have shape {tuple(c.inputs[0].shape[1:])}, "
                            f"rank {d.rank}'s {tuple(d.outputs[0].shape[1:])}")
        return None

    def execute(self, calls: list["Call"]) -> None:
        pieces = [list(c.inputs[0].split(c.in_splits, dim=0)) for c in calls]
        for d in calls:
            d.outputs[0].copy_(torch.cat([pieces[c.grank][d.grank] for c in calls], dim=0))
            d.result = list(d.outputs)


ALL_TO_ALL = register(AllToAll.named("all_to_all"))
ALL_TO_ALL_SINGLE = register(AllToAllSingle.named("all_to_all_single"))


@c10d_method("alltoall")
def _alltoall(pg, output_tensors, input_tensors, opts=None):
    return pg.issue(ALL_TO_ALL, input_tensors, output_tensors)


@c10d_method("all_to_all_single", "alltoall_base")
def _all_to_all_single(pg, output, input, output_split_sizes, input_split_sizes, opts=None):
    n = pg.size()
    if pg.personality.name != "fakepg" and not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("Tensors must be contiguous")  # gloo's and NCCL's tensor checks
    ins = list(input_split_sizes) or [input.shape[0] // n] * n
    outs = list(output_split_sizes) or [output.shape[0] // n] * n
    if not input_split_sizes and input.shape[0] % n:
        raise ValueError(f"all_to_all_single: input has {input.shape[0]} rows, not divisible "
                         f"by the group size {n}; pass input_split_sizes")
    return pg.issue(ALL_TO_ALL_SINGLE, [input], [output], in_splits=ins, out_splits=outs)
