"""Comparing two outcomes, in words: collectives first, then DDP's logging, then final states.

Whether two tensors agree is decided by ``torch.testing.assert_close`` (with the tolerance of
:func:`default_tolerance`), or bit for bit with ``bitwise=True`` (fakepg adds in gloo's order, so
a fake run and a gloo run end with the same bits); the report then says where and by how much,
one line per difference.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.base import dtype_name
from .outcome import RecordedCollective, ScenarioOutcome

__all__ = ["compare", "assert_conformant", "default_tolerance"]

_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # float64 layers fed by float32 ones inherit float32-level noise: tighter than float32, not 1e-15.
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
    torch.complex128: (1e-7, 1e-9),
    torch.complex64: (1e-4, 1e-5),
}

# The layout keys first: a layout difference explains the rest.
_KEY_ORDER = ("bucket_cap_bytes", "bucket_sizes", "has_rebuilt_buckets", "rebuilt_bucket_sizes",
              "rebuilt_per_bucket_param_indices", "prev_iteration_grad_ready_order_indices")


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for final states of ``dtype``: reductions in a different order differ in
    the last bits, and a few optimizer steps amplify that a little. Integers: exact."""
    if dtype in _TOLERANCES:
        return _TOLERANCES[dtype]
    if dtype.is_floating_point:
        return (5e-2, 1e-2)  # float8 and friends
    return (0.0, 0.0)


def _labels(a: ScenarioOutcome, b: ScenarioOutcome) -> tuple[str, str]:
    if a.backend != b.backend:
        return a.backend, b.backend
    return f"{a.backend} (a)", f"{b.backend} (b)"


def compare(a: ScenarioOutcome, b: ScenarioOutcome, *, rtol: float | None = None,
            atol: float | None = None, bitwise: bool = False) -> list[str]:
    """The differences between two outcomes, in words, the first (most fundamental) first.

    Compared, per rank: the collective sequence (the first differing collective, or the first
    extra one), the DDP logging data both sides have (bucket sizes, rebuilt buckets, grad-ready
    order, ...), then final parameters and buffers (names, shapes, dtypes; values within
    ``rtol``/``atol``, by default :func:`default_tolerance` of the dtype; with ``bitwise``, the
    same bits: -0.0 is not 0.0, NaNs compare by payload). Parts that either
    outcome lacks (``None``) are skipped. An empty list means conformant.
    """
    la, lb = _labels(a, b)
    if a.world_size != b.world_size:
        return [f"world size: {la} {a.world_size} vs {lb} {b.world_size}"]
    n = a.world_size
    diffs: list[str] = []
    if a.collectives is not None and b.collectives is not None:
        for r in range(n):
            diffs.extend(_compare_collectives(r, a.collectives[r], b.collectives[r], la, lb, n))
    if a.ddp_logging is not None and b.ddp_logging is not None:
        for r in range(n):
            da, db = a.ddp_logging[r], b.ddp_logging[r]
            for key in sorted(set(da) & set(db), key=_logging_key_order):
                if da[key] != db[key]:
                    diffs.append(f"rank {r}: {key} {la} {_short(da[key])} vs {lb} {_short(db[key])}")
    if a.states is not None and b.states is not None:
        params = a.param_names | b.param_names
        for r in range(n):
            diffs.extend(_compare_states(r, a.states[r], b.states[r], la, lb, params, rtol, atol,
                                         bitwise))
    return diffs


def assert_conformant(a: ScenarioOutcome, b: ScenarioOutcome, *, rtol: float | None = None,
                      atol: float | None = None, bitwise: bool = False, max_lines: int = 10) -> None:
    """Raise ``AssertionError`` listing the first differences when :func:`compare` finds any."""
    diffs = compare(a, b, rtol=rtol, atol=atol, bitwise=bitwise)
    if diffs:
        la, lb = _labels(a, b)
        shown = diffs[:max_lines]
        more = f"\n  ... and {len(diffs) - max_lines} more" if len(diffs) > max_lines else ""
        raise AssertionError(f"scenario {a.scenario or b.scenario!r} on {a.world_size} ranks: "
                             f"{la} and {lb} differ ({len(diffs)} differences):\n  "
                             + "\n  ".join(shown) + more)


def _logging_key_order(key: str) -> tuple[int, str]:
    return (_KEY_ORDER.index(key) if key in _KEY_ORDER else len(_KEY_ORDER), key)


