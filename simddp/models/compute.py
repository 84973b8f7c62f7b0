"""Compute cost models: how long one aten op takes on a rank, in seconds.

A per-rank ``TorchDispatchMode`` calls ``model.op_time(func, args, kwargs, out)`` for every aten
op it sees (after autograd, after composite ops such as ``linear`` were decomposed into ``t`` +
``addmm``). Three models::

    >>> import torch
    >>> a = torch.ones(256, 256)
    >>> mm = torch.ops.aten.mm.default
    >>> Compute.constant(1e-5).op_time(mm, (a, a), {}, a @ a)
    1e-05
    >>> h100 = Compute.roofline("h100")             # max(FLOPs/peak, bytes/bandwidth) + overhead
    >>> h100.op_time(mm, (a, a), {}, a @ a) > 0
    True
    >>> Compute.from_profile({"aten::mm": 2e-4}).op_time(mm, (a, a), {}, a @ a)
    0.0002

``op_time`` runs for every op on every rank, so each model caches what it can per ``func``.
Thread-safe for concurrent readers (caches only ever gain entries).
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.flop_counter import (flop_registry, sdpa_backward_flop_count, sdpa_flop_count,
                                      shape_wrapper)

from fakepg.arguments import number

from .kernels import Kernels, attention_flops, moves_no_data, op_kind

__all__ = ["Compute", "DevicePreset", "DEVICES", "RooflineCompute", "ConstantCompute",
           "ProfileCompute", "ScaledCompute", "gpu_spec", "GPU_FIELDS", "op_kind"]

_Tensor = torch.Tensor
_aten = torch.ops.aten


@dataclass(frozen=True)
class DevicePreset:
    """Datasheet figures of one device. TFLOP/s are dense (no sparsity); fp16 means fp16/bf16 on
    tensor cores; fp32 is plain fp32 (PyTorch does not use TF32 for matmul by default).

    The fields after ``memory_GB`` describe how real kernels behave on it (``Compute.kernels``,
    :mod:`simddp.models.kernels`; sources in docs/costs.md): ``fp8_tflops`` (dense FP8 tensor
    peak; None: no FP8), ``sms`` (SMs or CUs: GEMM wave quantization), ``tdp_W`` (the power
    limit the card runs at) and ``rated_tdp_W`` (its datasheet TDP: a lower limit lowers
    tensor-core clocks), ``gemm_fraction`` / ``fp8_gemm_fraction`` (a large GEMM's fraction of
    peak), ``hbm_fraction`` (achieved fraction of the memory bandwidth), ``launch_us`` (device
    time a kernel launch adds), ``view_us`` (host time of an op that launches nothing),
    ``arch`` (which published attention curves apply) and ``memory_GiB`` (device memory as the
    driver reports it; ``memory_GB`` is the same in 10⁹ bytes)."""

    name: str
    fp32_tflops: float
    fp16_tflops: float
    fp64_tflops: float
    mem_bandwidth_GBps: float
    op_overhead_us: float
    tf32_tflops: float | None = None  # dense TF32 tensor-core peak; None: no TF32 (pre-Ampere)
    memory_GB: float | None = None  # device memory (GB = 1e9 bytes) for OOM verdicts; None: unknown
    fp8_tflops: float | None = None
    sms: int | None = None
    tdp_W: float | None = None
    rated_tdp_W: float | None = None
    gemm_fraction: float | None = None
    fp8_gemm_fraction: float | None = None
    hbm_fraction: float | None = None
    launch_us: float = 2.0
    view_us: float = 1.0
    arch: str | None = None
    memory_GiB: float | None = None

    def peak_tflops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.float16, torch.bfloat16):
            return self.fp16_tflops
        if dtype in (torch.float64, torch.complex128):
            return self.fp64_tflops
        if dtype in _FP8_DTYPES and self.fp8_tflops:
            return self.fp8_tflops
        return self.fp32_tflops  # fp32 and everything else (FLOP formulas exist for float ops)


_FP8_DTYPES = frozenset(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))
_GIB = 2 ** 30


def _gpu(name: str, *, fp32: float, bf16: float, fp64: float, tf32: float | None,
         fp8: float | None, hbm_GBps: float, memory_GiB: float, sms: int, tdp_W: float,
         arch: str, gemm: float, fp8_gemm: float | None, hbm: float) -> DevicePreset:
    """A GPU preset: datasheet figures, then its kernels' measured fractions (docs/costs.md)."""
    return DevicePreset(name, fp32_tflops=fp32, fp16_tflops=bf16, fp64_tflops=fp64,
                        mem_bandwidth_GBps=hbm_GBps, op_overhead_us=5.0, tf32_tflops=tf32,
                        memory_GB=memory_GiB * _GIB / 1e9, fp8_tflops=fp8, sms=sms,
                        tdp_W=tdp_W, rated_tdp_W=tdp_W, gemm_fraction=gemm,
                        fp8_gemm_fraction=fp8_gemm, hbm_fraction=hbm, arch=arch,
                        memory_GiB=memory_GiB)


