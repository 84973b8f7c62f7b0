"""GPU presets: each device's datasheet figures and how its kernels behave
(:class:`DevicePreset`, one entry of :data:`DEVICES` per card, sources in docs/costs.md), and
``--gpu PRESET[,field=value...]`` (:func:`gpu_spec`). The compute models
(:mod:`simddp.models.compute`, :mod:`simddp.models.kernels`) cost ops on them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DevicePreset", "DEVICES", "ALIASES", "GPU_FIELDS", "gpu_spec"]


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
        name = str(dtype)  # by name: the presets load without torch (a warm whatif)
        if name in ("torch.float16", "torch.bfloat16"):
            return self.fp16_tflops
        if name in ("torch.float64", "torch.complex128"):
            return self.fp64_tflops
        if name in _FP8_DTYPES and self.fp8_tflops:
            return self.fp8_tflops
        return self.fp32_tflops  # fp32 and everything else (FLOP formulas exist for float ops)


_FP8_DTYPES = frozenset(f"torch.{n}" for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"))
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
