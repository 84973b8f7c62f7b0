"""Specification of Compute.kernels (simddp.models.kernels): op costs from measured kernel
behaviour — GEMM tile/wave quantization, attention curves, achieved bandwidth, launch and host
cost, power cap, Float8, torch.compile's fusion — and the GPU presets with gpu_spec."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from simddp.models.compute import Compute
from simddp.models.devices import DEVICES, GPU_FIELDS, gpu_spec
from simddp.models.kernels import (ATTENTION_CURVES, COMPILE_POINTWISE_TRAFFIC, POWER_EXPONENT,
                                   Kernels, op_kind)

aten = torch.ops.aten
BF16 = torch.bfloat16


def meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def mm_time(model, m, k, n, dtype=BF16):
    a, b = meta(m, k, dtype=dtype), meta(k, n, dtype=dtype)
    return model.op_time(aten.mm.default, (a, b), {}, meta(m, n, dtype=dtype))


def sdpa(model, s, d=128, causal=True, backward=False, b=2, h=32):
    q = meta(b, h, s, d)
    if not backward:
        return model.op_time(aten._scaled_dot_product_flash_attention_for_cpu.default,
                             (q, q, q, 0.0, causal), {}, (q, meta(b, h, s, dtype=torch.float)))
    lse = meta(b, h, s, dtype=torch.float)
    return model.op_time(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                         (q, q, q, q, q, lse, 0.0, causal), {}, (q, q, q))


# ---- GEMMs ---------------------------------------------------------------------------------------

def test_large_square_bf16_gemm_runs_near_the_published_plateau():
    h100 = Compute.kernels("h100")
    n = 16384
    seconds = mm_time(h100, n, n, n)
    achieved = 2 * n ** 3 / seconds / 989e12
    # the Hopper plateau (0.75) less wave quantization: 8,192 tiles of 256×128 in 63 waves
    assert achieved == pytest.approx(0.75, rel=0.03)
    assert Kernels(gpu_spec("h100")).gemm_efficiency(n, n, n) > 0.73


def test_tiny_gemm_is_launch_and_host_bound():
    h100 = Compute.kernels("h100")
    assert mm_time(h100, 16, 16, 16) == pytest.approx(5e-6)  # the host's 5 µs per eager op
    k = Kernels(gpu_spec("h100"))
    assert k.gemm_efficiency(64, 64, 64) < 0.01  # one 64×64 tile on 132 SMs


def test_skinny_gemm_is_far_below_peak_and_memory_bound_at_small_k():
    k = Kernels(gpu_spec("h100"))
    assert k.gemm_efficiency(128, 128, 8192) < 0.01 * k.gemm_efficiency(8192, 8192, 8192) * 100
    h100 = Compute.kernels("h100")
    m, kk, n = 16384, 16, 16384  # K = 16: the output write dominates
    nbytes = 2 * (m * kk + kk * n + m * n)
    assert mm_time(h100, m, kk, n) == pytest.approx(nbytes / (3350e9 * 0.90) + 2e-6, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 8192),
       dm=st.integers(0, 3000), dn=st.integers(0, 3000), dk=st.integers(0, 3000))
def test_gemm_time_never_falls_when_a_dimension_grows(m, n, k, dm, dn, dk):
    model = Compute.kernels("a100")
    assert mm_time(model, m + dm, k + dk, n + dn) >= mm_time(model, m, k, n) * (1 - 1e-12)


def test_gemm_wave_quantization_one_tile_more_than_the_sms_costs_a_wave():
    k = Kernels(gpu_spec("h100"))  # 132 SMs; 256×128 tiles
    full = k.gemm_efficiency(256 * 12, 128 * 11, 4096)  # 132 tiles: one full wave
    over = k.gemm_efficiency(256 * 12 + 1, 128 * 11, 4096)  # a 133rd row of tiles spills
    assert full == pytest.approx(0.75)
    assert over < 0.8 * full


def test_fp32_gemm_uses_the_plain_fp32_peak():
    h100 = Compute.kernels("h100")
    n = 8192
    f32 = mm_time(h100, n, n, n, torch.float32) - 2e-6  # less the launch
    bf16 = mm_time(h100, n, n, n) - 2e-6
    assert f32 / bf16 == pytest.approx(989 / 67, rel=1e-6)


# ---- attention -----------------------------------------------------------------------------------

def test_attention_forward_matches_the_published_fa2_h100_curve():
    h100 = Compute.kernels("h100")
    s, d, b, h = 8192, 128, 2, 32
    flops = 4 * b * h * s * s * d / 2  # causal: half
    achieved = flops / (sdpa(h100, s) - 2e-6) / 1e12
    assert achieved == pytest.approx(333, rel=1e-3)  # FA3 paper, Fig. 5: FA2, causal, 8k
    flops_nc = 4 * b * h * s * s * d
    assert flops_nc / (sdpa(h100, s, causal=False) - 2e-6) / 1e12 == pytest.approx(370, rel=1e-3)


def test_attention_backward_is_slower_per_flop_than_forward():
    k = Kernels(gpu_spec("h100"))
    for s in (512, 2048, 8192):
        for causal in (False, True):
            assert k.attention_efficiency(s, 128, causal, True) < \
                k.attention_efficiency(s, 128, causal, False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_attention_efficiency_grows_with_sequence_length(causal, backward):
    k = Kernels(gpu_spec("h100"))
    seqs = [256, 512, 700, 1024, 3000, 4096, 8192, 16384, 65536]
    effs = [k.attention_efficiency(s, 128, causal, backward) for s in seqs]
    assert effs == sorted(effs)


def test_fa2_curves_are_monotone_as_published():
    for key, curve in ATTENTION_CURVES["fa2"].items():
        assert list(curve) == sorted(curve), key


def test_ampere_runs_flash_attention_at_a_higher_fraction_of_its_peak():
    a100, h100 = Kernels(gpu_spec("a100")), Kernels(gpu_spec("h100"))
    assert a100.attention_efficiency(16384, 128, False, False) == pytest.approx(0.73)
    assert h100.attention_efficiency(16384, 128, False, False) == pytest.approx(370 / 989)


def test_cudnn_attention_is_faster_than_flash_on_hopper():
    flash = Compute.kernels("h100")
    cudnn = Compute.kernels("h100", attention="cudnn")
    assert sdpa(cudnn, 4096) < 0.7 * sdpa(flash, 4096)


# ---- memory-bound ops, launches, views -----------------------------------------------------------

def test_elementwise_runs_at_achieved_not_peak_bandwidth():
    h100 = Compute.kernels("h100")
    x = meta(1 << 26)
    nbytes = 3 * 2 * (1 << 26)
    assert h100.op_time(aten.add.Tensor, (x, x), {}, x) == \
        pytest.approx(nbytes / (3350e9 * 0.90) + 2e-6, rel=1e-9)


def test_views_cost_host_dispatch_only():
    h100 = Compute.kernels("h100")
    x = meta(4096, 4096)
    assert h100.op_time(aten.t.default, (x,), {}, x.t()) == pytest.approx(1e-6)
    assert op_kind(aten.t.default) == "view"
    assert op_kind(aten.mm.default) == "gemm"
    assert op_kind(aten.add.Tensor) == "pointwise"
    assert op_kind(aten.mean.dim) == "pointwise"  # a reduction compile fuses with its chain


# ---- power cap -----------------------------------------------------------------------------------

def test_power_cap_slows_compute_bound_ops_by_the_published_relation():
    full, capped = Compute.kernels("h100"), Compute.kernels("h100,tdp-W=500")
    n = 8192
    ratio = (mm_time(capped, n, n, n) - 2e-6) / (mm_time(full, n, n, n) - 2e-6)
    assert ratio == pytest.approx((700 / 500) ** POWER_EXPONENT, rel=1e-9)
    assert sdpa(capped, 8192) > sdpa(full, 8192)


def test_power_cap_leaves_memory_bound_ops_alone_and_above_tdp_changes_nothing():
    full, capped = Compute.kernels("h100"), Compute.kernels("h100,tdp-W=500")
    x = meta(1 << 26)
    assert capped.op_time(aten.add.Tensor, (x, x), {}, x) == \
        full.op_time(aten.add.Tensor, (x, x), {}, x)
    assert mm_time(Compute.kernels("h100,tdp-W=900"), 8192, 8192, 8192) == \
        mm_time(full, 8192, 8192, 8192)


@settings(max_examples=30, deadline=None)
@given(w1=st.floats(100, 700), w2=st.floats(100, 700))
def test_a_lower_power_limit_never_makes_a_gemm_faster(w1, w2):
    lo, hi = sorted((w1, w2))
    t_lo = mm_time(Compute.kernels(f"h100,tdp-W={lo}"), 4096, 4096, 4096)
    t_hi = mm_time(Compute.kernels(f"h100,tdp-W={hi}"), 4096, 4096, 4096)
    assert t_lo >= t_hi


# ---- Float8 and torch.compile --------------------------------------------------------------------

def test_float8_gemm_is_faster_than_bf16_on_h100_for_large_gemms():
    bf16, fp8 = Compute.kernels("h100"), Compute.kernels("h100", float8=True)
    t_bf16, t_fp8 = mm_time(bf16, 16384, 4096, 14336), mm_time(fp8, 16384, 4096, 14336)
    assert t_fp8 < 0.75 * t_bf16
    # the casts are charged: never better than the FP8 peak's ratio
    assert t_fp8 > t_bf16 * (989 / 1979) * (0.75 / 0.65) * 0.99


def test_float8_on_a_card_without_fp8_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="a100 has no FP8 tensor cores"):
        Compute.kernels("a100", float8=True)


def test_compile_removes_pointwise_traffic_and_launches_but_not_gemms():
    eager, compiled = Compute.kernels("h100"), Compute.kernels("h100", compile=True)
    x = meta(1 << 26)
    t_eager = eager.op_time(aten.mul.Tensor, (x, x), {}, x)
    t_comp = compiled.op_time(aten.mul.Tensor, (x, x), {}, x)
    assert t_comp == pytest.approx(t_eager * COMPILE_POINTWISE_TRAFFIC, rel=1e-9)
    assert mm_time(compiled, 4096, 4096, 4096) == mm_time(eager, 4096, 4096, 4096)
    assert compiled.op_time(aten.t.default, (x.view(1 << 13, 1 << 13),), {}, x) == 0.0


def test_peak_efficiency_is_the_datasheet_roofline_for_a_large_gemm():
    peak = Compute.kernels("h100", efficiency="peak")
    n = 16384
    assert mm_time(peak, n, n, n) == pytest.approx(2 * n ** 3 / 989e12, rel=1e-9)
    with pytest.raises(ValueError, match="'kernels'.*'peak'"):
        Compute.kernels("h100", efficiency="fast")


def test_kernels_model_is_deterministic_and_reprs_what_it_models():
    a, b = Compute.kernels("h100,tdp-W=500", compile=True), \
        Compute.kernels("h100,tdp-W=500", compile=True)
    assert mm_time(a, 3000, 5000, 7000) == mm_time(b, 3000, 5000, 7000)
    assert repr(a) == "Compute.kernels('h100,tdp-W=500', compile=True)"
    assert repr(Compute.kernels("h100", mem_bandwidth_GBps=2400.0)) == \
        "Compute.kernels('h100', mem_bandwidth_GBps=2400.0)"


def test_cpu_preset_under_kernels_is_its_roofline():
    """A CPU runs an op after dispatching it (no queue to run ahead into): the calibrated CPU
    path (``--gpu cpu --step-time``) keeps the roofline's costs."""
    cpu_k, cpu_r = Compute.kernels("cpu"), Compute.roofline("cpu")
    a, x = meta(2048, 2048, dtype=torch.float32), meta(1 << 20, dtype=torch.float32)
    one = x[:1]
    for func, args, out in ((aten.mm.default, (a, a), a), (aten.add.Tensor, (x, x), x),
                            (aten.t.default, (a,), a.t()), (aten.add.Tensor, (one, one), one)):
        assert cpu_k.op_time(func, args, {}, out) == \
            pytest.approx(cpu_r.op_time(func, args, {}, out), rel=1e-12)