# Kernel fractions shared by a family (docs/costs.md, "Compute from kernels"): a large BF16
# GEMM reaches 80 % of peak on Ampere (FlashAttention-2 paper: "GEMM ... up to 80-90 %"; the
# low end) and 75 % on Hopper (FlashAttention-3 paper: 75 % is its best Hopper tensor-core
# utilisation; no cuBLAS sweep was found); FP8 GEMMs 65 % (assumed, below BF16's); memory-bound
# kernels 90 % of HBM bandwidth (H100 SXM: 3,044 GB/s read, 3,172 GB/s write of 3,350).
_AMPERE = dict(arch="ampere", gemm=0.80, fp8_gemm=None, hbm=0.90)
_HOPPER = dict(arch="hopper", gemm=0.75, fp8_gemm=0.65, hbm=0.90)

DEVICES: dict[str, DevicePreset] = {
    # NVIDIA Tesla V100 datasheet (SXM2 32GB): FP32 15.7, FP16 tensor 125, FP64 7.8 TFLOP/s;
    # HBM2 900 GB/s; 80 SMs, 300 W.
    "v100": _gpu("v100", fp32=15.7, bf16=125.0, fp64=7.8, tf32=None, fp8=None, hbm_GBps=900.0,
                 memory_GiB=32.0, sms=80, tdp_W=300.0, arch="volta", gemm=0.80, fp8_gemm=None,
                 hbm=0.90),
    # NVIDIA A100 datasheet (SXM 80GB): FP32 19.5, BF16/FP16 tensor 312 dense, FP64 tensor 19.5
    # TFLOP/s; TF32 tensor 156 dense; HBM2e 2,039 GB/s; 108 SMs; 400 W; nvidia-smi: 81,920 MiB.
    "a100": _gpu("a100", fp32=19.5, bf16=312.0, fp64=19.5, tf32=156.0, fp8=None,
                 hbm_GBps=2039.0, memory_GiB=80.0, sms=108, tdp_W=400.0, **_AMPERE),
    # the same datasheet, SXM 40GB column: HBM2 1,555 GB/s; nvidia-smi: 40,960 MiB.
    "a100-40gb": _gpu("a100-40gb", fp32=19.5, bf16=312.0, fp64=19.5, tf32=156.0, fp8=None,
                      hbm_GBps=1555.0, memory_GiB=40.0, sms=108, tdp_W=400.0, **_AMPERE),
    # NVIDIA H100 datasheet (SXM5): FP32 67, BF16/FP16 tensor 989 dense (1,979 is with
    # sparsity), FP8 1,979 dense, FP64 tensor 67, TF32 tensor 494.5 dense TFLOP/s; HBM3
    # 3.35 TB/s; 132 SMs; 700 W; nvidia-smi on the 80 GB card: 81,559 MiB (79.6 GiB).
    "h100": _gpu("h100", fp32=67.0, bf16=989.0, fp64=67.0, tf32=494.5, fp8=1979.0,
                 hbm_GBps=3350.0, memory_GiB=81559 / 1024, sms=132, tdp_W=700.0, **_HOPPER),
    # the same datasheet, PCIe column: FP32 51, BF16 756 dense, FP8 1,513 dense, FP64 tensor
    # 51, TF32 378 dense; HBM2e 2.0 TB/s; 114 SMs; 350 W; 80 GB (81,559 MiB as the SXM card).
    "h100-pcie": _gpu("h100-pcie", fp32=51.0, bf16=756.0, fp64=51.0, tf32=378.0, fp8=1513.0,
                      hbm_GBps=2000.0, memory_GiB=81559 / 1024, sms=114, tdp_W=350.0,
                      **_HOPPER),
    # NVIDIA H200 datasheet (SXM): the H100 SXM's compute; HBM3e 141 GB, 4.8 TB/s; 700 W;
    # nvidia-smi: 143,771 MiB (140.4 GiB).
    "h200": _gpu("h200", fp32=67.0, bf16=989.0, fp64=67.0, tf32=494.5, fp8=1979.0,
                 hbm_GBps=4800.0, memory_GiB=143771 / 1024, sms=132, tdp_W=700.0, **_HOPPER),
    # NVIDIA HGX B200 / DGX B200 datasheets, 8-GPU totals ÷ 8: FP32 600/8 = 75, BF16/FP16 tensor
    # 36 PFLOP/s sparse → 2,250 dense, FP8 72 PFLOP/s sparse → 4,500 dense, TF32 tensor 18
    # PFLOP/s sparse → 1,125 dense, FP64 tensor 296/8 = 37 TFLOP/s; HBM3e 64 TB/s → 8,000 GB/s
    # per GPU; 148 SMs; 1,000 W; nvidia-smi: 183,359 MiB (179.1 GiB). Kernel fractions:
    # Hopper's (no Blackwell sweep found).
    "b200": _gpu("b200", fp32=75.0, bf16=2250.0, fp64=37.0, tf32=1125.0, fp8=4500.0,
                 hbm_GBps=8000.0, memory_GiB=183359 / 1024, sms=148, tdp_W=1000.0,
                 **{**_HOPPER, "arch": "blackwell"}),
    # AMD Instinct MI300X datasheet: FP16/BF16 matrix 1,307.4 dense, FP8 2,614.9 dense, FP32
    # matrix 163.4, FP64 matrix 163.4, TF32 653.7 TFLOP/s; 192 GB HBM3 (8 stacks of 24 GiB)
    # at 5.3 TB/s; 304 CUs; 750 W. Kernel fractions: Hopper's GEMM (no published MI300X sweep
    # found), 80 % of HBM (no published measurement found: conservative).
    "mi300x": _gpu("mi300x", fp32=163.4, bf16=1307.4, fp64=163.4, tf32=653.7, fp8=2614.9,
                   hbm_GBps=5300.0, memory_GiB=192.0, sms=304, tdp_W=750.0, arch="cdna3",
                   gemm=0.75, fp8_gemm=0.65, hbm=0.80),
    # NVIDIA L40S datasheet: FP32 91.6, BF16/FP16 tensor 362 dense (733 sparse), FP8 733 dense,
    # TF32 183 dense TFLOP/s, FP64 1.4; 48 GB GDDR6 at 864 GB/s; 142 SMs; 350 W. Measured reads
    # reach 84 % of its bandwidth.
    "l40s": _gpu("l40s", fp32=91.6, bf16=362.0, fp64=1.4, tf32=183.0, fp8=733.0,
                 hbm_GBps=864.0, memory_GiB=48.0, sms=142, tdp_W=350.0, arch="ada",
                 gemm=0.75, fp8_gemm=0.65, hbm=0.84),
    # A modest multi-core x86 host: ~0.1 TFLOP/s fp32 in a large GEMM, ~20 GB/s achieved
    # memory bandwidth, ~5 µs per eager op (PyTorch dispatcher). No fast fp16 on CPUs.
    # Order-of-magnitude only: calibrate from a profile (Compute.from_profile) for real use.
    "cpu": DevicePreset("cpu", fp32_tflops=0.1, fp16_tflops=0.1, fp64_tflops=0.05,
                        mem_bandwidth_GBps=20.0, op_overhead_us=5.0, launch_us=0.0,
                        view_us=5.0, arch="cpu"),
}
# other names users type for the same cards
ALIASES: dict[str, str] = {"h100-sxm": "h100", "h100-80gb": "h100", "a100-80gb": "a100",
                           "a100-sxm": "a100", "h200-sxm": "h200"}

