"""The pipeline planner replays real pipeline captures (simddp.cosim.capture_pp): at the
capture's own world, schedule and microbatches the replay agrees with the co-simulation that
recorded it; from one capture, other microbatch counts and schedules replay with the textbook
bubble trend."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from fakepg.zoo import llama, workloads
from simddp import Compute, Network, Timing
from simddp.cosim.capture_pp import capture_pp
from simddp.program import Knobs, plan
from simddp.replay import replay

ARGS = dataclasses.replace(llama.LLAMA3_TINY, n_layers=8)  # 8 blocks: pp=4 × 2 stages a rank
SCENARIO = workloads.llama3_tiny(batch_size=4, seq_len=16).with_(
    model=functools.partial(llama.Llama, ARGS))
# co-simulation costs the network's α–β model as it is: replay compares with it with NCCL's
# tuning model and the GPU's contention (on by default on NCCL presets) switched off
AS_COSIM = dict(protocol_latency=False, gpu_contention="off")
TIMING = Timing(network=Network.preset("ib-ndr", gpus_per_node=8),
                compute=Compute.roofline("h100"))
AGREE = 0.01  # replay vs co-simulation, relative
# (pp, schedule, stages per rank, mesh inside a stage)
CASES = [(2, "GPipe", 1, {}), (4, "1F1B", 1, {}), (2, "Interleaved1F1B", 2, {}),
         (4, "Interleaved1F1B", 2, {}), (2, "LoopedBFS", 2, {}),
         (4, "InterleavedZeroBubble", 2, {}), (2, "ZBVZeroBubble", 2, {}),
         (2, "DualPipeV", 2, {}), (4, "1F1B", 1, {"shard": 2}),
         (2, "GPipe", 1, {"shard": 2, "tp": 2})]
# tensor parallelism: replay waits for each TP collective where it is issued (a GPU's compute
# stream), where the fake cluster's CPU ranks run a few cheap ops (funcol's wrappers) before
# they read it — tests/test_simddp_tp.py's reason: the replay is slower, by less than this
TP = 0.02
TP_CASES = [(2, "1F1B", 1, {"tp": 2}), (2, "Interleaved1F1B", 2, {"tp": 2})]
# multi-stage schedules with FSDP2: the co-simulated CPU ranks wait for each reduce-scatter of
# REDUCE_GRAD (and each UNSHARD all-gather before the next compute) where the replay lets them
# run behind the other stage's compute, as a GPU's streams do: the replay is faster, by less
# than this
FSDP_MULTI = 0.02
FSDP_MULTI_CASES = [(2, "Interleaved1F1B", 2, {"shard": 2}), (2, "DualPipeV", 2, {"shard": 2})]


def _ids(cases):
    return [f"pp{c[0]}-{c[1]}-{'-'.join(f'{k}{v}' for k, v in c[3].items())}" for c in cases]


@functools.cache
def _capture(pp, schedule, spr, mesh):
    return capture_pp(SCENARIO, pp, schedule=schedule, stages_per_rank=spr, timing=TIMING,
                      mesh=dict(mesh))


def cap_of(pp, schedule, spr, mesh):
    return _capture(pp, schedule, spr, tuple(sorted(mesh.items())))


@pytest.mark.parametrize("pp,schedule,spr,mesh", CASES, ids=_ids(CASES))
def test_replay_at_the_captures_own_world_agrees_with_its_co_simulation(pp, schedule, spr, mesh):
    cap = cap_of(pp, schedule, spr, mesh)
    res = replay(cap, progress=False, **AS_COSIM)
    assert res.iteration_time == pytest.approx(cap.cosim_iteration_time, rel=AGREE)


@pytest.mark.parametrize("pp,schedule,spr,mesh", TP_CASES, ids=_ids(TP_CASES))
def test_replay_of_tensor_parallel_stages_is_slower_than_co_simulation_by_little(
        pp, schedule, spr, mesh):
    cap = cap_of(pp, schedule, spr, mesh)
    res = replay(cap, progress=False, **AS_COSIM)
    assert cap.cosim_iteration_time <= res.iteration_time <= cap.cosim_iteration_time * (1 + TP)


@pytest.mark.parametrize("pp,schedule,spr,mesh", FSDP_MULTI_CASES, ids=_ids(FSDP_MULTI_CASES))
def test_multi_stage_fsdp_replay_hides_what_cpu_ranks_wait_for_and_no_more(pp, schedule, spr,
                                                                            mesh):
    cap = cap_of(pp, schedule, spr, mesh)
    res = replay(cap, progress=False, **AS_COSIM)
    assert cap.cosim_iteration_time * (1 - FSDP_MULTI) < res.iteration_time \
        < cap.cosim_iteration_time


def test_multi_stage_fsdp_replays_the_unshard_and_reduce_grad_actions():
    cap = cap_of(2, "Interleaved1F1B", 2, {"shard": 2})
    assert all(st["unshard"] and st["reduce_grad"]["events"] for st in cap.stages)
    prog = plan(cap, Knobs().checked(cap.world_size, cap.network_model()))
    tags = [c.tag for ins in prog.iteration(0, 0) for c in _collectives(ins)]
    assert sum(t[0] == "U" for t in tags) == sum(len(st["unshard"][0]["events"])
                                               for st in cap.stages if st["rank"] == 0)
    assert sum(t[0] == "bc" and t[1] == "R" for t in tags) == sum(
        len(st["reduce_grad"]["events"]) for st in cap.stages if st["rank"] == 0)
    # each reduce-scatter in flight once issued, not waited for until the optimizer
    res = replay(cap, progress=False, **AS_COSIM)
    lane = res.timeline.lanes[0]
    assert not [label for kind, _, _, label in lane.spans
                if kind == "wait" and "reduce_scatter" in (label or "")]


def _collectives(ins):
    marks = getattr(ins, "marks", None)
    if marks is not None:
        return [c for m in marks for c, _ in getattr(m.do, "stages", ())]
    return [c for c, _ in getattr(ins, "stages", ())]


def test_memory_per_rank_is_the_stages_unsharded_parameters_over_tp_times_shard():
    cap = cap_of(2, "GPipe", 1, {"shard": 2, "tp": 2})
    model_bytes = sum(p.numel() * p.element_size() for p in llama.Llama(ARGS).parameters())
    assert cap.param_bytes == model_bytes  # recorded unsharded, before TP and FSDP
    prog = plan(cap, Knobs().checked(cap.world_size, cap.network_model()))
    for c in range(cap.pp):
        mine = [st for st in cap.stages if st["rank"] == c]
        assert prog.static_memory(c)["parameters"] == sum(st["param_bytes"] // 4 for st in mine)
    peak, at_peak = prog.memory()
    assert at_peak["activations"] > 0 and peak > sum(prog.static_memory(0).values())
    # FSDP2's all-gathered (unsharded, tp-split) parameters are held during the step
    assert at_peak["parameters"] > prog.static_memory(0)["parameters"]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_more_microbatches_from_one_capture_shrink_the_bubble(schedule):
    cap = cap_of(4, "1F1B", 1, {})
    bubbles = [max(replay(cap, progress=False, pp_schedule=schedule,
                          microbatches=m).bubble_fraction) for m in (4, 8, 16, 32)]
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > bubbles[-1] + 0.15


def test_one_zero_bubble_capture_replays_other_multi_stage_schedules():
    cap = cap_of(4, "InterleavedZeroBubble", 2, {})
    zb = replay(cap, progress=False)
    for schedule in ("Interleaved1F1B", "LoopedBFS"):  # backward as I then W, no zero bubble
        other = replay(cap, progress=False, pp_schedule=schedule)
        assert other.iteration_time > zb.iteration_time
        assert max(other.bubble_fraction) > max(zb.bubble_fraction)
    four, eight = (max(replay(cap, progress=False, pp_schedule="Interleaved1F1B",
                              microbatches=m).bubble_fraction) for m in (4, 8))
    assert eight < four
