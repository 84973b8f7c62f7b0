"""simddp plan: the layouts it enumerates, the rules and memory that prune them, the captures
it shares, and what it reports (ranked table, JSON, whatif line, torchtitan TOML, Pareto front)."""

from __future__ import annotations

import functools
import json
import math
import tomllib

import pytest
from hypothesis import given, settings, strategies as st

from fakepg.zoo.llama import LLAMA3_70B, LLAMA3_TINY
from simddp.plan import Candidate, Layout, Shape, plan
from simddp.plan.report import pareto_front
from simddp.plan.space import layouts, rule_out, static_bytes

SHAPE_70B = Shape.of_llama("llama3-70b", LLAMA3_70B)


@pytest.fixture(scope="module")
def small():
    # up to 4 GPUs of 2 per node (fewer with the cost objective): tp 1/2, pp 1/2, FSDP or
    # HSDP; the tiny Llama captured for real
    return plan("llama3-tiny", gpus=4, gpus_per_node=2, gpu="h100", network="dgx-h100",
                seq_len=32, global_batch=8, max_pp=2, max_cp=1, ac_modes=("full",),
                objective="cost", microbatch_sizes=(1,))


def test_every_layout_lays_out_all_gpus_and_the_global_batch():
    for lay in layouts(SHAPE_70B, 256, gpus_per_node=8, seq_len=8192, global_batch=1024):
        assert lay.tp * lay.cp * lay.pp * lay.dp == 256
        assert lay.sequences_per_step == 1024