# gpu_spec's fields: name → (DevicePreset field, what it means)
GPU_FIELDS: dict[str, tuple[str, str]] = {
    "memory-GiB": ("memory_GiB", "device memory in GiB (2^30 bytes)"),
    "hbm-TBps": ("mem_bandwidth_GBps", "memory bandwidth in TB/s (10^12 bytes/s)"),
    "tdp-W": ("tdp_W", "the power limit the card runs at, in W (below the rated TDP: lower "
              "tensor-core clocks)"),
    "bf16-TFLOPs": ("fp16_tflops", "dense BF16/FP16 tensor peak"),
    "fp16-TFLOPs": ("fp16_tflops", "the same as bf16-TFLOPs"),
    "fp8-TFLOPs": ("fp8_tflops", "dense FP8 tensor peak"),
    "tf32-TFLOPs": ("tf32_tflops", "dense TF32 tensor peak"),
    "fp32-TFLOPs": ("fp32_tflops", "plain FP32 peak"),
    "fp64-TFLOPs": ("fp64_tflops", "FP64 peak"),
    "sms": ("sms", "streaming multiprocessors (or CUs)"),
    "overhead-us": ("op_overhead_us", "host time per eager op, in µs"),
}


def gpu_spec(text: str | DevicePreset) -> DevicePreset:
    """The device ``text`` names: ``PRESET[,field=value...]``, e.g.
    ``"h100,memory-GiB=96,hbm-TBps=2.4,tdp-W=500"`` (fields: :data:`GPU_FIELDS`,
    case-insensitive). A :class:`DevicePreset` is returned as is.

    >>> gpu_spec("h100,hbm-TBps=2.4,tdp-W=500").mem_bandwidth_GBps
    2400.0
    >>> gpu_spec("h100,memory-GiB=96").memory_GiB
    96.0
    """
    if isinstance(text, DevicePreset):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--gpu: give a preset ({', '.join(DEVICES)}) optionally followed by "
                         f",field=value overrides, got {text!r}")
    head, *fields = [p.strip() for p in text.split(",")]
    key = ALIASES.get(head.lower(), head.lower())
    if key not in DEVICES:
        raise ValueError(f"--gpu {text}: unknown preset {head!r}; presets: "
                         f"{', '.join([*DEVICES, *ALIASES])}")
    preset = DEVICES[key]
    lower = {k.lower(): k for k in GPU_FIELDS}
    changes: dict[str, Any] = {}
    for item in fields:
        name, eq, value = item.partition("=")
        canonical = lower.get(name.strip().lower())
        if not eq or canonical is None:
            accepted = "; ".join(f"{k} ({what})" for k, (_, what) in GPU_FIELDS.items())
            raise ValueError(f"--gpu {text}: {item!r} is not field=value with a known field; "
                             f"accepted fields: {accepted}")
        try:
            x = float(value)
        except ValueError:
            raise ValueError(f"--gpu {text}: {canonical}={value!r} is not a number") from None
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"--gpu {text}: {canonical} must be a positive number, got {value}")
        attr = GPU_FIELDS[canonical][0]
        if attr == "mem_bandwidth_GBps":
            x *= 1000.0
        elif attr == "sms":
            x = int(x)
        elif attr == "memory_GiB":
            changes["memory_GB"] = x * _GIB / 1e9
        changes[attr] = x
    if not changes:
        return preset
    return replace(preset, name=text.strip(), **changes)


