"""Reference reductions: one deterministic function of all ranks' inputs, in rank order."""

from __future__ import annotations

from typing import Sequence

import torch

_INTEGRAL_ONLY = {"BAND", "BOR", "BXOR"}


_NAMES: dict[tuple[type, object], str] = {}


def op_name(op: object) -> str:
    """``ReduceOp.SUM`` / ``RedOpType.SUM`` / a PREMUL_SUM ReduceOp -> ``"SUM"`` (a name is
    returned as is: the hot path passes the name the call's record already holds)."""
    if type(op) is str:
        return op
    kind = getattr(op, "op", op)  # ReduceOp objects carry their RedOpType in .op
    key = (type(kind), kind)
    try:
        return _NAMES[key]  # cached: this runs on every reducing collective
    except (KeyError, TypeError):
        name = getattr(kind, "name", None)
        name = (str(kind) if name is None else name).split(".")[-1]
        try:
            _NAMES[key] = name
        except TypeError:  # unhashable: not cached
            pass
        return name


def check_supported(op: object, dtype: torch.dtype) -> str | None:
    """Why ``op`` cannot reduce ``dtype`` (None when it can), in the words gloo uses."""
    name = op_name(op)
    if name in _INTEGRAL_ONLY and (dtype.is_floating_point or dtype.is_complex):
        return f"ReduceOp.{name} is not supported for floating-point or complex dtype {dtype}"
    if name in ("MIN", "MAX") and dtype.is_complex:
        return f"ReduceOp.{name} is not supported for complex dtype {dtype}"
    if name == "UNUSED":
        return "ReduceOp.UNUSED is not a reduction"
    return None


def reduce_tensors(tensors: Sequence[torch.Tensor], op: object,
                   name: str | None = None) -> torch.Tensor:
    """Reduce ``tensors`` (one per rank, rank order) into a new tensor (``name``: op's name,
    when the caller has it)."""
    name = name or op_name(op)
    first = tensors[0]
    if first.is_sparse:
        if name not in ("SUM", "AVG"):
            raise ValueError(f"sparse all_reduce supports SUM only, got ReduceOp.{name}")
        acc = first
        for t in tensors[1:]:
            acc = acc + t
        acc = acc.coalesce()
        return acc / len(tensors) if name == "AVG" else acc
    if first.dtype == torch.bool:
        fn = {"SUM": torch.logical_or, "MAX": torch.logical_or, "BOR": torch.logical_or,
              "PRODUCT": torch.logical_and, "MIN": torch.logical_and, "BAND": torch.logical_and,
              "BXOR": torch.logical_xor}.get(name)
        if fn is None:
            raise ValueError(f"ReduceOp.{name} is not supported for torch.bool")
        acc = first.clone()
        for t in tensors[1:]:
            acc = fn(acc, t)
        return acc
    if name == "PREMUL_SUM":
        factor = op.factor  # type: ignore[attr-defined]
        acc = first * factor
        for t in tensors[1:]:
            acc.add_(t * factor)
        return acc.to(first.dtype)
    acc = first.clone()
    if name in ("SUM", "AVG"):
        for t in tensors[1:]:
            acc.add_(t)
        if name == "AVG":
            if acc.dtype.is_floating_point or acc.dtype.is_complex:
                acc.div_(len(tensors))
            else:
                acc = torch.div(acc, len(tensors), rounding_mode="trunc")  # as ncclAvg (C division)
        return acc
    binary = {"PRODUCT": torch.Tensor.mul_, "MIN": None, "MAX": None,
              "BAND": torch.Tensor.bitwise_and_, "BOR": torch.Tensor.bitwise_or_,
              "BXOR": torch.Tensor.bitwise_xor_}
    if name not in binary:
        raise ValueError(f"unknown reduce op {op!r}")
    for t in tensors[1:]:
        if name == "MIN":
            acc = torch.minimum(acc, t)
        elif name == "MAX":
            acc = torch.maximum(acc, t)
        else:
            binary[name](acc, t)
    return acc

