"""Specification of simddp.models.compute: roofline, constant and profile-calibrated op costs."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from simddp.models.compute import Compute
from simddp.models.devices import DEVICES, DevicePreset

aten = torch.ops.aten


class Charging(TorchDispatchMode):
    """What the simulator does: charge every aten op through the model."""

    def __init__(self, model):
        super().__init__()
        self.model, self.ops, self.seconds = model, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(func)
        self.seconds.append(self.model.op_time(func, args, kwargs, out))
        return out


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def step(model, x):
    model(x).sum().backward()


def cost(model, func, *args, **kwargs):
    return model.op_time(func, args, kwargs, func(*args, **kwargs))


# ---- roofline -----------------------------------------------------------------------------------

def test_roofline_matmul_is_compute_bound_and_matches_flops_over_peak():
    h100 = Compute.roofline("h100")
    a = torch.ones(1024, 1024)
    flops, nbytes = 2 * 1024**3, 3 * 1024 * 1024 * 4
    assert flops / 67e12 > nbytes / 3350e9  # compute bound in fp32
    assert cost(h100, aten.mm.default, a, a) == pytest.approx(flops / 67e12 + 5e-6, rel=1e-9)


def test_roofline_picks_peak_by_dtype_tensor_cores_for_half_precision():
    h100 = Compute.roofline("h100", op_overhead_us=0.0)
    a = torch.ones(512, 512, dtype=torch.bfloat16)
    flops, nbytes = 2 * 512**3, 3 * 512 * 512 * 2
    # at 989 TFLOP/s this matmul is memory bound
    expected = max(flops / 989e12, nbytes / 3350e9)
    assert cost(h100, aten.mm.default, a, a) == pytest.approx(expected, rel=1e-9)
    a64 = torch.ones(512, 512, dtype=torch.float64)
    assert cost(h100, aten.mm.default, a64, a64) == pytest.approx(flops / 67e12, rel=1e-9)


def test_roofline_elementwise_is_memory_bound():
    a100 = Compute.roofline("a100")
    x = torch.ones(1 << 20)
    # two inputs and one output of 4 MiB each, no FLOP formula for add
    assert cost(a100, aten.add.Tensor, x, x) == pytest.approx(3 * 4 * (1 << 20) / 2039e9 + 5e-6,
                                                              rel=1e-9)


def test_roofline_counts_list_inputs_and_out_argument_once():
    cpu = Compute.roofline("cpu", op_overhead_us=0.0)
    x = torch.ones(1000)
    assert cost(cpu, aten.cat.default, [x, x, x]) == pytest.approx(6 * 4000 / 20e9, rel=1e-9)
    out = torch.empty(1000)
    assert cost(cpu, aten.add.out, x, x, out=out) == pytest.approx(3 * 4000 / 20e9, rel=1e-9)


@pytest.mark.parametrize("func, args", [
    (aten.view.default, ([64, 16],)), (aten.t.default, ()), (aten.transpose.int, (0, 1)),
    (aten.permute.default, ([1, 0],)), (aten.expand.default, ([2, 32, 32],)),
    (aten.detach.default, ()), (aten.alias.default, ()), (aten._unsafe_view.default, ([1024],)),
    (aten.as_strided.default, ([32], [1])), (aten.empty_like.default, ()),
])
def test_views_move_no_data_and_cost_only_the_dispatch_overhead(func, args):
    model = Compute.roofline("cpu", op_overhead_us=3.0)
    x = torch.ones(32, 32)
    assert cost(model, func, x, *args) == pytest.approx(3e-6)
    assert cost(model, aten.clone.default, x) > 3e-6  # a copy does move data


def test_roofline_flops_agree_with_flop_counter_mode():
    # a tiny peak and an infinite-ish bandwidth make time·peak = FLOPs
    model = Compute.roofline("cpu", peak_tflops=1e-12, mem_bandwidth_GBps=1e12, op_overhead_us=0.0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 14 * 14, 10))
    x = torch.randn(4, 3, 16, 16)
    with FlopCounterMode(display=False) as counter:
        step(net, x)
    with Charging(model) as mode:
        step(net, x)
    assert counter.get_total_flops() > 0
    assert sum(mode.seconds) == pytest.approx(counter.get_total_flops(), rel=1e-6)


def test_efficiency_slows_compute_and_memory_but_not_the_overhead():
    full = Compute.roofline("a100", op_overhead_us=1.0)
    half = Compute.roofline("a100", op_overhead_us=1.0, efficiency=0.5)
    a, x = torch.ones(1024, 1024), torch.ones(1 << 20)
    for func, args in ((aten.mm.default, (a, a)), (aten.add.Tensor, (x, x))):
        assert cost(half, func, *args) - 1e-6 == pytest.approx(2 * (cost(full, func, *args) - 1e-6))


def test_roofline_arguments_override_the_preset():
    slow_flops = Compute.roofline("h100", peak_tflops=1.0, mem_bandwidth_GBps=1e6,
                                  op_overhead_us=0.0)
    a = torch.ones(100, 100)
    assert cost(slow_flops, aten.mm.default, a, a) == pytest.approx(2e6 / 1e12)
    slow_memory = Compute.roofline("h100", mem_bandwidth_GBps=1.0, op_overhead_us=7.0)
    x = torch.ones(250)
    assert cost(slow_memory, aten.neg.default, x) == pytest.approx(2000 / 1e9 + 7e-6)


def test_roofline_accepts_a_custom_device_preset():
    dev = DevicePreset("toy", fp32_tflops=1.0, fp16_tflops=2.0, fp64_tflops=0.5,
                       mem_bandwidth_GBps=1e9, op_overhead_us=0.0)
    a = torch.ones(100, 100, dtype=torch.float16)
    assert cost(Compute.roofline(dev), aten.mm.default, a, a) == pytest.approx(2e6 / 2e12)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), extra=st.integers(0, 5000),
       device=st.sampled_from(sorted(DEVICES)))
def test_bigger_tensors_never_cost_less(n, extra, device):
    model = Compute.roofline(device)
    small, big = torch.ones(n), torch.ones(n + extra)
    assert cost(model, aten.mul.Tensor, big, big) >= cost(model, aten.mul.Tensor, small, small) > 0
    ms, mb = torch.ones(n % 64 + 1, 8), torch.ones(n % 64 + 1 + extra % 64, 8)
    assert cost(model, aten.mm.default, mb, mb.T) >= cost(model, aten.mm.default, ms, ms.T)


def test_unknown_device_error_lists_known_devices():
    with pytest.raises(ValueError, match="unknown device preset 'tpu'.*a100.*h100.*cpu|"
                                         "unknown device preset 'tpu'.*cpu"):
        Compute.roofline("tpu")


@pytest.mark.parametrize("kw, message", [
    (dict(efficiency=0.0), "efficiency must be a finite number > 0"),
    (dict(efficiency=1.5), r"efficiency must be in \(0, 1\]"),
    (dict(peak_tflops=-1.0), "peak_tflops must be"),
    (dict(mem_bandwidth_GBps=0), "mem_bandwidth_GBps must be"),
    (dict(op_overhead_us=-1.0), "op_overhead_us must be a finite number >= 0"),
])
def test_invalid_roofline_arguments_raise_errors_that_say_what_to_do(kw, message):
    with pytest.raises(ValueError, match=message):
        Compute.roofline("cpu", **kw)


# ---- constant -----------------------------------------------------------------------------------

def test_constant_model_charges_each_op():
    model = Compute.constant(2e-5)
    with Charging(model) as mode:
        step(mlp(), torch.randn(4, 32))
    assert len(mode.ops) > 10
    assert any(func.is_view for func in mode.ops)  # views are charged too
    assert set(mode.seconds) == {2e-5}
    assert sum(mode.seconds) == pytest.approx(2e-5 * len(mode.ops))


def test_constant_model_rejects_negative_cost():
    with pytest.raises(ValueError, match="seconds_per_op must be a finite number >= 0"):
        Compute.constant(-1.0)


# ---- profile ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def profiled():
    """A real torch.profiler run of an MLP's forward and backward, after a warm-up."""
    model, x = mlp(), torch.randn(16, 32)
    for _ in range(3):
        step(model, x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step(model, x)
    return prof, model, x


def test_profile_model_uses_measured_op_times(profiled):
    prof, model, x = profiled
    measured = {e.key: e.cpu_time_total * 1e-6 / e.count for e in prof.key_averages()}
    compute = Compute.from_profile(prof, fallback=Compute.constant(123.0))
    with Charging(compute) as mode:
        step(model, x)
    charged = {func._schema.name: seconds for func, seconds in zip(mode.ops, mode.seconds)}
    assert set(charged) >= {"aten::addmm", "aten::mm", "aten::relu", "aten::sum", "aten::t"}
    for name, seconds in charged.items():
        assert seconds == measured.get(name, 123.0), name
    assert sum(charged.values()) > 0


def test_profile_model_charges_inclusive_time_of_ops_the_mode_sees(profiled):
    # the mode sees aten::relu but not the aten::clamp_min it calls, so relu must carry both
    prof, _, _ = profiled
    relu = next(e for e in prof.key_averages() if e.key == "aten::relu")
    assert relu.cpu_time_total > relu.self_cpu_time_total
    x = torch.ones(4)
    assert cost(Compute.from_profile(prof), aten.relu.default, x) == pytest.approx(
        relu.cpu_time_total * 1e-6 / relu.count)


def test_profile_model_accepts_profile_key_averages_or_a_mapping(profiled):
    prof, _, _ = profiled
    from_prof = Compute.from_profile(prof)
    assert Compute.from_profile(prof.key_averages()).table == from_prof.table
    assert Compute.from_profile(dict(from_prof.table)).table == from_prof.table
    with pytest.raises(TypeError, match="from_profile needs"):
        Compute.from_profile(42)


def test_profile_model_falls_back_for_ops_it_never_measured():
    model = Compute.from_profile({"aten::mm": 1e-3}, fallback=Compute.constant(7e-6))
    x = torch.ones(8, 8)
    assert cost(model, aten.mm.default, x, x) == 1e-3
    assert cost(model, aten.sin.default, x) == 7e-6
    default = Compute.from_profile({"aten::mm": 1e-3})
    assert cost(default, aten.sin.default, x) == cost(Compute.roofline("cpu"), aten.sin.default, x)


# ---- repr ---------------------------------------------------------------------------------------

def test_repr_reads_like_the_constructor_call():
    roof = Compute.roofline("h100", efficiency=0.5)
    again = eval(repr(roof), {"Compute": Compute})
    assert (again.device, again.efficiency, again.mem_bandwidth_GBps, again.op_overhead_us) == \
        (roof.device, 0.5, 3350.0, 5.0)
    assert repr(Compute.constant(1e-5)) == "Compute.constant(1e-05)"
    text = repr(Compute.from_profile({"aten::mm": 2e-4, "aten::add": 1e-6}))
    assert text.startswith("Compute.from_profile({'aten::mm': 0.0002") and "2 ops" in text


def test_roofline_costs_a_sparse_tensor_by_the_values_and_indices_it_stores():
    model = Compute.roofline("cpu", op_overhead_us=0.0)
    dense = torch.zeros(1000, 1000)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 3]]), torch.ones(2), (1000, 1000))
    stored = sparse._values().nbytes + sparse._indices().nbytes
    t_sparse = model.op_time(torch.ops.aten.clone.default, (sparse,), {}, sparse.clone())
    t_dense = model.op_time(torch.ops.aten.clone.default, (dense,), {}, dense.clone())
    assert t_sparse == pytest.approx(2 * stored / (model.mem_bandwidth_GBps * 1e9))
    assert t_sparse < t_dense / 1000