_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: 0).__code__


def _shapes(x: Any) -> Any:
    if isinstance(x, _Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x) if type(x) in (list, tuple) else x
    return x


def _causal(flops: int, causal: bool) -> float:
    return flops / 2 if causal else flops  # a fused causal kernel skips the masked half


# CPU's fused attention kernels (what F.scaled_dot_product_attention runs on CPU, and on the
# meta device in a capture: simddp.cosim.meta), costed as torch's formulas cost the GPU's
_EXTRA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda args, kwargs, out: _causal(sdpa_flop_count(
            args[0].shape, args[1].shape, args[2].shape),
            bool(args[4] if len(args) > 4 else kwargs.get("is_causal", False))),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda args, kwargs, out: _causal(sdpa_backward_flop_count(
            args[0].shape, args[1].shape, args[2].shape, args[3].shape),
            bool(args[7] if len(args) > 7 else kwargs.get("is_causal", False))),
}


def _flop_formula(func: Any) -> Any:
    """FlopCounterMode's formula for func as f(args, kwargs, out) -> FLOPs, or None.

    Most formulas are wrapped by flop_counter.shape_wrapper, whose pytree walk costs ~10 µs a
    call; we call the formula underneath with shapes we extract ourselves (~1 µs).
    """
    packet = getattr(func, "_overloadpacket", None)
    extra = _EXTRA_FORMULAS.get(packet)
    if extra is not None:
        return extra
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    raw = getattr(formula, "__wrapped__", None)
    if raw is not None and getattr(formula, "__code__", None) is _SHAPE_WRAPPER_CODE:
        return lambda args, kwargs, out: raw(
            *[_shapes(a) for a in args], out_shape=_shapes(out),
            **{k: _shapes(v) for k, v in kwargs.items()})
    return lambda args, kwargs, out: formula(*args, **kwargs, out_val=out)


