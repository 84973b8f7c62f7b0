"""Pipeline-parallel replay: torch's schedules, p2p between stages, bubbles and memory
(simddp.program.schedules, simddp.program.pipeline)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from simddp.models import Network
from simddp.program import CapturedStep, Knobs, plan
from simddp.program.pipeline import uniform_pipeline
from simddp.program.schedules import schedule_ops, stage_ranks
from simddp.replay import replay

FREE = Network(bandwidth_GBps=1e9, latency_us=0.0)  # p2p and collectives take no time
EXACT = 1e-12


def bubbles(cap, **kw):
    r = replay(cap, network=kw.pop("network", FREE), progress=False, **kw)
    return r, r.bubble_fraction


# -- the schedules are torch's -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                  "ZBVZeroBubble", "DualPipeV"])
def test_multi_stage_compute_order_is_torchs_lowered_list(name):
    ours = schedule_ops(name, 4, 8, 2)
    theirs = get_schedule_ops(name, 4, 8, 2, with_comms=True)
    for r in range(4):
        flat = []
        for a in theirs[r]:
            subs = a.sub_actions if a.computation_type.name == "OVERLAP_F_B" else (a,)
            flat += [(str(x.computation_type.name), x.stage_index, x.microbatch_index)
                     for x in subs]
        want = [(k, s, mb) for k, s, mb in flat if k in
                ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")]
        names = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT",
                 "W": "BACKWARD_WEIGHT"}
        got = [(names[o.kind], o.stage, o.mb) for o in ours[r] if o.kind in names]
        assert got == want


def test_runtime_waits_each_receive_right_before_its_compute_and_sends_at_the_end():
    ops = schedule_ops("Interleaved1F1B", 2, 4, 2)[1]
    for j, o in enumerate(ops):
        if o.kind == "wait":  # the compute that consumes it comes next
            nxt = ops[j + 1]
            assert nxt.kind in ("F", "B", "I") and nxt.mb == o.mb
    tail = [o.kind for o in ops[-sum(o.kind == "send" for o in ops):]]
    assert set(tail) == {"wait_send"}


def test_multi_stage_schedules_keep_torchs_unshard_reshard_and_reduce_grad_in_place():
    ops = schedule_ops("Interleaved1F1B", 2, 4, 2)[0]
    theirs = [(a.computation_type.name, a.stage_index)
              for a in get_schedule_ops("Interleaved1F1B", 2, 4, 2, with_comms=True)[0]
              if a.computation_type.name in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
    names = {"unshard": "UNSHARD", "reshard": "RESHARD", "reduce_grad": "REDUCE_GRAD"}
    assert [(names[o.kind], o.stage) for o in ops if o.kind in names] == theirs
    kinds = [o.kind for o in ops]
    assert kinds.index("unshard") < kinds.index("F")  # each stage unshards before computing
    last_b = max(j for j, o in enumerate(ops) if o.kind == "B" and o.stage == 0)
    assert ops[last_b + 1].kind == "reduce_grad" and ops[last_b + 1].stage == 0


def test_v_schedules_hand_adjacent_stages_over_on_the_same_rank_without_p2p():
    ops = schedule_ops("ZBVZeroBubble", 4, 8, 2)
    where = stage_ranks(ops)
    assert where[3] == where[4] == 3  # the V's turn
    p2p = [o for o in ops[3] if o.kind in ("post", "send")]
    assert not [o for o in p2p if o.what == "F" and o.stage == 3]
    assert not [o for o in p2p if o.what == "B" and o.stage == 4]


def test_gpipe_receives_just_before_each_compute_and_waits_forward_sends_before_backward():
    ops = [(o.kind, o.what, o.mb) for o in schedule_ops("GPipe", 3, 2, 1)[1]]
    assert ops == [("post", "F", 0), ("wait", "F", 0), ("F", "", 0), ("send", "F", 0),
                   ("post", "F", 1), ("wait", "F", 1), ("F", "", 1), ("send", "F", 1),
                   ("wait_send", "F", 0), ("wait_send", "F", 1),
                   ("post", "B", 0), ("wait", "B", 0), ("B", "", 0), ("send", "B", 0),
                   ("post", "B", 1), ("wait", "B", 1), ("B", "", 1), ("send", "B", 1),
                   ("wait_send", "B", 0), ("wait_send", "B", 1),
                   ("reduce_grad", "", 0)]  # perform_reduce_grad: last, after every wait


def test_1f1b_fuses_a_send_with_the_next_receive_and_waits_both():
    ops = [(o.kind, o.what, o.mb) for o in schedule_ops("1F1B", 2, 3, 1)[0]]
    # stage 0 of 2: warm-up F0, F1 (the last warm-up send held), then [send F1, recv B0]
    i = ops.index(("send", "F", 1))
    assert ops[i:i + 4] == [("send", "F", 1), ("post", "B", 0), ("wait_send", "F", 1),
                            ("wait", "B", 0)]


def test_schedule_combinations_torch_refuses_are_errors_with_torchs_reason():
    with pytest.raises(ValueError, match="must be greater than or equal"):
        schedule_ops("1F1B", 4, 2, 1)
    with pytest.raises(ValueError, match="single-stage schedule: stages_per_rank must be 1"):
        schedule_ops("GPipe", 4, 8, 2)
    with pytest.raises(ValueError, match="multi-stage schedule"):
        schedule_ops("Interleaved1F1B", 4, 8, 1)
    with pytest.raises(ValueError, match="unknown pp_schedule 'Zigzag'.*GPipe, 1F1B"):
        schedule_ops("Zigzag", 4, 8, 1)


# -- bubbles: the closed forms -------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 6), (4, 4), (4, 8), (8, 16)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    tf, tb = 1.0, 2.0
    r, b = bubbles(uniform_pipeline(p, m, tf, tb, schedule=schedule))
    assert r.iteration_time == pytest.approx((m + p - 1) * (tf + tb), abs=EXACT)
    assert len(b) == p
    for x in b:
        assert x == pytest.approx((p - 1) / (m + p - 1), abs=EXACT)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (2, 3, 2), (4, 8, 2), (4, 6, 2), (4, 5, 2),
                                   (4, 8, 3), (3, 6, 2)])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(schedule, p, m, v):
    # the same model cut into v × more stages: each virtual stage takes 1/v of a stage's time
    tf, tb = 1.0, 2.0
    _, b = bubbles(uniform_pipeline(p, m, tf / v, tb / v, stages_per_rank=v,
                                    schedule=schedule))
    for x in b:
        assert x == pytest.approx((p - 1) / (v * m + p - 1), abs=EXACT)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (3, 6, 2), (4, 8, 3), (2, 6, 3)])
def test_interleaved_zero_bubble_idles_p_minus_1_times_f_plus_i_minus_w(p, m, v):
    f, i, w = 1.0, 1.5, 0.7  # one virtual stage's forward, input- and weight-gradient times
    r, b = bubbles(uniform_pipeline(p, m, f, i, weight_s=w, stages_per_rank=v,
                                    schedule="InterleavedZeroBubble"))
    work = m * v * (f + i + w)
    assert r.iteration_time == pytest.approx(work + (p - 1) * (f + i - w), abs=1e-9)
    for x in b:
        assert x == pytest.approx((p - 1) * (f + i - w) / r.iteration_time, abs=1e-9)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_zero_bubble_schedules_bubble_below_1f1b(schedule, p, m):
    tf, tb = 1.0, 2.0  # the same model; the zero-bubble schedules split backward in halves
    _, ref = bubbles(uniform_pipeline(p, m, tf, tb, schedule="1F1B"))
    _, zb = bubbles(uniform_pipeline(p, m, tf / 2, tb / 4, weight_s=tb / 4,
                                     stages_per_rank=2, schedule=schedule))
    assert max(zb) < min(ref)


def test_gpipe_exposes_each_receive_because_torch_posts_it_right_before_the_compute():
    # ScheduleGPipe posts a receive only when it is about to compute on it, and a transfer
    # starts once both sides are there: the first microbatch crosses p - 1 hops each way, and
    # each of the m - 1 others waits one transfer more at the stage that finishes last.
    p, m, tf, tb = 4, 6, 1.0, 2.0
    net = Network(bandwidth_GBps=1e9, latency_us=50_000.0)  # 0.05 s per message, < tf
    c = net.collective_time("send", 0, 2)
    assert c > 0
    r, _ = bubbles(uniform_pipeline(p, m, tf, tb, schedule="GPipe"), network=net)
    assert r.iteration_time == pytest.approx((m + p - 1) * (tf + tb) + 2 * (m + p - 2) * c,
                                             abs=1e-9)
    sends = [x for x in r.collectives if x["op"] == "send"]
    assert len(sends) == 2 * (p - 1) * m and {x["members"] for x in sends} == {2}


# -- the capture's profiles, knobs and refusals --------------------------------------------------
def test_a_split_capture_replays_full_backward_as_input_then_weight():
    p, m, f, i, w = 4, 8, 1.0, 1.25, 0.75
    full, _ = bubbles(uniform_pipeline(p, m, f, i + w, schedule="1F1B"))
    split, _ = bubbles(uniform_pipeline(p, m, f, i, weight_s=w, stages_per_rank=2,
                                        schedule="ZBVZeroBubble"),
                       pp_schedule="Interleaved1F1B")
    # interleaved over 2 virtual stages of the same per-stage times: the closed form
    assert split.bubble_fraction[0] == pytest.approx((p - 1) / (2 * m + p - 1), abs=EXACT)
    assert full.iteration_time == pytest.approx((m + p - 1) * (f + i + w), abs=EXACT)


def test_a_full_backward_capture_refuses_a_schedule_that_splits_backward():
    cap = uniform_pipeline(4, 8, 1.0, 2.0, stages_per_rank=2)
    with pytest.raises(ValueError, match="splits backward.*full backward computed both"):
        replay(cap, network=FREE, progress=False, pp_schedule="InterleavedZeroBubble")


def test_microbatches_and_schedule_may_differ_from_the_capture():
    cap = uniform_pipeline(4, 8, 1.0, 2.0, schedule="1F1B")
    r, b = bubbles(cap, pp_schedule="gpipe", microbatches=12)
    assert b[0] == pytest.approx(3 / 15, abs=EXACT)
    row = r.row()
    assert (row["pp_schedule"], row["microbatches"], row["stages_per_rank"]) == ("GPipe", 12, 1)
    assert row["bubble_fraction"] == max(b)


def test_rows_show_the_captured_schedule_when_no_knob_is_given():
    r, b = bubbles(uniform_pipeline(4, 8, 1.0, 2.0, stages_per_rank=2))
    row = r.row()
    assert (row["pp_schedule"], row["microbatches"]) == ("Interleaved1F1B", 8)
    assert row["bubble_fraction_mean"] == pytest.approx(sum(b) / len(b))


@pytest.mark.parametrize("kw,match", [
    (dict(parallel="pp:2,tp:2"), "pp and tp must be too"),
    (dict(stages_per_rank=2), "captured with 1 stages per rank"),
    (dict(pp_schedule="Zigzag"), "unknown pp_schedule"),
    (dict(microbatches=0), "microbatches"),
    (dict(comm_hook="fp16"), "do not apply to a pipeline replay"),
    (dict(reshard_after_forward=True), "each needs its own capture"),
])
def test_replay_refuses_what_the_capture_cannot_say(kw, match):
    cap = uniform_pipeline(4, 8, 1.0, 2.0)
    with pytest.raises(ValueError, match=match):
        replay(cap, network=FREE, progress=False, **kw)


def test_data_parallelism_needs_a_capture_with_data_parallelism():
    cap = uniform_pipeline(4, 8, 1.0, 2.0)
    with pytest.raises(ValueError, match="no data parallelism inside its stages"):
        replay(cap, 16, network=FREE, progress=False)


def test_pipeline_knobs_on_a_non_pipeline_capture_are_refused():
    cap = CapturedStep(name="x", parallel="fsdp", world_size=2, mesh={"shard": 2},
                       reshard_after_forward=True, param_dtype=None, reduce_dtype=None,
                       profiles=[], param_bytes=0, optimizer_state_bytes=0, activation_bytes=0)
    with pytest.raises(ValueError, match="pipeline knobs apply to a pipeline capture"):
        plan(cap, Knobs(pp_schedule="1F1B").checked(2, FREE))


def test_the_vectorised_engine_names_pipeline_parallelism():
    cap = uniform_pipeline(2, 4, 1.0, 2.0)
    with pytest.raises(ValueError, match="not vectorised: pipeline parallelism"):
        replay(cap, network=FREE, progress=False, engine="vector")


@pytest.mark.parametrize("kw,match", [(dict(pp=1), "pp"), (dict(microbatches=0), "microbatches"),
                                      (dict(forward_s=-1.0), "forward_s")])
def test_uniform_pipeline_bad_input(kw, match):
    args = dict(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0) | kw
    with pytest.raises(ValueError, match=match):
        uniform_pipeline(**args)


# -- 3-D worlds: classes, memory, determinism ----------------------------------------------------
def _three_d():
    return uniform_pipeline(4, 8, 1e-3, 2e-3, tp=2, tp_allreduces=3, tp_bytes=1 << 20,
                            shard=2, param_bytes=1 << 26, send_bytes=1 << 20,
                            activation_bytes=1 << 24, optimizer_s=1e-4,
                            optimizer_state_bytes=1 << 25)


def test_ranks_of_one_pipeline_rank_replay_as_one_class_bit_for_bit():
    net = Network.preset("dgx-h100")
    a = replay(_three_d(), 64, network=net, progress=False)
    b = replay(_three_d(), 64, network=net, progress=False, per_rank=True)
    assert [n for _, n in a.timeline.classes()] == [16] * 4
    assert a.iteration_times == b.iteration_times
    assert a.bubble_fraction == b.bubble_fraction
    assert a.to_json() == replay(_three_d(), 64, network=net, progress=False).to_json()


def test_in_stage_collectives_run_on_their_own_communicators():
    r = replay(_three_d(), 64, network=Network.preset("dgx-h100"), progress=False)
    by_op = {}
    for c in r.collectives:
        by_op.setdefault(c["op"], set()).add(c["members"])
    assert by_op == {"all_reduce": {2}, "all_gather_into_tensor": {8},
                     "reduce_scatter_tensor": {8}, "send": {2}}


@pytest.mark.parametrize("schedule,in_flight", [("GPipe", [8, 8, 8, 8]),
                                                ("1F1B", [4, 3, 2, 1])])
def test_activations_per_microbatch_in_flight(schedule, in_flight):
    act = 1 << 20
    cap = uniform_pipeline(4, 8, 1.0, 2.0, activation_bytes=act, param_bytes=1 << 24,
                           schedule=schedule)
    from simddp.program.pipeline import PipelineProgram

    prog = PipelineProgram(cap, Knobs().checked(4, FREE))
    for rank, n in enumerate(in_flight):
        peak, cats = prog.memory(rank)
        assert cats["activations"] == n * act
        # the parameters, and their gradients from the first backward on (no FSDP: kept)
        assert peak == n * act + 2 * (1 << 24)
    r = replay(cap, network=FREE, progress=False)
    # torch's max_memory_allocated: 512-byte multiples, expandable segments split exactly
    assert r.peak_memory_allocated_bytes == max(in_flight) * act + 2 * (1 << 24)
    assert r.peak_memory_bytes >= r.peak_memory_allocated_bytes  # reserved


@pytest.mark.parametrize("schedule,in_flight", [("GPipe", [8, 8, 8, 8]),
                                                ("1F1B", [4, 3, 2, 1]),
                                                ("ZBVZeroBubble", None)])
def test_activation_checkpointing_adds_one_blocks_recompute_to_the_microbatches_in_flight(
        schedule, in_flight):
    """With full AC a stage's activations per microbatch are its blocks' inputs; a backward
    (B, or I when split) holds one block's recomputed activations on top while it runs."""
    from simddp.program.pipeline import PipelineProgram

    act, rec = 1 << 20, 3 << 18
    kw = dict(activation_bytes=act, param_bytes=1 << 24, schedule=schedule)
    if schedule == "ZBVZeroBubble":
        kw.update(weight_s=1.0, stages_per_rank=2)
    plain = PipelineProgram(uniform_pipeline(4, 8, 1.0, 2.0, **kw), Knobs().checked(4, FREE))
    cap = uniform_pipeline(4, 8, 1.0, 2.0, recompute_bytes=rec, **kw)
    assert cap.activation_checkpointing
    ac = PipelineProgram(cap, Knobs().checked(4, FREE))
    for rank in range(4):
        held = plain.memory(rank)[1]["activations"]
        if in_flight is not None:
            assert held == in_flight[rank] * act
        peak, cats = ac.memory(rank)
        assert cats["activations"] == held + rec
        assert peak == plain.memory(rank)[0] + rec
    assert replay(cap, network=FREE, progress=False).peak_memory_allocated_bytes == \
        replay(uniform_pipeline(4, 8, 1.0, 2.0, **kw), network=FREE,
               progress=False).peak_memory_allocated_bytes + rec


def test_jitter_replays_every_rank_and_the_same_seed_gives_the_same_result():
    net = Network.preset("dgx-h100")
    a = replay(_three_d(), 16, network=net, progress=False, jitter=0.05, seed=3)
    b = replay(_three_d(), 16, network=net, progress=False, jitter=0.05, seed=3)
    c = replay(_three_d(), 16, network=net, progress=False, jitter=0.05, seed=4)
    assert a.engine == "simpy" and "pipeline parallelism" in a.engine_reason
    assert a.to_json() == b.to_json() and a.bubble_fraction == b.bubble_fraction
    assert a.iteration_times != c.iteration_times
