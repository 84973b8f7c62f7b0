"""Kernel efficiency: the fraction of a device's datasheet peak that real kernels reach.

``Compute.kernels(gpu)`` (:mod:`simddp.models.compute`) costs every aten op with the tables
here instead of a roofline at 100 %: GEMMs by shape (the tile and wave quantization of NVIDIA's
"Matrix Multiplication Background" guide, on a large-GEMM plateau), fused attention by sequence
length, head dimension, direction and causality (the FlashAttention-2/-3 papers' measured
curves), memory-bound ops at achieved — not peak — bandwidth, a launch cost per kernel and a
host cost per op, tensor-core clocks under a power cap, Float8 GEMMs, and torch.compile's fusion
of pointwise chains. Every constant's source is in docs/costs.md ("Compute from kernels").

::

    >>> from simddp.models.kernels import Kernels
    >>> from simddp.models.devices import gpu_spec
    >>> k = Kernels(gpu_spec("h100"))
    >>> round(k.gemm_efficiency(8192, 8192, 8192), 3)  # the 0.75 plateau × 2,048 tiles in 16 waves
    0.727
    >>> k.gemm_efficiency(64, 64, 64) < 0.05               # a tiny one: one tile on 132 SMs
    True

Everything here is a pure function of shapes, dtypes and scalars (the simulator memoises op
costs by those), and costs microseconds at most per call.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .devices import DevicePreset

__all__ = ["Kernels", "op_kind", "moves_no_data", "ATTENTION_CURVES", "POWER_EXPONENT",
           "COMPILE_POINTWISE_TRAFFIC", "FLOAT8_CAST_BYTES"]

_aten = torch.ops.aten

# ---- constants (each with its source in docs/costs.md) -------------------------------------------

# cuBLAS's tile shapes (M × N of one thread block's output tile) and each one's efficiency
# relative to the largest: NVIDIA's "Matrix Multiplication Background" guide (§2.3) lists
# 256×128 as the most efficient and smaller tiles as less efficient (less data reuse); the
# relative factors are this project's conservative assumption (the guide gives no table).
GEMM_TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.00), (128, 128, 0.90), (128, 64, 0.80), (64, 64, 0.65))

# Power cap: tensor-core throughput ∝ (power limit / rated TDP) ** POWER_EXPONENT below the
# rated TDP. From NVIDIA's H100 datasheet: the same GH100 die (132 SMs) is rated 989 dense
# BF16 TFLOP/s at 700 W (SXM) and 835 at 350-400 W (NVL): ln(835/989) / ln(400/700) = 0.30
# (0.25 at 350 W; dynamic power ∝ f·V² with V ∝ f gives the cube-root law, 0.33).
POWER_EXPONENT = 0.30

# torch.compile: a fused pointwise chain reads its inputs and writes its outputs once. Counting
# the chains of a Llama block (RMSNorm: 6 ops, 12 tensor passes eager vs 2 fused; SwiGLU's
# silu·mul: 5 vs 3; RoPE: ~8 ops, ~20 passes vs 6) leaves about a third of the eager traffic
# and one launch per chain of ~3 ops: both are multiplied by this factor.
COMPILE_POINTWISE_TRAFFIC = 1 / 3

# Float8 (torchao's dynamic scaling): each GEMM operand in bf16 is read for its amax, read again
# and written as fp8: 2 + 2 + 1 bytes per element eager; compiled, the amax fuses into the
# producer and the cast reads 2 and writes 1.
FLOAT8_CAST_BYTES = {False: 5, True: 3}

# Attention throughput, TFLOP/s on an H100 80GB SXM5 at BF16, head dim 128, by sequence length
# 512 … 16k: Shah et al., "FlashAttention-3" (arXiv 2407.08608), Figures 5 and 6. FLOPs count
# a causal mask's skipped half as not done (the papers' convention, and torch's formula halved).
_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
_H100_PEAK = 989.0
ATTENTION_CURVES: dict[str, dict[tuple[str, bool], tuple[float, ...]]] = {
    "fa2": {
        ("fwd", False): (309, 350, 362, 368, 370, 370),
        ("fwd", True): (191, 260, 298, 319, 333, 335),
        ("bwd", False): (214, 260, 291, 310, 318, 322),
    },
    "cudnn": {
        ("fwd", False): (497, 574, 617, 609, 600, 595),
        ("fwd", True): (315, 410, 484, 518, 529, 539),
        ("bwd", False): (305, 408, 465, 499, 518, 516),
    },
}
# The same paper's FlashAttention-2 forward (non-causal) at head dims 64 and 256: how the
# throughput changes with the head dimension (applied as a ratio to the head-dim-128 curves).
_FA2_HEAD_DIM = {64: (282, 306, 318, 321, 322, 324), 128: (309, 350, 362, 368, 370, 370),
                 256: (208, 251, 278, 293, 297, 298)}
# FlashAttention-2 on an A100 reaches 50-73 % of peak forward (Dao, arXiv 2307.08691, abstract)
# where on an H100 it reaches 370 of 989 (37 %): on Ampere its curves are scaled by 0.73 / 0.374.
AMPERE_FA2_SCALE = 0.73 / (370 / _H100_PEAK)

_GEMM_PACKETS = {_aten.mm: "mm", _aten.addmm: "addmm", _aten.bmm: "bmm",
                 _aten.baddbmm: "baddbmm"}
_ATTENTION_PACKETS: dict[Any, tuple[bool, str]] = {}  # packet -> (backward, kernel)
for _name, _bwd, _kernel in (
        ("_scaled_dot_product_flash_attention_for_cpu", False, "flash"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", True, "flash"),
        ("_scaled_dot_product_flash_attention", False, "flash"),
        ("_scaled_dot_product_flash_attention_backward", True, "flash"),
        ("_scaled_dot_product_efficient_attention", False, "flash"),
        ("_scaled_dot_product_efficient_attention_backward", True, "flash"),
        ("_scaled_dot_product_cudnn_attention", False, "cudnn"),
        ("_scaled_dot_product_cudnn_attention_backward", True, "cudnn")):
    if hasattr(_aten, _name):
        _ATTENTION_PACKETS[getattr(_aten, _name)] = (_bwd, _kernel)
_REDUCTION_TAG = getattr(torch.Tag, "reduction", None)


# Ops that move no tensor data although func.is_view is False: aliasing reshapes, allocations
# without initialisation, and metadata queries (whose tensor inputs are only looked at).
_NO_DATA_PACKETS = frozenset(
    getattr(_aten, name) for name in (
        "_unsafe_view", "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided",
        "new_empty", "new_empty_strided", "resize_", "set_", "size", "sym_size", "stride",
        "sym_stride", "storage_offset", "sym_storage_offset", "numel", "sym_numel", "dim",
        "is_contiguous", "sym_is_contiguous", "is_strides_like_format",
        "is_non_overlapping_and_dense", "is_same_size")
    if hasattr(_aten, name)) | {torch.ops.prim.device, torch.ops.prim.layout}
# funcol's autograd wrapper of a collective's output (DTensor: tensor parallelism) aliases the
# tensor for autograd and reads nothing the collective is still writing; it is registered from
# Python when torch.distributed._functional_collectives is imported, so it goes by name
_NO_DATA_NAMES = frozenset({"_c10d_functional::_wrap_tensor_autograd"})


def moves_no_data(func: Any) -> bool:
    """Whether aten op ``func`` moves no tensor data (a view, an allocation, a metadata query)."""
    packet = getattr(func, "_overloadpacket", None)
    return bool(getattr(func, "is_view", False)) or packet in _NO_DATA_PACKETS or \
        getattr(packet, "_qualified_op_name", None) in _NO_DATA_NAMES


def op_kind(func: Any) -> str:
    """The kernel family of an aten op: "gemm", "attention", "pointwise" (elementwise and the
    reductions torch.compile fuses with them), "view" (no data moved), or "other" (copies,
    optimizer foreach ops, embeddings, ...)."""
    packet = getattr(func, "_overloadpacket", None)
    if packet in _GEMM_PACKETS:
        return "gemm"
    if packet in _ATTENTION_PACKETS:
        return "attention"
    if moves_no_data(func):
        return "view"
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise in tags or (_REDUCTION_TAG is not None and _REDUCTION_TAG in tags) \
            or packet is _aten._to_copy:
        return "pointwise"
    return "other"


def _interp_log2(x: float, xs: tuple[int, ...], ys: tuple[float, ...]) -> float:
    """Piecewise-linear in log2(x) through (xs, ys), flat beyond the ends."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x)
    lx, x0, x1 = math.log2(x), math.log2(xs[i - 1]), math.log2(xs[i])
    return float(ys[i - 1] + (ys[i] - ys[i - 1]) * (lx - x0) / (x1 - x0))