def _op_name(func: Any) -> str:
    """'aten::mm' for aten.mm.default: the name torch.profiler records."""
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def _nbytes(t: _Tensor) -> int:
    """Bytes a tensor occupies: for sparse layouts, what it stores (values and indices)."""
    if t.layout is torch.strided:
        return t.nbytes
    if t.layout is torch.sparse_coo:
        return t._values().nbytes + t._indices().nbytes
    return t.values().nbytes


def _bytes_and_dtype(args: Any, kwargs: Mapping[str, Any], out: Any) -> tuple[int, Any]:
    """Sum of bytes of tensor inputs (one level of lists) and outputs; dtype of the first."""
    total, dtype = 0, None
    for a in args:
        if isinstance(a, _Tensor):
            total += _nbytes(a)
            if dtype is None:
                dtype = a.dtype
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, _Tensor):
                    total += _nbytes(x)
                    if dtype is None:
                        dtype = x.dtype
    for k, a in kwargs.items():
        if isinstance(a, _Tensor) and k != "out":  # out= is counted once, as the output
            total += _nbytes(a)
            if dtype is None:
                dtype = a.dtype
    if isinstance(out, _Tensor):
        total += _nbytes(out)
        if dtype is None:
            dtype = out.dtype
    elif isinstance(out, (list, tuple)):
        for x in out:
            if isinstance(x, _Tensor):
                total += _nbytes(x)
    return total, dtype