# ---- presets and gpu_spec ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["v100", "a100", "a100-40gb", "h100", "h100-pcie", "h200",
                                  "b200", "mi300x", "l40s"])
def test_gpu_presets_carry_datasheet_and_kernel_fields(name):
    d = DEVICES[name]
    assert d.memory_GiB and d.memory_GB == pytest.approx(d.memory_GiB * 2 ** 30 / 1e9)
    assert d.sms and d.tdp_W == d.rated_tdp_W and d.gemm_fraction and d.hbm_fraction
    assert d.fp16_tflops > d.fp32_tflops >= d.fp64_tflops or name == "mi300x"
    assert (d.fp8_tflops is None) == (name in ("v100", "a100", "a100-40gb"))
    if d.fp8_tflops:
        assert d.fp8_tflops == pytest.approx(2 * d.fp16_tflops, rel=0.03)


def test_gpu_presets_memory_is_what_the_driver_reports():
    assert DEVICES["h100"].memory_GiB == pytest.approx(79.65, abs=0.01)  # 81,559 MiB
    assert DEVICES["a100"].memory_GiB == 80.0 and DEVICES["a100-40gb"].memory_GiB == 40.0
    assert DEVICES["h200"].memory_GiB == pytest.approx(140.4, abs=0.05)
    h200, h100 = DEVICES["h200"], DEVICES["h100"]
    assert (h200.fp16_tflops, h200.fp8_tflops) == (h100.fp16_tflops, h100.fp8_tflops)
    assert h200.mem_bandwidth_GBps > h100.mem_bandwidth_GBps


