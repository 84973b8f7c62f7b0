"""gloo's summation order, stated plainly (the tests' own statement, independent of fakepg's).

torch 2.13's ProcessGroupGloo reduces on CPU with gloo's ring (gloo/allreduce.cc ``ring()``,
gloo/reduce.cc): the flat buffer is cut into ``world`` chunks of ``gloo_chunk(...)``
elements; chunk ``c`` starts as rank ``c-1``'s value and ranks ``c-2``, ``c-3``, ... ``c``
(mod world) each add theirs. ``tests/test_gloo_bitwise.py`` checks this against real gloo.
"""

from __future__ import annotations

import functools

import torch

from fakepg.ops.reductions import GLOO, gloo_chunk


def gloo_fold(xs: list[torch.Tensor], fold=torch.add, algorithm: str = GLOO) -> torch.Tensor:
    """``xs`` (one per rank, same shape) reduced with ``fold`` in gloo's order."""
    world, shape = len(xs), xs[0].shape
    flats = [x.reshape(-1) for x in xs]
    numel = flats[0].numel()
    chunk = gloo_chunk(numel, world, flats[0].element_size(), algorithm) if numel else 1
    out = torch.empty_like(flats[0])
    for c in range(world):
        lo, hi = c * chunk, min((c + 1) * chunk, numel)
        if lo < hi:
            acc = flats[(c - 1) % world][lo:hi]
            for k in range(2, world + 1):
                acc = fold(flats[(c - k) % world][lo:hi], acc)
            out[lo:hi] = acc
    return out.reshape(shape)


def rank_order(xs: list[torch.Tensor], fold=torch.add) -> torch.Tensor:
    """``xs`` folded left to right, rank 0 first (the nccl personality's order)."""
    return functools.reduce(fold, xs[1:], xs[0].clone())