class Compute:
    """A compute cost model. Build one with :meth:`roofline`, :meth:`constant` or
    :meth:`from_profile`; the simulator calls :meth:`op_time` for every aten op."""

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        """Seconds that op ``func`` (an ``torch._ops.OpOverload``) takes on these inputs/output."""
        raise NotImplementedError

    @staticmethod
    def roofline(device: str | DevicePreset = "cpu", *, peak_tflops: float | None = None,
                 mem_bandwidth_GBps: float | None = None, efficiency: float = 1.0,
                 op_overhead_us: float | None = None) -> RooflineCompute:
        """time = max(FLOPs / (peak·efficiency), bytes / (bandwidth·efficiency)) + overhead.

        FLOPs come from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
        attention; every other op counts 0 FLOPs), bytes are the nbytes of all tensor inputs and
        outputs, the peak is picked by the dtype of the op's first tensor. Views and other ops
        that move no data cost only the overhead: they still go through the dispatcher.
        ``device`` is "cpu", "v100", "a100", "h100", "b200" or a :class:`DevicePreset`; ``peak_tflops``
        (all dtypes), ``mem_bandwidth_GBps`` and ``op_overhead_us`` override the preset.
        """
        return RooflineCompute(device, peak_tflops=peak_tflops,
                               mem_bandwidth_GBps=mem_bandwidth_GBps, efficiency=efficiency,
                               op_overhead_us=op_overhead_us)

    @staticmethod
    def kernels(device: str | DevicePreset = "a100", *, compile: bool = False,
                float8: bool = False, attention: str | None = None,
                efficiency: str = "kernels", peak_tflops: float | None = None,
                mem_bandwidth_GBps: float | None = None,
                op_overhead_us: float | None = None) -> RooflineCompute:
        """The default compute model: each op at the fraction of peak that real kernels reach
        on ``device`` (:mod:`simddp.models.kernels`): GEMMs by shape, fused attention by
        sequence length and head dimension, memory-bound ops at achieved bandwidth, a launch
        cost per kernel and a host cost per op (the larger of device and host time), tensor
        clocks under the card's power limit.

        ``device``: a preset name or a :func:`gpu_spec` string (``"h100,tdp-W=500"``) or a
        :class:`DevicePreset`. ``compile``: torch.compile fuses pointwise chains (a third of
        their traffic and launches remain); ``float8``: GEMMs on the FP8 tensor cores with
        torchao's casts; ``attention``: "fa2" (PyTorch's flash backend, default) or "cudnn";
        ``efficiency="peak"``: every fraction 1 and no launch cost (a study's datasheet bound).
        ``peak_tflops``, ``mem_bandwidth_GBps`` and ``op_overhead_us`` override the preset.

        >>> Compute.kernels("h100,tdp-W=500", compile=True)
        Compute.kernels('h100,tdp-W=500', compile=True)
        """
        return RooflineCompute(gpu_spec(device), peak_tflops=peak_tflops,
                               mem_bandwidth_GBps=mem_bandwidth_GBps,
                               op_overhead_us=op_overhead_us,
                               kernels=dict(compile=compile, float8=float8,
                                            attention=attention, efficiency=efficiency))

    @staticmethod
    def constant(seconds_per_op: float) -> ConstantCompute:
        """Every op, views included, costs ``seconds_per_op``: the simplest model, for tests."""
        return ConstantCompute(seconds_per_op)

    @staticmethod
    def from_profile(profile: Any, *, fallback: Compute | None = None) -> ProfileCompute:
        """Measured mean time per call of each op, from a real run.

        ``profile`` is a finished ``torch.profiler.profile``, its ``key_averages()``, or a mapping
        {"aten::mm": seconds per call}. Ops missing from it cost what ``fallback`` says
        (default ``Compute.roofline("cpu")``). See :class:`ProfileCompute` for which time is used.
        """
        return ProfileCompute(profile, fallback=fallback)

    def scaled(self, factor: float) -> ScaledCompute:
        """This model with every op's time multiplied by ``factor``: how a model is calibrated
        to one measured step time (``simddp whatif --step-time``).

        >>> Compute.constant(1e-5).scaled(2.0).op_time(None, (), {}, None)
        2e-05
        """
        return ScaledCompute(self, factor)


class ConstantCompute(Compute):
    def __init__(self, seconds_per_op: float) -> None:
        self.seconds_per_op = number("seconds_per_op", seconds_per_op, minimum=0,
                                    hint="give the cost of one op in seconds, e.g. 1e-5")

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        return self.seconds_per_op

    def __repr__(self) -> str:
        return f"Compute.constant({self.seconds_per_op!r})"


class ScaledCompute(Compute):
    """``inner``'s op times × ``factor`` (see :meth:`Compute.scaled`)."""

    def __init__(self, inner: Any, factor: float) -> None:
        self.inner = inner
        self.factor = number("factor", factor, positive=True,
                             hint="give the ratio of wanted to modelled time, e.g. 1.5")

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        return self.factor * self.inner.op_time(func, args, kwargs, out)

    def __repr__(self) -> str:
        return f"{self.inner!r}.scaled({self.factor!r})"