def _dims(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


class Kernels:
    """Per-op costs from kernel efficiencies on ``device`` (a
    :class:`~simddp.models.devices.DevicePreset`); ``compile``: torch.compile fuses pointwise
    chains; ``float8``: GEMMs run as Float8 (torchao) on the FP8 tensor cores; ``attention``:
    the fused-attention kernel ("fa2", PyTorch's flash backend, default; "cudnn"; the op's own
    name decides where it says cudnn); ``efficiency``: "kernels" (this model) or "peak" (every
    fraction 1: the roofline at 100 %, for studies)."""

    def __init__(self, device: DevicePreset, *, compile: bool = False, float8: bool = False,
                 attention: str | None = None, efficiency: str = "kernels") -> None:
        if efficiency not in ("kernels", "peak"):
            raise ValueError(f"efficiency must be 'kernels' (measured kernel behaviour) or "
                             f"'peak' (datasheet at 100 %), got {efficiency!r}")
        if attention not in (None, "fa2", "cudnn"):
            raise ValueError(f"attention must be 'fa2' or 'cudnn', got {attention!r}")
        if float8 and not device.fp8_tflops:
            raise ValueError(f"--float8: {device.name} has no FP8 tensor cores (its preset has "
                             f"no fp8-TFLOPs); Float8 training needs Hopper, Ada, Blackwell or "
                             f"MI300-class GPUs")
        self.device = device
        self.compile, self.float8 = bool(compile), bool(float8)
        self.attention = attention or "fa2"
        self.peak = efficiency == "peak"
        self.clock = 1.0 if device.tdp_W is None or device.rated_tdp_W is None else \
            min(1.0, (device.tdp_W / device.rated_tdp_W) ** POWER_EXPONENT)
        self.gemm_plateau = 1.0 if self.peak else (device.gemm_fraction or 1.0)
        self.fp8_plateau = 1.0 if self.peak else (device.fp8_gemm_fraction or
                                                  device.gemm_fraction or 1.0)
        self.bytes_per_s = device.mem_bandwidth_GBps * 1e9 * (
            1.0 if self.peak else (device.hbm_fraction or 1.0))
        self.launch_s = 0.0 if self.peak else device.launch_us * 1e-6
        self.host_s = device.op_overhead_us * 1e-6
        self.view_s = 0.0 if self.compile else device.view_us * 1e-6
        self.arch = device.arch

    # ---- efficiencies --------------------------------------------------------------------------

    def gemm_efficiency(self, m: int, n: int, k: int, batch: int = 1,
                        fp8: bool = False) -> float:
        """Fraction of the dense tensor-core peak a cuBLAS GEMM of (batch ×) M×K · K×N reaches:
        the plateau × the best tile's (relative efficiency × tile quantization × wave
        quantization) over the device's SMs. ``k`` enters through the memory side (the roofline
        in :meth:`op_time`), not here."""
        plateau = self.fp8_plateau if fp8 else self.gemm_plateau
        sms = self.device.sms
        if self.peak or not sms or m <= 0 or n <= 0:
            return plateau
        best = 0.0
        for tm, tn, rel in GEMM_TILES:
            rows, cols = -(-m // tm), -(-n // tn)
            tiles = rows * cols * batch
            waves = -(-tiles // sms)
            # useful outputs over the outputs the launched waves could have computed
            eff = rel * (m * n * batch) / (waves * sms * tm * tn)
            best = max(best, eff)
        return plateau * min(1.0, best)

    def attention_efficiency(self, seq: int, head_dim: int, causal: bool, backward: bool,
                             kernel: str = "flash") -> float:
        """Fraction of the dense BF16 peak a fused attention kernel reaches at key length
        ``seq`` (FLOPs counted with a causal mask's skipped half not done)."""
        if self.peak:
            return 1.0
        name = "cudnn" if kernel == "cudnn" or self.attention == "cudnn" else "fa2"
        if name == "cudnn" and self.arch != "hopper":
            name = "fa2"  # the cuDNN figures are Hopper's own kernels
        curves = ATTENTION_CURVES[name]
        direction = "bwd" if backward else "fwd"
        if (direction, causal) in curves:
            tflops = _interp_log2(seq, _SEQ, curves[(direction, causal)])
        else:  # causal backward: not in the paper; the forward's causal/non-causal ratio
            ratio = _interp_log2(seq, _SEQ, curves[("fwd", True)]) / \
                _interp_log2(seq, _SEQ, curves[("fwd", False)])
            tflops = _interp_log2(seq, _SEQ, curves[(direction, False)]) * ratio
        hd = min(256, max(64, head_dim))
        at = {d: _interp_log2(seq, _SEQ, c) for d, c in _FA2_HEAD_DIM.items()}
        dims = (64, 128, 256)
        tflops *= _interp_log2(hd, dims, tuple(at[d] for d in dims)) / at[128]
        fraction = tflops / _H100_PEAK
        if name == "fa2" and self.arch == "ampere":
            fraction *= AMPERE_FA2_SCALE
        return min(1.0, fraction)

    # ---- per-op time ---------------------------------------------------------------------------

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any,
                kind: str, flops: float, nbytes: int, dtype: Any, peak_flops: float) -> float:
        """Seconds for one op of family ``kind`` (:func:`op_kind`) with ``flops`` (torch's
        formula), ``nbytes`` moved and ``dtype``; ``peak_flops``: the dense peak for it."""
        if kind == "view":
            return self.view_s
        memory_s = nbytes / self.bytes_per_s
        compute_s = 0.0
        if kind == "gemm" and flops:
            compute_s, extra_bytes = self._gemm_seconds(func, args, flops, dtype, peak_flops)
            memory_s += extra_bytes / self.bytes_per_s
        elif kind == "attention" and flops:
            compute_s = self._attention_seconds(func, args, kwargs, flops, peak_flops)
        elif flops:
            compute_s = flops / (peak_flops * self.clock)
        device_s = max(compute_s, memory_s)
        if self.arch == "cpu":  # no device queue to run ahead into: dispatch, then the work
            return device_s + self.host_s
        seconds = max(device_s + self.launch_s, self.host_s)
        if kind == "pointwise" and self.compile:  # a third of the traffic and launches remain
            return seconds * COMPILE_POINTWISE_TRAFFIC
        return seconds

    def _gemm_seconds(self, func: Any, args: tuple, flops: float, dtype: Any,
                      peak_flops: float) -> tuple[float, float]:
        packet = _GEMM_PACKETS[func._overloadpacket]
        a, b = (args[0], args[1]) if packet in ("mm", "bmm") else (args[1], args[2])
        da, db = _dims(a), _dims(b)
        batch = da[0] if len(da) == 3 else 1
        m, k, n = da[-2], da[-1], db[-1]
        fp8 = self.float8 and dtype in (torch.bfloat16, torch.float16) and \
            m % 16 == 0 and n % 16 == 0 and k % 16 == 0 and packet in ("mm", "addmm")
        if fp8:
            rate = self.device.fp8_tflops * 1e12
            extra = FLOAT8_CAST_BYTES[self.compile] * (m * k + k * n)
        else:
            rate, extra = peak_flops, 0
        eff = self.gemm_efficiency(m, n, k, batch, fp8=fp8)
        return flops / (rate * eff * self.clock), extra

    def _attention_seconds(self, func: Any, args: tuple, kwargs: Mapping[str, Any],
                           flops: float, peak_flops: float) -> float:
        backward, kernel = _ATTENTION_PACKETS[func._overloadpacket]
        q = args[1] if backward else args[0]
        k = args[2] if backward else args[1]
        causal = _is_causal(func, args, kwargs)
        seq, head_dim = int(k.shape[-2]), int(q.shape[-1])
        eff = self.attention_efficiency(seq, head_dim, causal, backward, kernel)
        return flops / (peak_flops * eff * self.clock)


_CAUSAL_INDEX: dict[Any, int] = {}


def _is_causal(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    i = _CAUSAL_INDEX.get(func)
    if i is None:
        names = [a.name for a in func._schema.arguments]
        i = _CAUSAL_INDEX[func] = names.index("is_causal") if "is_causal" in names else -1
    return bool(args[i]) if 0 <= i < len(args) else False


def attention_flops(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> float:
    """FLOPs of a fused attention op (torch's formulas), a causal mask's half not counted."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    backward, _ = _ATTENTION_PACKETS[func._overloadpacket]
    if backward:
        g, q, k, v = args[0], args[1], args[2], args[3]
        flops = sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape)
    else:
        q, k, v = args[0], args[1], args[2]
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
    return flops / 2 if _is_causal(func, args, kwargs) else flops