def test_without_a_pipeline_each_microbatch_size_up_to_the_local_batch_is_tried():
    lays = list(layouts(SHAPE_70B, 256, gpus_per_node=8, seq_len=8192, global_batch=1024,
                        ac_modes=("full",)))
    plain = {(lay.tp, lay.microbatch, lay.microbatches) for lay in lays
             if lay.pp == 1 and lay.flavour == "fsdp"}
    # torchtitan's 70B layout: FSDP 32 × TP 8, 32 sequences a data-parallel rank
    assert {(8, mb, 32 // mb) for mb in (1, 2, 4, 8, 16, 32)} <= plain
    assert max(mb for tp, mb, _ in plain if tp == 1) == 4  # 1,024 sequences on 256 ranks
    assert {lay.microbatch for lay in lays if lay.pp > 1} == {1}


def test_the_shape_counts_the_models_parameters():
    assert SHAPE_70B.params == LLAMA3_70B.num_params()
    assert Shape.of_llama("t", LLAMA3_TINY).params == LLAMA3_TINY.num_params()


def test_rules_say_why_a_layout_cannot_run():
    base = Layout(256, tp=8, pp=1, shard=32, microbatches=32)
    assert rule_out(base, SHAPE_70B, gpus_per_node=8, seq_len=8192) is None
    assert "spans nodes" in rule_out(base.replace(tp=16, shard=16), SHAPE_70B,
                                      gpus_per_node=8, seq_len=8192)
    few = Layout(256, tp=8, pp=8, shard=4, schedule="1F1B", microbatches=4)
    assert "at least one per rank" in rule_out(few, SHAPE_70B, gpus_per_node=8, seq_len=8192)
    deep = Layout(256, tp=1, pp=64, shard=4, schedule="Interleaved1F1B", stages_per_rank=4,
                  microbatches=64)
    assert "pipeline stages for 80 blocks" in rule_out(deep, SHAPE_70B, gpus_per_node=8,
                                                       seq_len=8192)


def test_static_memory_shrinks_with_every_sharding_dimension():
    one = static_bytes(Layout(8, shard=8), SHAPE_70B)
    assert one == 16 * SHAPE_70B.params // 8
    assert static_bytes(Layout(64, tp=8, shard=8), SHAPE_70B) == one // 8
    assert static_bytes(Layout(64, pp=8, shard=8, schedule="1F1B"), SHAPE_70B) < one // 4


def test_the_search_prunes_by_rules_then_memory_then_replays_the_rest(small):
    stages = {c.stage for c in small.candidates}
    assert stages <= {"rules", "memory", "replay"} and "replay" in stages
    for c in small.candidates:
        assert (c.feasible is False) == bool(c.reason) or c.reason == "OOM in the replay"
    assert small.facts["replayed"] == sum(c.stage == "replay" for c in small.candidates)


def test_layouts_that_differ_in_data_parallel_size_share_a_capture(small):
    assert small.facts["captures"] < small.facts["passed_rules"]


def test_the_top_layouts_fit_and_have_their_figures(small):
    assert all(c.feasible for c in small.top)
    assert all(c.peak_memory_bytes > 0 and 0 < c.mfu < 1 for c in small.top)


def test_the_json_holds_every_candidate_with_the_documented_fields(small, tmp_path):
    data = json.loads(open(small.to_json(tmp_path / "plan.json")).read())
    assert len(data["candidates"]) == len(small.candidates) and data["top"]
    for row in data["candidates"]:
        assert {"parallel", "feasible", "reason", "tokens_per_s_per_gpu", "mfu",
                "peak_memory_bytes"} <= set(row)


def test_the_toml_fragment_is_torchtitans_and_lays_out_the_gpus(small):
    for c in small.top:
        cfg = tomllib.loads(small.torchtitan_toml(c))
        p = cfg["parallelism"]
        assert math.prod([p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"],
                          p["tensor_parallel_degree"], p["context_parallel_degree"],
                          p["pipeline_parallel_degree"]]) == c.layout.gpus
        assert cfg["training"]["global_batch_size"] == 8


def test_each_winner_has_the_whatif_line_that_answers_for_it(small):
    line = small.whatif_line(small.top[0])
    assert line.startswith("simddp whatif llama3-tiny --parallel ")
    assert f"--parallel {small.top[0].parallel} --world-size {small.top[0].layout.gpus}" in line


def test_the_same_question_gives_the_same_answer():
    def ask():
        return plan("llama3-tiny", gpus=2, gpus_per_node=2, gpu="h100", network="dgx-h100",
                    seq_len=32, global_batch=4, max_pp=2, max_cp=1, ac_modes=("full",))
    assert [c.to_dict() for c in ask().candidates] == [c.to_dict() for c in ask().candidates]


def test_the_cost_objective_tries_fewer_gpus_and_ranks_by_tokens_per_gpu_second(small):
    assert {c.layout.gpus for c in small.candidates} == {4, 2, 1}
    tps = [c.tokens_per_s_per_gpu for c in small.top]
    assert tps == sorted(tps, reverse=True)


def test_the_pareto_plot_is_written(small, tmp_path):
    path = small.plot(tmp_path / "pareto.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.floats(1, 1e4)), min_size=1, max_size=30))
def test_no_layout_on_the_pareto_front_is_beaten_on_both_speed_and_memory(points):
    cands = [Candidate(Layout(8, shard=8), feasible=True, peak_memory_bytes=m,
                       tokens_per_s_per_gpu=t) for m, t in points]
    front = pareto_front(cands)
    for f in front:
        assert not any(c.peak_memory_bytes <= f.peak_memory_bytes and
                       c.tokens_per_s_per_gpu > f.tokens_per_s_per_gpu for c in cands)
    best = max(c.tokens_per_s_per_gpu for c in cands)
    assert front[-1].tokens_per_s_per_gpu == best


def test_the_command_line_prints_the_ranking_and_writes_json(tmp_path, capsys):
    from simddp.cli import main

    out = tmp_path / "plan.json"
    status = main(["plan", "llama3-tiny", "--gpus", "2", "--gpus-per-node", "2", "--seq-len",
                   "32", "--global-batch", "4", "--max-pp", "2", "--max-cp", "1",
                   "--activation-checkpointing", "full", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 0 and "the best layout as a what-if:" in text and "[parallelism]" in text
    assert json.loads(out.read_text())["top"]


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "out of range"),
    (["--gpus", "8", "--activation-checkpointing", "sometimes"], "give some of"),
])
def test_bad_plan_arguments_are_usage_errors_naming_the_accepted_values(argv, message, capsys):
    from simddp.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "llama3-tiny", "--global-batch", "4", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_time_to_tokens_without_a_token_count_says_what_to_add(capsys):
    from simddp.cli import main

    status = main(["plan", "llama3-tiny", "--global-batch", "4", "--gpus", "8",
                   "--objective", "time-to-tokens"])
    assert status == 1 and "needs --tokens" in capsys.readouterr().err


def test_the_winners_whatif_line_answers_with_the_same_step_time(small, tmp_path):
    import shlex

    from simddp.cli import main

    best = small.top[0]
    out = tmp_path / "rows.json"
    argv = shlex.split(small.whatif_line(best))[1:] + ["--no-progress", "--json", str(out)]
    assert main(argv) == 0
    row = json.loads(out.read_text())[0]
    steps = best.layout.microbatches if best.layout.pp == 1 else 1  # gradient accumulation
    assert row["iteration_time_s"] * steps == pytest.approx(best.step_time_s, rel=1e-9)


def test_layouts_differing_only_in_data_parallel_degree_share_one_capture_key():
    from simddp.plan.evaluate import capture_key

    a = Layout(256, tp=8, shard=32, microbatches=32)
    assert capture_key(SHAPE_70B, a) == capture_key(SHAPE_70B, a.replace(gpus=512, shard=64,
                                                                           microbatches=16))
    hsdp = Layout(256, tp=8, replicate=16, shard=2, microbatches=32)
    assert capture_key(SHAPE_70B, hsdp) == capture_key(SHAPE_70B, hsdp.replace(replicate=4,
                                                                                shard=8))
    assert capture_key(SHAPE_70B, a) != capture_key(SHAPE_70B, hsdp)  # HSDP's all-reduces
    assert capture_key(SHAPE_70B, a) != capture_key(SHAPE_70B, a.replace(tp=4, shard=64))
    assert capture_key(SHAPE_70B, a) != capture_key(SHAPE_70B, a.replace(ac="none"))


def test_pipelines_with_the_same_stage_count_share_a_capture_whatever_the_schedule():
    from simddp.plan.evaluate import capture_key

    def key(pp: int, schedule: str, v: int = 1):
        return capture_key(SHAPE_70B, Layout(256, tp=8, pp=pp, shard=32 // pp,
                                             schedule=schedule, stages_per_rank=v,
                                             microbatches=4 * pp * 8,
                                             reshard_after_forward=False))

    eight = {key(8, "1F1B"), key(8, "GPipe"), key(4, "Interleaved1F1B", 2),
             key(4, "LoopedBFS", 2)}
    assert len(eight) == 1 and next(iter(eight)).stages == 8
    assert key(4, "1F1B") != key(8, "1F1B")  # other stages hold other blocks


def _eight_layer_tiny(batch_size: int, n_layers: int | None = None, default_layers: int = 8):
    import dataclasses
    import functools

    from fakepg import zoo
    from fakepg.zoo.llama import Llama

    args = dataclasses.replace(LLAMA3_TINY, n_layers=n_layers or default_layers)
    return zoo.get("llama3-tiny", seq_len=32, batch_size=batch_size).with_(
        model=functools.partial(Llama, args))


def test_one_pipeline_capture_replays_every_schedule_and_depth_it_stands_for():
    # 8 blocks over 8 stages, torchtitan's split (embedding and head weigh a block): the
    # middle stages hold 2 or 1 blocks, so the capture must carry both kinds
    import dataclasses

    from simddp.models import Compute, Network
    from simddp.plan.evaluate import capture_key, evaluate_key
    from simddp.timing import Timing

    shape = Shape.of_llama("tiny-8", dataclasses.replace(LLAMA3_TINY, n_layers=8))
    net = Network.preset("dgx-h100")
    timing = Timing(network=net, compute=Compute.kernels("h100"))
    lays = [Layout(16, pp=8, shard=2, schedule="1F1B", microbatches=8, ac="full",
                   reshard_after_forward=False),
            Layout(16, pp=4, shard=4, schedule="Interleaved1F1B", stages_per_rank=2,
                   microbatches=8, ac="full", reshard_after_forward=False)]
    key = capture_key(shape, lays[0])
    assert key == capture_key(shape, lays[1])
    res = evaluate_key(key, lays, _eight_layer_tiny, timing, shape, net, 80 << 30)
    assert res["captured"]
    (s1, why1, row1), (s2, why2, row2) = res["results"]
    assert (s1, s2) == ("replay", "replay"), (why1, why2)
    assert row1["iteration_time_s"] > 0 and row2["iteration_time_s"] > 0
    assert row1["iteration_time_s"] != row2["iteration_time_s"]  # each its own schedule


def test_a_jobs_replay_of_the_program_it_planned_for_memory_is_a_replay_planned_anew():
    # evaluate_key plans each layout once (its memory verdict), replays that program, and
    # runs with the cyclic collector off: the row is replay_row's bit for bit, the
    # collector's state is given back
    import dataclasses
    import gc

    from simddp.models import Compute, Network
    from simddp.plan.evaluate import capture_key, default_capture, evaluate_key, replay_config
    from simddp.sweep import replay_row
    from simddp.timing import Timing

    shape = Shape.of_llama("tiny-8", dataclasses.replace(LLAMA3_TINY, n_layers=8))
    net = Network.preset("dgx-h100")
    timing = Timing(network=net, compute=Compute.kernels("h100"))
    lay = Layout(16, pp=4, shard=4, schedule="Interleaved1F1B", stages_per_rank=2,
                 microbatches=8, ac="full", reshard_after_forward=False)
    key = capture_key(shape, lay)
    assert gc.isenabled()
    (stage, why, row), = evaluate_key(key, [lay], _eight_layer_tiny, timing, shape, net,
                                      80 << 30)["results"]
    assert gc.isenabled()
    assert stage == "replay", why
    deep, config = replay_config(shape, lay, default_capture(key, _eight_layer_tiny, timing,
                                                             shape), net, (80 << 30) / 1e9)
    anew = replay_row(deep, config)
    assert {k: v for k, v in row.items() if k != "wall_time_s"} == \
        {k: v for k, v in anew.items() if k != "wall_time_s"}


def test_the_compute_bound_never_exceeds_what_a_replay_reaches(small):
    from simddp.plan.search import _bound

    compute = small.facts["probe_compute_s"]
    assert compute
    checked = 0
    for c in small.candidates:
        lay = c.layout
        c_mb = compute.get(f"tp:{lay.tp},ac:{lay.ac},microbatch:{lay.microbatch}")
        if c.stage == "replay" and c_mb:
            assert c.tokens_per_s_per_gpu <= _bound(lay, c_mb, 32) * (1 + 1e-9), lay.label()
            checked += 1
    assert checked >= 3


def test_layouts_the_bound_drops_say_so_and_are_not_counted_as_evaluated():
    res = plan("llama3-tiny", gpus=8, gpus_per_node=4, seq_len=64, global_batch=32,
               max_pp=4, max_cp=1, top=3)
    bounded = [c for c in res.candidates if c.stage == "bound"]
    assert len(bounded) == res.facts["bounded"] > 0
    assert all(c.feasible is False and "cannot reach the top 3" in c.reason for c in bounded)
    assert res.facts["evaluated"] == sum(c.stage in ("memory", "replay")
                                         for c in res.candidates)
    third = sorted(c.tokens_per_s_per_gpu for c in res.candidates if c.feasible)[-3]
    for c in bounded:  # the bound is below the top 3: no bounded layout could enter it
        ub = float(c.reason.split("at most ")[1].split(" tokens")[0].replace(",", ""))
        assert ub < third


@pytest.mark.parametrize("ac", ["none", "selective-op", "full"])
def test_the_memory_floor_never_exceeds_the_planned_peak(ac):
    # the probe's blocks' activations (8 identical blocks: the period shows) against the
    # step programs of pipelines and HSDP at the same TP degree and policy
    import dataclasses

    from simddp.models import Compute, Network
    from simddp.plan.evaluate import capture_key, evaluate_key
    from simddp.plan.search import memory_floor
    from simddp.timing import Timing

    shape = Shape.of_llama("tiny-8", dataclasses.replace(LLAMA3_TINY, n_layers=8))
    net = Network.preset("dgx-h100")
    timing = Timing(network=net, compute=Compute.kernels("h100"))
    probe = Layout(16, shard=16, microbatches=2, ac=ac)
    res = evaluate_key(capture_key(shape, probe), [probe], _eight_layer_tiny, timing, shape,
                       net, 80 << 30)
    blk = res["block_activation_bytes"]
    assert blk and blk > 0
    others = [Layout(16, pp=4, shard=4, schedule="1F1B", microbatches=8, ac=ac,
                     reshard_after_forward=False),
              Layout(16, pp=8, shard=2, schedule="GPipe", microbatches=8, ac=ac,
                     reshard_after_forward=False),
              Layout(16, pp=4, shard=4, schedule="Interleaved1F1B", stages_per_rank=2,
                     microbatches=8, ac=ac, reshard_after_forward=False),
              Layout(16, replicate=4, shard=4, microbatches=2, ac=ac),
              Layout(16, shard=16, microbatch=2, ac=ac)]  # a block saves per sequence
    for lay in others:
        (stage, why, fig), = evaluate_key(capture_key(shape, lay), [lay], _eight_layer_tiny,
                                          timing, shape, net, 80 << 30)["results"]
        assert stage == "replay", why
        assert memory_floor(lay, shape, blk) <= fig["peak_memory_bytes"], lay.label()


@pytest.mark.parametrize("tp,ac,hsdp", [(1, "full", False), (2, "selective-op", True)])
def test_a_deepened_shallow_capture_replays_as_the_whole_models_capture(tp, ac, hsdp):
    # 16 blocks captured on 8 and deepened (a middle block's collectives, compute and saved
    # activations repeated) against the capture of all 16: step time within 0.5 %, the same
    # planned and replayed peak memory (measured on Llama 3 8B and 70B: docs/plan.md)
    import dataclasses

    from simddp.cosim.deepen import SHALLOW_STEP_BLOCKS
    from simddp.models import Compute, Network
    from simddp.plan.evaluate import capture_key, default_capture, memory_verdict, replay_config
    from simddp.sweep import replay_row
    from simddp.timing import Timing

    layers = 2 * SHALLOW_STEP_BLOCKS
    shape = Shape.of_llama("tiny-16", dataclasses.replace(LLAMA3_TINY, n_layers=layers))
    net = Network.preset("dgx-h100")
    timing = Timing(network=net, compute=Compute.kernels("h100"))
    lay = Layout(16, tp=tp, replicate=2 if hsdp else 1, shard=16 // tp // (2 if hsdp else 1),
                 microbatch=2, ac=ac)
    scenario = functools.partial(_eight_layer_tiny, default_layers=layers)
    got = {}
    for shallow in (True, False):
        cap = default_capture(capture_key(shape, lay), scenario, timing, shape, shallow=shallow)
        deep, config = replay_config(shape, lay, cap, net, 80.0)
        got[shallow] = memory_verdict(deep, config)[0], replay_row(deep, config), deep
    (planned, row, deep), (planned_full, row_full, full) = got[True], got[False]
    assert "deepened from 8 to 16 blocks" in deep.name and "deepened" not in full.name
    assert (deep.param_bytes, deep.local_param_bytes) == (full.param_bytes,
                                                           full.local_param_bytes)
    assert deep.activation_sizes == full.activation_sizes
    # the optimizer's state is scaled with the parameters (Adam's step counters: a few bytes)
    assert deep.optimizer_state_bytes == pytest.approx(full.optimizer_state_bytes, rel=1e-3)
    assert planned == pytest.approx(planned_full, rel=1e-5)
    assert row["peak_memory_bytes"] == pytest.approx(row_full["peak_memory_bytes"], rel=1e-5)
    assert row["iteration_time_s"] == pytest.approx(row_full["iteration_time_s"], rel=5e-3)