class RooflineCompute(Compute):
    """:meth:`Compute.roofline` (``kernels`` None) and :meth:`Compute.kernels` (``kernels``: the
    :class:`~simddp.models.kernels.Kernels` options). One class, so the simulator's per-op memo
    (costs keyed by shapes, dtypes and scalars) serves both."""

    def __init__(self, device: str | DevicePreset = "cpu", *, peak_tflops: float | None = None,
                 mem_bandwidth_GBps: float | None = None, efficiency: float = 1.0,
                 op_overhead_us: float | None = None,
                 kernels: Mapping[str, Any] | None = None) -> None:
        if isinstance(device, str):
            try:
                device = DEVICES[ALIASES.get(device.lower(), device.lower())]
            except KeyError:
                raise ValueError(f"unknown device preset {device!r}; known: "
                                 f"{', '.join(DEVICES)}, or pass a DevicePreset(...)") from None
        self.device = device
        self.peak_tflops = None if peak_tflops is None else number(
            "peak_tflops", peak_tflops, positive=True,
            hint="give the device's peak in TFLOP/s, e.g. 19.5")
        self.mem_bandwidth_GBps = number(
            "mem_bandwidth_GBps",
            device.mem_bandwidth_GBps if mem_bandwidth_GBps is None else mem_bandwidth_GBps,
            positive=True, hint="give the memory bandwidth in GB/s, e.g. 2039")
        self.efficiency = number("efficiency", efficiency, positive=True,
                                 hint="give the achieved fraction of peak, in (0, 1]")
        if self.efficiency > 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}: it is the "
                             "fraction of peak FLOP/s and bandwidth that ops achieve")
        self.op_overhead_us = number(
            "op_overhead_us", device.op_overhead_us if op_overhead_us is None else op_overhead_us,
            minimum=0, hint="give the fixed cost per op in microseconds, e.g. 5")
        self._overhead_s = self.op_overhead_us * 1e-6
        self._s_per_byte = 1.0 / (self.mem_bandwidth_GBps * 1e9 * self.efficiency)
        self._flops_per_s: dict[Any, float] = {}
        self._ops: dict[Any, tuple[bool, Any]] = {}  # func -> (moves no data, FLOP formula)
        self.kernel_options = dict(kernels) if kernels is not None else None
        self._kernels: Kernels | None = None
        if kernels is not None:
            if self.efficiency != 1.0:
                raise ValueError("Compute.kernels takes efficiency='kernels' or 'peak', not a "
                                 "number: the fractions come from the kernel tables")
            k_device = device
            overrides = {}
            if mem_bandwidth_GBps is not None:
                overrides["mem_bandwidth_GBps"] = self.mem_bandwidth_GBps
            if op_overhead_us is not None:
                overrides["op_overhead_us"] = self.op_overhead_us
            if overrides:
                k_device = replace(device, **overrides)
            self._kernels = Kernels(k_device, **kernels)
            self._kops: dict[Any, tuple[str, Any]] = {}  # func -> (kind, FLOP formula)

    def flops_per_second(self, dtype: torch.dtype | None) -> float:
        rate = self._flops_per_s.get(dtype)
        if rate is None:
            tflops = self.peak_tflops if self.peak_tflops is not None else \
                self.device.peak_tflops(dtype if dtype is not None else torch.float32)
            rate = self._flops_per_s[dtype] = tflops * 1e12 * self.efficiency
        return rate

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        if self._kernels is not None:
            return self._kernel_time(func, args, kwargs, out)
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = (
                moves_no_data(func), _flop_formula(func))
        no_data, formula = info
        if no_data:
            return self._overhead_s
        nbytes, dtype = _bytes_and_dtype(args, kwargs, out)
        seconds = nbytes * self._s_per_byte
        if formula is not None:
            try:
                flops = formula(args, kwargs, out)
            except Exception:  # a formula that cannot read these args: count no FLOPs
                flops = 0
            seconds = max(seconds, flops / self.flops_per_second(dtype))
        return seconds + self._overhead_s

    def _kernel_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        info = self._kops.get(func)
        if info is None:
            kind = op_kind(func)
            formula = (lambda a, kw, o, f=func: attention_flops(f, a, kw)) \
                if kind == "attention" else _flop_formula(func)
            info = self._kops[func] = (kind, formula)
        kind, formula = info
        if kind == "view":
            return self._kernels.view_s
        nbytes, dtype = _bytes_and_dtype(args, kwargs, out)
        flops = 0
        if formula is not None:
            try:
                flops = formula(args, kwargs, out)
            except Exception:  # a formula that cannot read these args: count no FLOPs
                flops = 0
        peak = self.flops_per_second(dtype)
        return self._kernels.op_time(func, args, kwargs, out, kind, flops, nbytes, dtype, peak)

    def __repr__(self) -> str:
        if self._kernels is not None:
            name = self.device.name
            dev = repr(name) if self.device is DEVICES.get(name) or "," in name \
                else repr(self.device)
            opts = "".join(f", {k}={v!r}" for k, v in self.kernel_options.items()
                           if v != {"compile": False, "float8": False, "attention": None,
                                    "efficiency": "kernels"}[k])
            for k in ("peak_tflops", "mem_bandwidth_GBps", "op_overhead_us"):
                if k == "peak_tflops" and self.peak_tflops is not None:
                    opts += f", peak_tflops={self.peak_tflops!r}"
                elif k == "mem_bandwidth_GBps" and \
                        self.mem_bandwidth_GBps != self.device.mem_bandwidth_GBps:
                    opts += f", mem_bandwidth_GBps={self.mem_bandwidth_GBps!r}"
                elif k == "op_overhead_us" and self.op_overhead_us != self.device.op_overhead_us:
                    opts += f", op_overhead_us={self.op_overhead_us!r}"
            return f"Compute.kernels({dev}{opts})"
        dev = repr(self.device.name) if self.device is DEVICES.get(self.device.name) \
            else repr(self.device)
        peak = "" if self.peak_tflops is None else f", peak_tflops={self.peak_tflops!r}"
        return (f"Compute.roofline({dev}{peak}, mem_bandwidth_GBps={self.mem_bandwidth_GBps!r}, "
                f"efficiency={self.efficiency!r}, op_overhead_us={self.op_overhead_us!r})")


