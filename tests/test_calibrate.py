"""Specs for ``simddp calibrate``'s measurement (``simddp.measure.measure``): rounds
repeated until each point's estimate holds still (or a report that it did not), the sizes the
what-if needs (up to a workload's largest DDP bucket), and a table monotone in message size."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fakepg import zoo
from simddp.cli import main
from simddp.measure import _moved, default_sizes, largest_bucket_bytes, measure, monotone
from simddp.models import MeasuredNetwork


def rows(points: list[tuple[int, float]], op: str = "all_reduce", world: int = 2) -> list[dict]:
    return [{"op": op, "world_size": world, "bytes": b, "seconds": s} for b, s in points]


def test_monotone_lowers_a_point_slower_than_a_larger_message_to_that_time() -> None:
    # the case: 2 ranks, 64 KiB measured 3.83 ms, 1 MiB 0.61 ms
    fitted = monotone(rows([(4 << 10, 0.2e-3), (64 << 10, 3.83e-3), (1 << 20, 0.61e-3),
                            (8 << 20, 4.1e-3)]))
    assert [r["seconds"] for r in fitted] == [0.2e-3, 0.61e-3, 0.61e-3, 4.1e-3]
    assert fitted[1]["measured_seconds"] == 3.83e-3
    assert all("measured_seconds" not in r for i, r in enumerate(fitted) if i != 1)
    # a chain of disturbed points falls to the smallest time above them
    chain = monotone(rows([(1, 5.0), (2, 4.0), (3, 3.0), (4, 1.0)]))
    assert [r["seconds"] for r in chain] == [1.0, 1.0, 1.0, 1.0]


def test_monotone_treats_each_op_and_world_size_apart_and_keeps_row_order() -> None:
    mixed = (rows([(1 << 20, 2.0), (4 << 10, 3.0)], world=2)
             + rows([(4 << 10, 9.0)], world=4) + rows([(4 << 10, 5.0)], op="all_gather"))
    fitted = monotone(mixed)
    assert [(r["world_size"], r["bytes"], r["seconds"]) for r in fitted] == [
        (2, 1 << 20, 2.0), (2, 4 << 10, 2.0), (4, 4 << 10, 9.0), (2, 4 << 10, 5.0)]
    assert mixed[1]["seconds"] == 3.0  # the input is not changed


def test_a_monotone_table_gives_a_network_whose_times_never_fall_with_size() -> None:
    net = MeasuredNetwork(monotone(rows([(4 << 10, 0.2e-3), (64 << 10, 3.83e-3),
                                         (1 << 20, 0.61e-3), (8 << 20, 4.1e-3)])))
    sizes = [int(4096 * 1.3 ** k) for k in range(40)]
    times = [net.collective_time("all_reduce", s, 2) for s in sizes]
    assert times == sorted(times)


def test_default_sizes_reach_the_largest_message_itself() -> None:
    assert default_sizes(32 << 20) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20,
                                       16 << 20, 32 << 20]
    assert default_sizes(1 << 20) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    assert default_sizes(1000) == [1000]


def test_largest_bucket_follows_ddps_caps_and_a_parameter_above_the_cap_is_its_own() -> None:
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(3)])  # 1 MiB each
    # DDP's first bucket closes at 1 MiB (the last layer), the other two share a 25 MB one
    assert largest_bucket_bytes(model) == 2 << 20
    assert largest_bucket_bytes(model, 0.5) == 1 << 20
    with torch.device("meta"):
        vgg = zoo.get("vgg16").build_model()
    fc6 = vgg.classifier[0]
    assert largest_bucket_bytes(vgg) == (fc6.weight.numel() + fc6.bias.numel()) * 4
    assert largest_bucket_bytes(vgg) == 411_058_176


@pytest.mark.gloo
def test_rounds_repeat_until_the_estimates_hold_still_or_say_they_did_not() -> None:
    # any movement tolerated: the estimates count as settled after min_rounds
    loose = measure(world_sizes=[2], sizes=[4 << 10, 64 << 10], reps=2, min_rounds=2,
                    max_rounds=4, tolerance=100.0)
    assert [r["rounds"] for r in loose] == [2, 2] and all(r["stable"] for r in loose)
    # none tolerated: real timings never repeat exactly, so it runs to max_rounds and says so
    strict = measure(world_sizes=[2], sizes=[4 << 10, 64 << 10], reps=2, min_rounds=2,
                     max_rounds=3, tolerance=0.0)
    assert [r["rounds"] for r in strict] == [3, 3] and not any(r["stable"] for r in strict)
    for r in strict:
        assert len(r["round_seconds"]) == 3 and r["spread"] >= 0 and r["moved"] > 0
    assert [r["seconds"] for r in strict] == sorted(r["seconds"] for r in strict)


def test_a_point_settles_when_its_median_holds_still_not_when_every_round_agrees() -> None:
    # one disturbed round among steady ones: the median over rounds barely moves
    assert _moved([1.0, 1.0, 6.0, 1.02, 0.99, 1.01], 3) <= 0.02
    # a drifting machine: each round slower than the last, so the median keeps moving
    assert _moved([1.0, 1.2, 1.4, 1.6, 1.8, 2.0], 3) == pytest.approx((1.5 - 1.3) / 1.5)
    assert _moved([2.5], 3) == 0.0


def test_calibrate_refuses_a_bucket_cap_without_a_workload(capsys) -> None:
    assert main(["calibrate", "--bucket-cap-mb", "25"]) == 1
    assert "--bucket-cap-mb says which buckets --workload NAME forms" in capsys.readouterr().err


def test_measure_refuses_rounds_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="min_rounds <= max_rounds"):
        measure(min_rounds=4, max_rounds=2)
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        measure(tolerance=-1)


@pytest.mark.gloo
def test_calibrate_measures_up_to_a_workloads_largest_bucket_and_reports_each_points_spread(
        tmp_path, capsys) -> None:
    path = tmp_path / "cal.json"
    assert main(["calibrate", "--workload", "mlp", "--bucket-cap-mb", "0.01", "--reps", "2",
                 "--min-rounds", "2", "--max-rounds", "2", "--tolerance", "0",
                 "--no-contention", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    with torch.device("meta"):
        largest = largest_bucket_bytes(zoo.get("mlp").build_model(), 0.01)
    doc = json.loads(path.read_text())
    assert [m["bytes"] for m in doc["measurements"]] == default_sizes(largest)
    assert f"mlp: largest DDP bucket {largest} bytes" in out
    assert "spread" in out and "moved" in out
    assert "points did not settle" in out  # tolerance 0: no estimate holds perfectly still
