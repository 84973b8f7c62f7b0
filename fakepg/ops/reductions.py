"""Reference reductions: one deterministic function of all ranks' inputs.

Float addition is not associative, so the order of a sum shows in the last bits. Under the gloo
personality a reduction adds in the order torch 2.13's ProcessGroupGloo does, so results are
bitwise real gloo's at any world size. fakepg's own personality folds in rank order 0..n-1, the
order ``zoo.reference_train`` (the mathematics of data parallelism, in one process) sums in, so
a run equals that reference bit for bit; nccl folds in rank order too (NCCL's order depends on
channels, algorithm and hardware).

gloo's order, from its sources (``gloo/allreduce.cc`` ``ring()``, ``gloo/reduce.cc``) and
checked bit for bit against real gloo (``tests/test_gloo_bitwise.py``): the flat buffer is cut
into ``world`` chunks of ``chunk`` elements (:func:`gloo_chunk`; the last ones may be short or
empty). Chunk ``c`` starts as rank ``c-1``'s value; rank ``c-2`` adds its own to it, then
``c-3``, ... down to rank ``c`` (indices mod world): ``x[c] + (x[c+1] + (... + (x[c-2] +
x[c-1])))``. A rank with several input tensors folds them left to right first; fp16/bf16 add
pairwise in float and round after each addition, as torch's ``add_`` does.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

_INTEGRAL_ONLY = {"BAND", "BOR", "BXOR"}


_NAMES: dict[tuple[type, object], str] = {}
_RED_OP_TYPE = dist.ReduceOp.RedOpType
_RED_OP_NAMES: dict[int, str] = {}  # int(RedOpType) -> name: the common case (ints hash fastest)


def op_name(op: object) -> str:
    """``ReduceOp.SUM`` / ``RedOpType.SUM`` / a PREMUL_SUM ReduceOp -> ``"SUM"`` (a name is
    returned as is: the hot path passes the name the call's record already holds)."""
    if type(op) is str:
        return op
    kind = op.op if type(op) is dist.ReduceOp else op  # a ReduceOp carries its RedOpType in .op
    if type(kind) is _RED_OP_TYPE:
        value = int(kind)
        name = _RED_OP_NAMES.get(value)
        if name is None:
            name = _RED_OP_NAMES[value] = kind.name
        return name
    kind = getattr(kind, "op", kind)
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


# The reduce ops check_supported can refuse for some dtype (the others take every dtype).
DTYPE_LIMITED = frozenset(_INTEGRAL_ONLY | {"MIN", "MAX", "UNUSED"})


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


# -- the order of a sum ---------------------------------------------------------------------

RANK = "rank"  # rank order 0..n-1 (nccl)
GLOO = "gloo"  # gloo::allreduce's ring (allreduce, reduce_scatter, coalesced)
GLOO_REDUCE = "gloo_reduce"  # gloo::reduce's ring (its segments are sized differently)

_GLOO_ORDERED = frozenset(("gloo",))
_MAX_SEGMENT_BYTES = 1024 * 1024  # gloo's AllreduceOptions/ReduceOptions::kMaxSegmentSize


def order_of(personality: str, algorithm: str = GLOO) -> str:
    """The summation order a group of ``personality`` uses for ``algorithm`` (GLOO or
    GLOO_REDUCE): gloo's under "gloo", rank order under "fakepg" and "nccl"."""
    return algorithm if personality in _GLOO_ORDERED else RANK


@functools.lru_cache(maxsize=4096)
def gloo_chunk(numel: int, world: int, element_size: int, algorithm: str = GLOO) -> int:
    """Elements per ring chunk of gloo's ``algorithm`` for a flat buffer of ``numel`` elements:
    ``segments per rank × segment size``, as ``ring()`` in gloo/allreduce.cc and
    ``reduce()`` in gloo/reduce.cc compute them (1 MiB segments at most, at least 2 per rank,
    a whole number of segments per rank)."""
    total, es = numel * element_size, element_size
    if algorithm == GLOO_REDUCE:
        max_bytes = es * (_MAX_SEGMENT_BYTES // es)
        seg_bytes = _round_up(min(-(-total // (2 * world)), max_bytes), es)
        segments = _round_up(max(-(-total // seg_bytes), 2 * world), world)
    else:
        max_bytes = es * max(1, _MAX_SEGMENT_BYTES // es)
        segments = _round_up(max(-(-total // max_bytes), 2 * world), world)
        seg_bytes = _round_up(-(-total // segments), es)
    return (segments // world) * seg_bytes // es


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _ring(flats: Sequence[torch.Tensor], fold, chunk: int) -> torch.Tensor:
    """gloo's ring order over flat, same-length tensors (one per rank), per chunk slice."""
    world, numel = len(flats), flats[0].numel()
    out = torch.empty_like(flats[0], memory_format=torch.contiguous_format)
    for c in range(world):
        lo = c * chunk
        if lo >= numel:
            break
        hi = min(lo + chunk, numel)
        acc = out[lo:hi]
        acc.copy_(flats[c - 1][lo:hi])  # negative indices are ranks mod world
        for k in range(2, world + 1):
            fold(acc, flats[c - k][lo:hi])  # a + b == b + a bitwise: only the grouping matters
    return out


def _ring_order_matters(tensors: Sequence[torch.Tensor], order: str) -> bool:
    first = tensors[0]
    return (order != RANK and len(tensors) > 2 and first.layout == torch.strided
            and (first.dtype.is_floating_point or first.dtype.is_complex) and first.numel() > 0)


def _ring_fold(tensors: Sequence[torch.Tensor], fold, order: str) -> torch.Tensor:
    first = tensors[0]
    if first.dtype.is_complex:  # gloo reduces complex tensors as their real views
        flats = [torch.view_as_real(t).reshape(-1) for t in tensors]
    else:
        flats = [t.reshape(-1) for t in tensors]
    chunk = gloo_chunk(flats[0].numel(), len(flats), flats[0].element_size(), order)
    out = _ring(flats, fold, chunk)
    if first.dtype.is_complex:
        out = torch.view_as_complex(out.view(-1, 2))
    return out.view(first.shape)


def gloo_all_reduce(per_rank: Sequence[Sequence[torch.Tensor]], op: object, name: str | None,
                    coalesced: bool) -> bool:
    """An all_reduce of several tensors per rank, as gloo computes it, written into the
    tensors; False (nothing written) where gloo's way does not apply (sparse, mixed dtypes or
    shapes, one tensor per rank).

    ``coalesced`` (allreduce_coalesced): each rank's tensors are concatenated and the flat
    buffer reduced in one ring, then copied back (a tensor listed twice gets the later slice).
    Otherwise (allreduce of a list): a rank's tensors are folded left to right, the folds
    reduced, and every tensor gets the result; gloo divides only the first by the world size
    for AVG (ProcessGroupGloo's ``tensors[0] /= size``)."""
    first = per_rank[0]
    if len(first) < 2:
        return False
    if not coalesced and all(t.is_sparse for ts in per_rank for t in ts):
        # gloo's sparse allreduce sums a rank's tensors, then the ranks' sums, and gives every
        # tensor the coalesced total (its nnz: the distinct indices of all inputs)
        total = reduce_tensors([reduce_tensors(list(ts), op, name, RANK) for ts in per_rank],
                               op, name, GLOO)
        for ts in per_rank:
            for t in ts:
                t.copy_(total)
        return True
    if any(t.layout != torch.strided for ts in per_rank for t in ts):
        return False
    if any(t.dtype != first[0].dtype for t in first):
        return False
    name = name or op_name(op)
    if coalesced:
        flats = [torch.cat([t.reshape(-1) for t in ts]) for ts in per_rank]
        red = reduce_tensors(flats, op, name, GLOO)
        for ts in per_rank:
            offset = 0
            for t in ts:
                t.copy_(red[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
        return True
    if any(t.shape != first[0].shape for t in first) or name not in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        return False
    local_op = "SUM" if name == "AVG" else name
    locals_ = [reduce_tensors(list(ts), op, local_op, RANK) for ts in per_rank]
    red = reduce_tensors(locals_, op, local_op, GLOO)
    for ts in per_rank:
        for t in ts:
            t.copy_(red)
        if name == "AVG":
            if ts[0].dtype.is_floating_point or ts[0].dtype.is_complex:
                ts[0].div_(len(per_rank))
            else:  # integer AVG (gloo refuses it before this): truncated, as reduce_tensors
                ts[0].copy_(torch.div(ts[0], len(per_rank), rounding_mode="trunc"))
    return True


def reduce_tensors(tensors: Sequence[torch.Tensor], op: object,
                   name: str | None = None, order: str = RANK) -> torch.Tensor:
    """Reduce ``tensors`` (one per rank, rank order) into a new tensor (``name``: op's name,
    when the caller has it) in ``order``: RANK, or gloo's ring (GLOO, GLOO_REDUCE) where the
    order can matter (floating point SUM/AVG/PRODUCT of more than two ranks)."""
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
    if name in ("SUM", "AVG", "PRODUCT") and _ring_order_matters(tensors, order):
        acc = _ring_fold(tensors, torch.Tensor.add_ if name != "PRODUCT" else torch.Tensor.mul_, order)
        if name == "AVG":
            acc.div_(len(tensors))
        return acc
    if name in ("SUM", "AVG"):
        second = tensors[1] if len(tensors) > 1 else None
        if second is not None and second.dtype == first.dtype and second.shape == first.shape:
            acc = first + second  # = first.clone().add_(second), one op fewer
            rest = tensors[2:]
        else:
            acc, rest = first.clone(), tensors[1:]
        for t in rest:
            acc.add_(t)
        if name == "AVG":
            if acc.dtype.is_floating_point or acc.dtype.is_complex:
                acc.div_(len(tensors))
            else:
                acc = torch.div(acc, len(tensors), rounding_mode="trunc")  # as ncclAvg (C division)
        return acc
    acc = first.clone()
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