class ProfileCompute(Compute):
    """Per-op mean time per call measured by torch.profiler, keyed by op name ("aten::mm").

    The time of an op is its *inclusive* time (``device_time_total`` where the profile has
    device time for it, else ``cpu_time_total``) divided by its call count — not its self time:
    the dispatch mode sees only top-level ops (``aten::relu``, never the ``aten::clamp_min``
    it calls), so an op's charge must include the children the mode never sees.
    Warm up before profiling: first calls are slow.
    """

    def __init__(self, profile: Any, *, fallback: Compute | None = None) -> None:
        self.table: dict[str, float] = _mean_times(profile)
        self.fallback: Compute = Compute.roofline("cpu") if fallback is None else fallback
        self._ops: dict[Any, float | None] = {}

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        try:
            seconds = self._ops[func]
        except KeyError:
            seconds = self._ops[func] = self.table.get(_op_name(func))
        if seconds is None:
            return self.fallback.op_time(func, args, kwargs, out)
        return seconds

    def __repr__(self) -> str:
        top = sorted(self.table.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{k!r}: {v:.3g}" for k, v in top)
        more = ", ..." if len(self.table) > len(top) else ""
        return (f"Compute.from_profile({{{shown}{more}}} ({len(self.table)} ops, s/call), "
                f"fallback={self.fallback!r})")


def _mean_times(profile: Any) -> dict[str, float]:
    if isinstance(profile, Mapping):
        table = {}
        for name, seconds in profile.items():
            table[str(name)] = number(f"profile[{name!r}]", seconds, minimum=0,
                                        hint="give seconds per call")
        return table
    # a profile object averages itself; an EventList (key_averages() or events()) is used as is
    events = profile if isinstance(profile, list) or not hasattr(profile, "key_averages") \
        else profile.key_averages()
    try:
        events = list(events)
    except TypeError:
        raise TypeError(f"from_profile needs a torch.profiler.profile, its key_averages() or a "
                        f"{{op name: seconds}} mapping, got {type(profile).__name__}") from None
    if events and not hasattr(events[0], "cpu_time_total"):
        raise TypeError(f"from_profile: entries of type {type(events[0]).__name__} are not "
                        "profiler events; pass profile.key_averages()")
    totals: dict[str, list[float]] = {}  # name -> [total µs, calls]
    for e in events:
        device_us = getattr(e, "device_time_total", 0) or 0
        us = device_us if device_us > 0 else e.cpu_time_total
        acc = totals.setdefault(e.key, [0.0, 0])
        acc[0] += us
        acc[1] += getattr(e, "count", 1)
    return {name: us * 1e-6 / calls for name, (us, calls) in totals.items() if calls > 0}
