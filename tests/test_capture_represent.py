"""Representative capture (simddp.cosim.represent): one rank per distinct role runs on the meta
device, fakepg answers its groups' collectives for the absent ranks, and the capture is the one
the whole world gives; a deep pipeline is a shallow one deepened (simddp.cosim.deepen)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from fakepg import zoo
from fakepg.zoo.llama import LLAMA3_TINY, Llama
from simddp import Compute, Network, Timing
from simddp.cosim import represent
from simddp.cosim.capture_fsdp import capture_fsdp
from simddp.cosim.capture_pp import capture_pp
from simddp.cosim.deepen import capture_pipeline, shallow_plan
from simddp.replay import replay

TIMING = Timing(network=Network.preset("dgx-h100"), compute=Compute.roofline("h100"))
# heads that 4-way tensor parallelism divides
ARGS = dataclasses.replace(LLAMA3_TINY, n_heads=8, n_kv_heads=4)


def _tiny(n_layers: int = 2, batch_size: int = 2):
    args = dataclasses.replace(ARGS, n_layers=n_layers)
    return zoo.get("llama3-tiny", batch_size=batch_size).with_(
        model=functools.partial(Llama, args))


def _same(a, b, path="capture"):
    """Equal, floats to rounding: a full world's symmetric ranks themselves differ in the last
    bit (a rank that completes a collective at its issue re-bases its clock; the one that
    waits for it does so later), so the representative is one of them to rounding."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _cost(fn):
    """(result, rank programs the capture ran)."""
    before = represent.executed()
    out = fn()
    return out, represent.executed() - before


def test_stand_ins_keep_the_pipeline_coordinate_and_zero_the_symmetric_ones():
    table = represent.stand_ins({"pp": 2, "shard": 2, "tp": 2})
    assert table == {1: 0, 2: 0, 3: 0, 5: 4, 6: 4, 7: 4}
    assert represent.stand_ins({"pp": 3}) == {}


@pytest.mark.slow  # the whole world of 8 ranks, for the comparison
def test_hsdp_tp_capture_of_one_rank_equals_the_whole_worlds():
    mesh = {"replicate": 2, "shard": 2, "tp": 2}
    kw = dict(timing=TIMING, mesh=mesh, device="meta", param_dtype="bf16")
    full, full_cost = _cost(lambda: capture_fsdp(_tiny(), 8, representatives=False, **kw))
    rep, rep_cost = _cost(lambda: capture_fsdp(_tiny(), 8, representatives=True, **kw))
    assert dataclasses.asdict(rep) == dataclasses.asdict(full)  # bitwise, every rank's profile
    assert (full_cost, rep_cost) == (8 + 2, 1 + 1)  # the step's world, then the TP activations


def test_fsdp_tp_capture_cost_does_not_grow_with_the_tp_degree():
    costs = {}
    for tp in (2, 4):
        cap, costs[tp] = _cost(lambda: capture_fsdp(_tiny(), 2 * tp, timing=TIMING, device="meta",
                                                    mesh={"shard": 2, "tp": tp}))
        assert len(cap.profiles) == 2 * tp
        assert sum(e["scope"] == "tp" for e in cap.profiles[2 * tp - 1]["forward"]["events"])
    assert costs[2] == costs[4] == 2


@pytest.mark.slow  # the whole world of 8 ranks, for the comparison
def test_pipeline_with_fsdp_and_tp_inside_runs_one_rank_a_stage_and_captures_the_same():
    kw = dict(schedule="Interleaved1F1B", stages_per_rank=2, microbatches=4, timing=TIMING,
              mesh={"shard": 2, "tp": 2}, device="meta", input_weight=1, output_weight=1)
    full, full_cost = _cost(lambda: capture_pp(_tiny(batch_size=4), 2, representatives=False,
                                               **kw))
    rep, rep_cost = _cost(lambda: capture_pp(_tiny(batch_size=4), 2, representatives=True, **kw))
    _same(dataclasses.asdict(rep), dataclasses.asdict(full))
    assert (full_cost, rep_cost) == (8 + 2, 2 + 1)
    a = replay(full, network="dgx-h100", progress=False)
    b = replay(rep, network="dgx-h100", progress=False)
    assert b.iteration_time == pytest.approx(a.iteration_time, rel=1e-12)