def test_gpu_spec_reads_a_preset_with_overrides():
    d = gpu_spec("H100,memory-GiB=96,hbm-TBps=2.4,tdp-W=500,BF16-TFLOPs=900")
    assert (d.memory_GiB, d.mem_bandwidth_GBps, d.tdp_W, d.fp16_tflops) == \
        (96.0, 2400.0, 500.0, 900.0)
    assert d.memory_GB == pytest.approx(96 * 2 ** 30 / 1e9)
    assert d.rated_tdp_W == 700.0 and d.name.startswith("H100,memory-GiB=96,")
    assert gpu_spec("h100") is DEVICES["h100"] and gpu_spec("h100-sxm") is DEVICES["h100"]
    assert gpu_spec(DEVICES["a100"]) is DEVICES["a100"]


@pytest.mark.parametrize("text, message", [
    ("h100,speed=3", "accepted fields: memory-GiB"),
    ("h100,memory-GiB", "not field=value"),
    ("h100,tdp-W=lots", "tdp-W='lots' is not a number"),
    ("h100,tdp-W=-5", "tdp-W must be a positive number"),
    ("h900", "unknown preset 'h900'; presets: v100, a100"),
    ("", "give a preset"),
])
def test_gpu_spec_errors_say_what_is_wrong_and_what_is_accepted(text, message):
    with pytest.raises(ValueError, match=message):
        gpu_spec(text)


