"""MeasuredNetwork: collective costs read from this machine's measurements (piecewise in
log-size), with the α–β model only where the table says nothing."""

import json
import math

import pytest

from fakepg import zoo
from simddp import MeasuredNetwork, Network, Timing
from simddp.models import NetworkModel
from simddp.replay import replay
from simddp import capture


def rows_of(net, op, world_size, sizes):
    return [{"op": op, "world_size": world_size, "bytes": b,
             "seconds": net.collective_time(op, b, world_size)} for b in sizes]


def test_measured_points_come_back_exactly_and_between_them_time_is_linear_in_log_size():
    rows = [{"op": "all_reduce", "world_size": 4, "bytes": b, "seconds": s}
            for b, s in [(1 << 10, 50e-6), (1 << 16, 80e-6), (1 << 20, 2e-3)]]
    net = MeasuredNetwork(rows)
    for r in rows:
        assert net.collective_time("all_reduce", r["bytes"], 4) == r["seconds"]
    # 256 KiB is halfway between 64 KiB and 1 MiB in log-size: a protocol step a line would miss
    assert net.collective_time("all_reduce", 1 << 18, 4) == pytest.approx((80e-6 + 2e-3) / 2)


def test_outside_the_table_small_messages_cost_the_latency_floor_and_large_ones_extrapolate_the_last_bandwidth():
    rows = [{"op": "all_reduce", "world_size": 2, "bytes": b, "seconds": s}
            for b, s in [(1 << 12, 1e-4), (1 << 20, 1e-3), (1 << 22, 4e-3)]]
    net = MeasuredNetwork(rows)
    assert net.collective_time("all_reduce", 8, 2) == 1e-4
    slope = (4e-3 - 1e-3) / ((1 << 22) - (1 << 20))
    assert net.collective_time("all_reduce", 1 << 24, 2) == pytest.approx(4e-3 + slope * ((1 << 24) - (1 << 22)))
    # a barrier is an all_reduce of nothing: the floor; one rank costs nothing
    assert net.collective_time("barrier", 0, 2) == 1e-4
    assert net.collective_time("all_reduce", 1 << 20, 1) == 0.0


def test_an_unmeasured_world_size_scales_the_nearest_table_by_the_alpha_beta_ratio():
    true = Network(bandwidth_GBps=2.0, latency_us=30.0)
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26]
    net = MeasuredNetwork(rows_of(true, "all_reduce", 2, sizes) + rows_of(true, "all_reduce", 4, sizes))
    for b in sizes:
        assert net.collective_time("all_reduce", b, 8) == pytest.approx(
            true.collective_time("all_reduce", b, 8), rel=1e-6)


def test_an_unmeasured_op_uses_a_measured_op_with_the_same_cost_formula_else_the_fit():
    true = Network(bandwidth_GBps=5.0, latency_us=10.0)
    sizes = [1 << 12, 1 << 20, 1 << 24]
    net = MeasuredNetwork(rows_of(true, "all_gather", 2, sizes) + rows_of(true, "all_reduce", 2, sizes))
    # reduce_scatter shares all_gather's formula: its table answers
    assert net.collective_time("reduce_scatter", 1 << 20, 2) == true.collective_time("all_gather", 1 << 20, 2)
    # broadcast has no measured kin: all_reduce's α–β fit (exact here, the data is α–β)
    assert net.collective_time("broadcast", 1 << 20, 2) == pytest.approx(
        true.collective_time("broadcast", 1 << 20, 2), rel=1e-6)


def test_repeated_points_keep_the_fastest_measurement():
    rows = [{"op": "all_reduce", "world_size": 2, "bytes": 1024, "seconds": s} for s in (3e-4, 1e-4, 2e-4)]
    assert MeasuredNetwork(rows).collective_time("all_reduce", 1024, 2) == 1e-4


@pytest.mark.parametrize("rows, message", [
    ([], "at least one measurement"),
    ([{"op": "all_reduce", "world_size": 2, "bytes": 8}], "lacks ['seconds']"),
    ([{"op": "allreduce_everything", "world_size": 2, "bytes": 8, "seconds": 1.0}], "allreduce_everything"),
    ([{"op": "all_reduce", "world_size": 2, "bytes": 8, "seconds": -1.0}], "seconds"),
])
def test_bad_measurements_are_refused_naming_the_row(rows, message):
    with pytest.raises(ValueError) as e:
        MeasuredNetwork(rows)
    assert message in str(e.value)


def test_a_calibrate_file_is_a_network_model_both_engines_accept(tmp_path):
    true = Network(bandwidth_GBps=1.0, latency_us=100.0)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"measurements": rows_of(true, "all_reduce", 2, [1 << 10, 1 << 20, 1 << 24])}))
    net = Network.from_measurements(path, gpus_per_node=None)
    assert isinstance(net, NetworkModel) and net.name == "measured:cal.json"
    assert net.describe()["measured_points"] == 3
    sc = zoo.get("mlp", iterations=2)
    cap = capture(sc, nprocs=2, timing=Timing(network=net))
    res = replay(cap, 8, network=net)
    assert res.iteration_time > 0
    assert math.isfinite(res.iteration_time)