def _short(v: Any, limit: int = 120) -> str:
    text = f"[{v}]" if isinstance(v, str) and ("," in v or " " in v) else repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _compare_collectives(rank: int, ca: list, cb: list, la: str, lb: str, n: int) -> list[str]:
    for i, (x, y) in enumerate(zip(ca, cb)):
        if tuple(x) != tuple(y):
            return [f"rank {rank}, collective #{i}: {la} {_describe(x, n)} vs {lb} {_describe(y, n)}"]
    if len(ca) != len(cb):
        longer, label = (ca, la) if len(ca) > len(cb) else (cb, lb)
        k = min(len(ca), len(cb))
        return [f"rank {rank}: {la} issued {len(ca)} collectives, {lb} {len(cb)}; first extra: "
                f"collective #{k} {label} {_describe(longer[k], n)}"]
    return []


def _describe(c: Any, n: int) -> str:
    return RecordedCollective(*c).describe(n)


def _compare_states(rank: int, sa: dict, sb: dict, la: str, lb: str, params: frozenset[str],
                    rtol: float | None, atol: float | None, bitwise: bool = False) -> list[str]:
    out: list[str] = []
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if only_a or only_b:
        out.append(f"rank {rank}: state keys differ: only in {la} {only_a}, only in {lb} {only_b}")
    for key in [k for k in sa if k in sb]:
        what = f"rank {rank}: {'parameter' if key in params else 'buffer'} {key!r}"
        x, y = sa[key], sb[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                out.append(f"{what}: {la} {x!r} vs {lb} {y!r}")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{what}: {la} {tuple(x.shape)} {dtype_name(x.dtype)} vs {lb} {tuple(y.shape)} {dtype_name(y.dtype)}")
            continue
        line = _bit_difference(x, y) if bitwise else _tensor_difference(x, y, la, lb, rtol, atol)
        if line:
            out.append(f"{what}{line}")
    return out


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_difference(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """``None`` when ``x`` and ``y`` hold the same bits, else how many elements differ."""
    if x.is_sparse:
        x, y = x.to_dense(), y.to_dense()
    dtype = dtype_name(x.dtype)
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    if x.dtype == torch.bool:
        x, y = x.to(torch.uint8), y.to(torch.uint8)
    as_int = _INTS[x.element_size()]
    bx, by = (t.detach().cpu().contiguous().reshape(-1).view(as_int) for t in (x, y))
    bad = bx != by
    if not bad.any():
        return None
    worst = ""
    if x.dtype.is_floating_point:
        d = (x.double() - y.double()).abs().reshape(-1)[bad]
        worst = f"; max abs difference {float(d.nan_to_num(nan=0.0).max()):.3g}"
    return f" differs in the bits of {int(bad.sum())} of {bx.numel()} values ({dtype}{worst})"


def _tensor_difference(x: torch.Tensor, y: torch.Tensor, la: str, lb: str,
                       rtol: float | None, atol: float | None) -> str | None:
    """``None`` when ``assert_close`` accepts ``x`` (actual) against ``y`` (expected), else how
    they differ: NaN placement, or count and largest difference beyond the tolerance."""
    drt, dat = default_tolerance(x.dtype)
    rt = drt if rtol is None else rtol
    at = dat if atol is None else atol
    if x.is_sparse:
        x, y = x.to_dense(), y.to_dense()
    dtype = dtype_name(x.dtype)
    if x.dtype.is_floating_point and x.dtype.itemsize == 1:
        x, y = x.float(), y.float()  # assert_close compares 1-byte floats bitwise only
    exact = not (x.dtype.is_floating_point or x.dtype.is_complex) or (rt == 0 and at == 0)
    if exact:
        rt = at = 0.0
    try:
        torch.testing.assert_close(x, y, rtol=rt, atol=at, equal_nan=True, check_device=False)
        return None
    except AssertionError:
        pass
    if exact:
        bad = int((~torch.isclose(x, y, rtol=0, atol=0, equal_nan=True)).sum())
        return f" differs in {bad} of {x.numel()} elements ({dtype}, compared exactly)"
    nan_a, nan_b = torch.isnan(x), torch.isnan(y)
    if not torch.equal(nan_a, nan_b):
        return f": NaN in {la if nan_a.any() else lb} only"
    over = ~torch.isclose(x, y, rtol=rt, atol=at, equal_nan=True)
    wide = (lambda t: t.cdouble()) if x.is_complex() else (lambda t: t.double())
    worst = float((wide(x) - wide(y)).abs().masked_fill(nan_a, 0).max())
    return (f" differs by {worst:.3g} (max abs) > tolerance for {dtype} (rtol={rt:g}, atol={at:g}) "
            f"in {int(over.sum())} of {x.numel()} elements")
