"""Rung 2 of the verification ladder: the fake cluster against real multi-process gloo.

The same zoo scenarios run on fakepg (rank threads) and on gloo (one process per rank, DDP on a
recording wrapper around the gloo process group); both must issue the same collective sequence,
build the same buckets and rebuilt buckets, and end with the same parameters and buffers, bit for
bit (the fake runs take gloo's personality, so they add in gloo's order; ``COMPUTE_DIFFERS``:
within dtype tolerance). Rung 1 (fake = single-process reference) is checked on the same scenarios.

Process start-up dominates a gloo run, so every gloo scenario runs in ONE set of processes
(``run_scenario`` with a list of scenarios), once per test module (per xdist worker).
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import re
import tempfile

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from fakepg import zoo
from fakepg.conformance import (CollectiveTour, RecordedCollective, ScenarioOutcome, assert_conformant,
                                compare, run_scenario)
from fakepg.zoo import TrainLoop

pytestmark = pytest.mark.gloo

WORLD = 3  # 3 ranks: distinct per-rank grad orders, uneven counts 3/4/5, a non-trivial sum order

FP16 = TrainLoop(comm_hook=default_hooks.fp16_compress_hook)

# name -> (scenario, train); the gloo run and the fake runs use exactly these.
CASES = {
    "grad_order_differs_per_rank": (zoo.get("grad_order_differs_per_rank"), None),
    "many_small_few_large": (zoo.get("many_small_few_large", bucket_cap_mb=0.01), None),
    "rank_dependent_unused": (zoo.get("rank_dependent_unused"), None),
    "buffers": (zoo.get("buffers"), None),
    "uneven_inputs": (zoo.get("uneven_inputs"), None),
    "fp16_compress_hook": (zoo.get("mlp", depth=4, width=32, bucket_cap_mb=0.005).with_(
        name="mlp+fp16_compress_hook"), FP16),
}


# BatchNorm's CPU kernels: a few last bits differ between a fake rank thread and a gloo
# process at any world size (the sum's order is not the cause); compared within tolerance.
COMPUTE_DIFFERS = {"buffers"}


# Not DDP: one call of every collective (subgroup and point-to-point included), results kept.
TOUR = {"collective_tour": (zoo.get("mlp", depth=2, width=8).with_(name="collective_tour"), CollectiveTour())}


@pytest.fixture(scope="module")
def gloo() -> dict[str, ScenarioOutcome]:
    runs = {**CASES, **TOUR}
    outcomes = run_scenario([sc for sc, _ in runs.values()], WORLD, backend="gloo",
                            train=[train for _, train in runs.values()], timeout=240)
    return dict(zip(runs, outcomes))


@functools.lru_cache(maxsize=None)
def fake(name: str) -> ScenarioOutcome:
    scenario, train = {**CASES, **TOUR}[name]
    return run_scenario(scenario, WORLD, train=train, personality="gloo")


# -- rung 2: fake == gloo ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_fake_and_gloo_issue_same_collectives_build_same_buckets_and_end_with_same_parameters(gloo, name):
    f, g = fake(name), gloo[name]
    assert f.backend == "fake" and g.backend == "gloo"
    # Each side actually observed DDP at work: parameter verification, state sync, bucket allreduces.
    for outcome in (f, g):
        for rank in range(WORLD):
            ops = {c.op for c in outcome.collectives[rank]}
            assert {"all_gather", "broadcast", "all_reduce"} <= ops, (outcome.backend, rank, ops)
        assert outcome.ddp_logging[0]["bucket_sizes"], outcome.backend
        assert set(outcome.states[0]) == set(f.states[0])
    # under gloo's personality fakepg adds in gloo's order: the same bits, except where the forward itself computes
    # other bits on a rank thread than in a gloo process (2 ranks too, where no order matters)
    diffs = compare(f, g, bitwise=name not in COMPUTE_DIFFERS)
    assert diffs == [], "\n".join(diffs)


def test_rebuilt_buckets_follow_rank0_grad_ready_order_on_both_backends(gloo):
    for outcome in (fake("grad_order_differs_per_rank"), gloo["grad_order_differs_per_rank"]):
        logs = outcome.ddp_logging
        orders = [[int(i) for i in log["prev_iteration_grad_ready_order_indices"].split(",")]
                  for log in logs]
        assert len({tuple(o) for o in orders}) == WORLD, f"{outcome.backend}: per-rank orders {orders}"
        for rank, log in enumerate(logs):
            assert log["has_rebuilt_buckets"] == 1
            rebuilt = [int(i) for i in log["rebuilt_per_bucket_param_indices"].replace(",", " ").split()]
            assert rebuilt == orders[0], (outcome.backend, rank, rebuilt, orders)
            assert log["rebuilt_bucket_sizes"] == logs[0]["rebuilt_bucket_sizes"]
        assert logs[0]["rebuilt_bucket_sizes"].count(",") >= 1  # more than one bucket


def test_small_bucket_cap_splits_many_small_few_large_into_many_buckets_on_both(gloo):
    f, g = fake("many_small_few_large"), gloo["many_small_few_large"]
    for outcome in (f, g):
        sizes = [int(s) for s in outcome.ddp_logging[0]["rebuilt_bucket_sizes"].split(",")]
        assert len(sizes) >= 4, (outcome.backend, sizes)
        bucket_allreduces = [c for c in outcome.collectives[0] if c.op == "all_reduce"]
        assert len(bucket_allreduces) >= 3 * len(sizes)  # 3 iterations after the rebuild
    assert f.ddp_logging[0]["rebuilt_bucket_sizes"] == g.ddp_logging[0]["rebuilt_bucket_sizes"]


def test_find_unused_parameters_keeps_initial_buckets_and_reports_the_same_unused_size(gloo):
    f, g = fake("rank_dependent_unused"), gloo["rank_dependent_unused"]
    for outcome in (f, g):
        log = outcome.ddp_logging[0]
        assert log["find_unused_parameters"] == 1
        assert log["unused_parameter_size"] > 0, outcome.backend
    for rank in range(WORLD):
        assert f.ddp_logging[rank]["unused_parameter_size"] == g.ddp_logging[rank]["unused_parameter_size"]


def test_uneven_inputs_under_join_shadow_collectives_and_end_with_equal_parameters(gloo):
    scenario = CASES["uneven_inputs"][0]
    assert scenario.batch_counts(WORLD) == [3, 4, 5]
    for outcome in (fake("uneven_inputs"), gloo["uneven_inputs"]):
        # Joined ranks shadow the others' allreduces, so every rank issues the same sequence.
        assert outcome.collectives[0] == outcome.collectives[WORLD - 1], outcome.backend
        for rank in range(1, WORLD):
            for key in outcome.param_names:
                assert torch.equal(outcome.states[rank][key], outcome.states[0][key]), (outcome.backend, key)


def test_buffers_are_broadcast_from_rank0_so_all_ranks_end_with_rank0_buffers(gloo):
    for outcome in (fake("buffers"), gloo["buffers"]):
        buffers = set(outcome.states[0]) - outcome.param_names
        assert buffers, "the scenario has buffers"
        # DDP broadcasts buffers before each forward, so buffer broadcasts appear in the trace.
        assert sum(c.op == "broadcast" for c in outcome.collectives[0]) > 3
    assert compare(fake("buffers"), gloo["buffers"]) == []


def test_fp16_compress_hook_allreduces_float16_buckets_on_both(gloo):
    f, g = fake("fp16_compress_hook"), gloo["fp16_compress_hook"]
    for outcome in (f, g):
        assert outcome.ddp_logging[0].get("comm_hook") == "fp16_compress_hook"
        halves = [c for c in outcome.collectives[0] if c.op == "all_reduce" and c.dtypes == ("float16",)]
        # Several buckets per iteration (one before the rebuild), every one compressed.
        assert len(halves) > CASES["fp16_compress_hook"][0].iterations, outcome.backend
        assert not [c for c in outcome.collectives[0] if c.op == "all_reduce" and "float32" in c.dtypes]
    assert f.collectives == g.collectives


def test_every_collective_has_the_same_name_shapes_and_results_on_fake_and_gloo(gloo):
    f, g = fake("collective_tour"), gloo["collective_tour"]
    ops = [c.op for c in g.collectives[0]]
    assert ops == ["all_reduce", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                   "reduce_scatter_tensor", "all_to_all_single", "reduce", "gather", "scatter",
                   "all_gather", "all_gather", "barrier", "all_reduce", "send", "recv"]
    assert g.collectives[0][13].group_ranks == (0, 2)  # the subgroup allreduce
    assert [c.op for c in g.collectives[1]][-3:] == ["barrier", "send", "recv"]  # not a member
    assert g.states[1]["all_reduce_sum"].tolist() == [30.0, 33.0, 36.0, 39.0, 42.0, 45.0]
    diffs = compare(f, g, rtol=0, atol=0)  # integer-valued: exact on both
    assert diffs == [], "\n".join(diffs)


def test_gloo_outcome_normalises_like_fake_for_world_size_and_timings(gloo):
    for name, g in gloo.items():
        assert g.world_size == WORLD and g.scenario == {**CASES, **TOUR}[name][0].name
        assert g.launch_time > 0 and g.wall_time > 0
        assert "backend_name" not in g.ddp_logging[0] and not any("time" in k for k in g.ddp_logging[0])


# -- rung 1: fake == single-process reference ----------------------------------------------------


@pytest.mark.parametrize("name", [n for n, (sc, train) in CASES.items() if sc.reference_ok and train is None])
def test_fake_matches_single_process_reference(name):
    scenario = CASES[name][0]
    f = fake(name)
    reference = ScenarioOutcome.from_states(
        [zoo.reference_train(scenario, WORLD, rank=r) for r in range(WORLD)],
        scenario=scenario.name, param_names=sorted(f.param_names))
    diffs = compare(f, reference)
    assert diffs == [], "\n".join(diffs)


# -- compare() in words ---------------------------------------------------------------------------


def test_compare_reports_a_planted_bucket_cap_difference_in_words(gloo):
    planted = run_scenario(zoo.get("many_small_few_large", bucket_cap_mb=0.02), WORLD)
    diffs = compare(planted, gloo["many_small_few_large"])
    assert diffs, "a different bucket_cap_mb must be reported"
    # The first difference is a collective, named by rank, index, op, shapes and dtype (here the
    # broadcast of rank 0's rebuilt bucket layout, or a bucket's allreduce).
    assert re.fullmatch(r"rank 0, collective #\d+: fake (\w+)\(\[\(\d+,\)\], (\w+)\) "
                        r"vs gloo \1\(\[\(\d+,\)\], \2\)", diffs[0]), diffs[0]
    assert any(d.startswith("rank 0: bucket_cap_bytes fake 20971 vs gloo 10485") for d in diffs), diffs
    assert any(d.startswith("rank 0: rebuilt_bucket_sizes fake [") for d in diffs), diffs
    assert not any("parameter" in d for d in diffs), "bucketing must not change the parameters"
    with pytest.raises(AssertionError, match=r"fake and gloo differ .*\n  rank 0, collective #"):
        assert_conformant(planted, gloo["many_small_few_large"])


def _states_outcome(states: list[dict[str, torch.Tensor]], backend: str) -> ScenarioOutcome:
    return ScenarioOutcome.from_states(states, backend=backend, scenario="t", param_names=["w", "d"])


def test_compare_tolerance_depends_on_dtype():
    base = {"w": torch.ones(4), "d": torch.ones(4, dtype=torch.float64), "n": torch.tensor([3, 3])}
    a = _states_outcome([base], "fake")

    def perturbed(key, delta):
        s = {k: v.clone() for k, v in base.items()}
        s[key][1] += delta
        return _states_outcome([s], "gloo")

    assert compare(a, perturbed("w", 1e-6)) == []  # float32 noise
    assert compare(a, perturbed("d", 1e-6)) == [
        "rank 0: parameter 'd' differs by 1e-06 (max abs) > tolerance for float64 "
        "(rtol=1e-07, atol=1e-09) in 1 of 4 elements"]
    [msg] = compare(a, perturbed("w", 3.2e-4))
    assert msg.startswith("rank 0: parameter 'w' differs by 0.00032 (max abs) > tolerance for float32")
    [msg] = compare(a, perturbed("n", 1))
    assert msg == "rank 0: buffer 'n' differs in 1 of 2 elements (int64, compared exactly)"
    assert compare(a, perturbed("w", 3.2e-4), atol=1e-3) == []  # explicit tolerance wins


def test_compare_reports_collective_sequences_of_different_length_and_world_size():
    c = RecordedCollective
    ar = c("all_reduce", (0, 1), ((90,),), ("float32",))
    a = ScenarioOutcome("s", "fake", 2, [[ar], [ar]], None, None)
    b = dataclasses.replace(a, backend="gloo", collectives=[[ar], [ar, c("broadcast", (0, 1), ((7,),), ("int64",))]])
    assert compare(a, b) == ["rank 1: fake issued 1 collectives, gloo 2; first extra: "
                             "collective #1 gloo broadcast([(7,)], int64)"]
    assert compare(a, dataclasses.replace(b, world_size=3)) == ["world size: fake 2 vs gloo 3"]


# -- failures: reported, nothing left behind -----------------------------------------------------


def fail_on_rank_1(scenario, rank, world_size, device):
    """A train function that fails on rank 1 before any collective (picklable: module level)."""
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return TrainLoop()(scenario, rank, world_size, device)


def test_gloo_rank_failure_is_reported_with_its_traceback_and_leaves_no_processes_or_files(
        tmp_path, monkeypatch):
    # A private temporary directory: other xdist workers' gloo runs use the shared one meanwhile.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)gloo run of \[mlp\] on 2 ranks failed.*planted failure on rank 1"):
        run_scenario(zoo.get("mlp", depth=2, width=8), 2, backend="gloo", train=fail_on_rank_1,
                     timeout=120)
    assert multiprocessing.active_children() == []
    assert [d for d in os.listdir(tmp_path) if d.startswith("fakepg-conformance-")] == []


def test_run_scenario_rejects_unknown_backend_and_mismatched_train_list():
    sc = zoo.get("mlp", depth=2, width=8)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        run_scenario(sc, 2, backend="mpi")
    with pytest.raises(ValueError, match="as many scenarios"):
        run_scenario([sc, sc], 2, train=[None])
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        run_scenario(sc, 0)


def test_unpicklable_scenario_is_refused_before_any_process_starts():
    scenario = zoo.get("mlp", depth=2, width=8).with_(loss=lambda out, batch: out.sum())
    with pytest.raises(TypeError, match="do not pickle"):
        run_scenario(scenario, 2, backend="gloo")