def test_ranks_that_are_not_symmetric_are_all_run_or_refused():
    jittery = dataclasses.replace(TIMING, jitter=0.1)
    with pytest.raises(ValueError, match="jitter draws each rank's noise apart"):
        capture_fsdp(_tiny(), 4, timing=jittery, mesh={"shard": 2, "tp": 2}, device="meta",
                     representatives=True)
    with pytest.raises(ValueError, match="needs the meta device"):
        capture_fsdp(_tiny(), 4, timing=TIMING, mesh={"shard": 2, "tp": 2},
                     representatives=True)
    # 3 nodes of 4 GPUs under shard 3 × tp 2: the shard groups [0, 2, 4] and [1, 3, 5] span
    # nodes alike, but tp 2 × shard 6 on nodes of 3 splits some TP pairs across nodes
    assert represent.symmetric_placement({"shard": 3, "tp": 2}, 4) is None
    assert "tp groups" in represent.symmetric_placement({"shard": 6, "tp": 2}, 3)
    _, cost = _cost(lambda: capture_fsdp(_tiny(), 4, timing=jittery, mesh={"shard": 2, "tp": 2},
                                         device="meta"))
    assert cost == 4 + 1  # jitter: every rank of the step runs


def test_a_deep_pipeline_is_its_shallow_capture_deepened():
    # torchtitan's split of 8 blocks (+ embedding and head weighing one each) on 6 stages:
    # [emb+1] [2] [2] [2] [1] [head] — two kinds of middle stage; 4 stages hold every role:
    # [emb+1] [2] [1] [head]
    assert shallow_plan(8, 6, 1, "1F1B", input_weight=1, output_weight=1) == (4, 4)
    kw = dict(schedule="1F1B", microbatches=6, input_weight=1, output_weight=1, timing=TIMING)
    full = capture_pp(_tiny(8, batch_size=6), 6, **kw)
    deep, cost = _cost(lambda: capture_pipeline(_tiny(8, batch_size=6), 6, **kw))
    assert cost == 4 + 1  # the shallow pipeline's ranks (then the activations), not the deep's
    assert [s["layers"] for s in deep.stages] == [s["layers"] for s in full.stages]
    drop = ("name", "stages", "cosim_iteration_time", "cosim_exposed_comm")
    _same({k: v for k, v in dataclasses.asdict(deep).items() if k not in drop},
          {k: v for k, v in dataclasses.asdict(full).items() if k not in drop})
    for a, b in zip(deep.stages, full.stages):
        _same(a, b, f"stage {a['stage']}")
    x = replay(full, network="dgx-h100", progress=False).iteration_time
    assert replay(deep, network="dgx-h100", progress=False).iteration_time == \
        pytest.approx(x, rel=1e-12)


def test_pipeline_capture_cost_does_not_grow_with_the_pipeline_depth():
    costs = {}
    for pp in (4, 8):  # 2 blocks a stage, the ends one: 2·pp − 2 blocks
        cap, costs[pp] = _cost(lambda: capture_pipeline(
            _tiny(2 * pp - 2, batch_size=pp), pp, schedule="1F1B", microbatches=pp,
            input_weight=1, output_weight=1, timing=TIMING, device="meta"))
        assert len(cap.stages) == pp and cap.microbatches == pp
        assert all(len(st["actions"]["F"]) == pp for st in cap.stages)
    assert costs[4] == costs[8] == 3 + 1


def test_fakepg_answers_an_absent_members_part_with_its_stand_ins_call():
    import torch
    import torch.distributed as dist

    import fakepg

    def run(rank):
        t = torch.empty(1024, device="meta")
        dist.all_reduce(t)  # a group of 4, one of them runs
        pair = dist.new_group([0, 2])
        dist.broadcast(t[:256], src=2, group=pair)  # its stand-in's part is the root's
        return t.shape

    res = fakepg.spawn(represent.represented(run, {1: 0, 2: 0, 3: 0}), nprocs=4)
    assert res.returns == [torch.Size([1024]), None, None, None]
    assert [(r.op, r.group_ranks, r.bytes, r.state) for r in res.trace[0]] == [
        ("all_reduce", (0, 1, 2, 3), 4096, "completed"),
        ("broadcast", (0, 2), 1024, "completed")]
    assert res.trace[1:] == [[], [], []]  # absent ranks record nothing of their own

    def send(rank):
        dist.send(torch.empty(4, device="meta"), dst=1)

    with pytest.raises(fakepg.RankFailedError, match="rank 1, which does not run in this world"):
        fakepg.spawn(represent.represented(send, {1: 0}), nprocs=2)