def test_gpu_spec_error_lists_every_accepted_field():
    with pytest.raises(ValueError) as e:
        gpu_spec("h100,foo=1")
    assert all(field in str(e.value) for field in GPU_FIELDS)


def test_existing_preset_names_still_build_rooflines():
    for name in ("v100", "a100", "h100", "b200", "cpu"):
        assert Compute.roofline(name).device is DEVICES[name]
        assert math.isfinite(mm_time(Compute.kernels(name), 512, 512, 512))


# ---- the 8B Llama block -------------------------------------------------------------------------

def test_llama3_8b_block_per_op_kind_under_kernels(capsys):
    """The check a real H100 profile is compared with (ci/compute_llama_block.py): GEMMs take
    most of the block, attention is costed by its curve, and the block's MFU under kernels
    lies below the roofline's."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "ci" / "compute_llama_block.py"
    spec = importlib.util.spec_from_file_location("compute_llama_block", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--gpu", "h100", "--batch", "1", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): [float(x) for x in line.split()[3:]]
            for line in out.splitlines() if line.startswith(("forward", "backward"))}
    kernels = {k: v[0] for k, v in rows.items()}
    roofline = {k: v[2] for k, v in rows.items()}
    assert kernels[("forward", "gemm")] > kernels[("forward", "attention")] > 0
    assert kernels[("backward", "attention")] > 2 * kernels[("forward", "attention")]
    assert all(kernels[k] > roofline[k] for k in kernels if k[1] in ("gemm", "attention"))
    mfu = {part.split()[0]: float(part.split()[1].rstrip("%"))
           for part in out.splitlines()[-1].split(": ")[1].split(", ")}
    assert 30 < mfu["kernels"] < mfu["roofline"] < 80
