"""Pipeline-parallel capture: torch's real PipelineStage and schedule classes run on the fake
cluster under virtual time, recorded per stage, action and microbatch (CapturedPipeline)."""

import dataclasses
import functools

import pytest
import torch

from fakepg.zoo import llama, workloads
from simddp import Compute, Network, Timing
from simddp.cosim.capture_pp import capture_pp
from simddp.program.captured import CapturedPipeline

ARGS = dataclasses.replace(llama.LLAMA3_TINY, n_layers=8)  # 8 blocks: pp=4 × 2 stages a rank
SCENARIO = workloads.llama3_tiny(batch_size=4, seq_len=16).with_(
    model=functools.partial(llama.Llama, ARGS))
M = 4  # microbatches: the batch of 4, one sample each
TIMING = Timing(network=Network.preset("ib-ndr", gpus_per_node=8),
                compute=Compute.roofline("h100"))
CASES = [(2, "GPipe", 1), (4, "GPipe", 1), (2, "1F1B", 1), (4, "1F1B", 1),
         (2, "Interleaved1F1B", 2), (4, "Interleaved1F1B", 2), (2, "ZBVZeroBubble", 2),
         (4, "InterleavedZeroBubble", 2), (2, "LoopedBFS", 2), (2, "DualPipeV", 2)]


def _reference_losses(scenario, iterations=2):
    """The same training without a pipeline: the whole model, the whole batch."""
    model = scenario.build_model()
    opt = scenario.optimizer(model.parameters())
    out = []
    for batch in scenario.inputs(0, 1)[:iterations]:
        opt.zero_grad()
        loss = scenario.step(model, batch)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.fixture(scope="module")
def caps():
    got = {}
    for pp, schedule, spr in CASES:
        losses: list = []
        cap = capture_pp(SCENARIO, pp, schedule=schedule, stages_per_rank=spr, timing=TIMING,
                         losses=losses)
        got[pp, schedule] = (cap, losses)
    return got


# -- the zoo's pipeline stages ------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_stage_parameters_add_up_to_the_model_and_stages_hold_the_ends(stages):
    model = llama.Llama(ARGS)
    parts = [llama.LlamaStage(model, s, stages) for s in range(stages)]
    assert sum(p.numel() for st in parts for p in st.parameters()) == ARGS.num_params()
    assert parts[0].tok_embeddings is model.tok_embeddings
    assert parts[-1].output is model.output and parts[-1].norm is model.norm
    assert all(st.tok_embeddings is None for st in parts[1:])
    assert all(st.output is None and st.norm is None for st in parts[:-1])
    assert [list(st.layer_ids) for st in parts] == [
        list(range(s * 8 // stages, (s + 1) * 8 // stages)) for s in range(stages)]


def test_llama3_8b_stages_at_real_size_hold_its_published_parameter_count():
    with torch.device("meta"):
        model = llama.Llama(llama.LLAMA3_8B)
    parts = [llama.LlamaStage(model, s, 4) for s in range(4)]
    assert sum(p.numel() for st in parts for p in st.parameters()) == 8_030_261_248


def test_stages_in_sequence_compute_the_models_logits():
    model = llama.Llama(ARGS)
    tokens = SCENARIO.inputs(0, 1)[0][0]
    h = tokens
    for s in range(4):
        h = llama.LlamaStage(model, s, 4)(h)
    assert torch.equal(h, model(tokens))


def test_stage_layers_names_the_stage_counts_that_divide_the_blocks():
    with pytest.raises(ValueError, match=r"3 pipeline stages do not divide the model's 8 "
                                         r"blocks.*one of \[1, 2, 4, 8\]"):
        llama.stage_layers(8, 0, 3)


# -- the capture --------------------------------------------------------------------------------

@pytest.mark.parametrize("pp,schedule,spr", CASES)
def test_each_stage_records_one_forward_and_one_backward_per_microbatch(caps, pp, schedule, spr):
    cap, _ = caps[pp, schedule]
    assert (cap.pp, cap.stages_per_rank, cap.microbatches, cap.world_size) == (pp, spr, M, pp)
    assert [st["stage"] for st in cap.stages] == list(range(pp * spr))
    zero_bubble = "ZeroBubble" in schedule
    if schedule == "DualPipeV":  # mixes full (B) and split (I, W) backwards
        for st in cap.stages:
            acts = st["actions"]
            assert len(acts["F"]) == M and all(acts["F"])
            for mb in range(M):
                split = acts["I"][mb] is not None
                assert (acts["W"][mb] is not None) == split
                assert (acts["B"][mb] is not None) != split
        return
    for st in cap.stages:
        acts = st["actions"]
        assert sorted(acts) == (["F", "I", "W"] if zero_bubble else ["B", "F"])
        for kind, profiles in acts.items():
            assert len(profiles) == M and all(p is not None for p in profiles), (kind, st)
            assert all(p["seconds"] > 0 or kind == "I" for p in profiles)
        # zero-bubble's input-gradient pass: nothing to do on the first stage (tokens have none)
        if zero_bubble and st["stage"] > 0:
            assert all(p["seconds"] > 0 for p in acts["I"])


@pytest.mark.parametrize("pp,schedule,spr", CASES)
def test_pipelined_losses_equal_the_unpipelined_runs(caps, pp, schedule, spr):
    _, losses = caps[pp, schedule]
    assert len(losses) == 2 and all(len(step) == M for step in losses)
    mean = [sum(step) / M for step in losses]  # equal microbatches: the mean is the batch's
    assert mean == pytest.approx(_reference_losses(SCENARIO), rel=1e-5)


def test_stages_sit_on_the_ranks_the_schedule_places_them(caps):
    assert [st["rank"] for st in caps[4, "Interleaved1F1B"][0].stages] == [0, 1, 2, 3] * 2
    assert [st["rank"] for st in caps[2, "ZBVZeroBubble"][0].stages] == [0, 1, 1, 0]


def test_sends_are_the_hidden_states_and_leave_the_actions(caps):
    cap, _ = caps[2, "1F1B"]
    hidden = 1 * 16 * ARGS.dim * 4  # one sample of 16 tokens, float32
    assert [st["send_bytes"] for st in cap.stages] == [{"F": hidden, "B": 0},
                                                       {"F": 0, "B": hidden}]
    for (pp, schedule), (c, _) in caps.items():
        for st in c.stages:
            for prof in [*(p for ps in st["actions"].values() for p in ps if p),
                         st["reduce_grad"], st["optimizer"]]:
                assert not [e for e in prof["events"] if e["op"] in ("send", "recv")]


def test_last_stage_forward_includes_the_loss_and_memory_facts_are_per_stage(caps):
    cap, _ = caps[4, "1F1B"]
    mid, last = cap.stages[1], cap.stages[3]
    assert cap.param_bytes == ARGS.num_params() * 4
    # AdamW: two moments per parameter (and a step count per tensor)
    for st in cap.stages:
        assert 2 * st["param_bytes"] < st["optimizer_state_bytes"] < 2.01 * st["param_bytes"]
    assert last["activation_bytes"] > mid["activation_bytes"] > 0
    f = [st["actions"]["F"][1]["seconds"] for st in cap.stages]
    assert f[3] > f[1] == f[2]  # head and loss on the last; blocks alike


@pytest.mark.parametrize("pp,schedule,spr", CASES)
def test_cosimulated_step_is_at_least_the_busiest_ranks_compute(caps, pp, schedule, spr):
    cap, _ = caps[pp, schedule]
    busy = [0.0] * pp
    for st in cap.stages:
        busy[st["rank"]] += sum(p["seconds"] for ps in st["actions"].values() for p in ps if p)
        busy[st["rank"]] += st["reduce_grad"]["seconds"] + st["optimizer"]["seconds"]
    assert cap.cosim_iteration_time >= max(busy) * (1 - 1e-9)
    if schedule == "GPipe":  # fill and drain: idle ranks
        assert cap.cosim_iteration_time > 1.2 * max(busy)


def test_capture_round_trips_through_json_and_repeats_bitwise(caps):
    cap, _ = caps[2, "1F1B"]
    assert CapturedPipeline.from_json(cap.to_json()) == cap
    again = capture_pp(SCENARIO, 2, schedule="1F1B", timing=TIMING)
    assert again.to_json() == cap.to_json()


def test_pp_times_fsdp_trains_as_one_model_on_both_shards_data():
    losses: list = []
    capture_pp(SCENARIO, 2, schedule="Interleaved1F1B", stages_per_rank=2, mesh={"shard": 2},
               timing=TIMING, losses=losses)
    # without a pipeline: step 1 on both data-parallel ranks' batches at once (FSDP2 averages
    # their gradients), then data-parallel rank 0's second batch
    model = SCENARIO.build_model()
    opt = SCENARIO.optimizer(model.parameters())
    (x0, y0), (x1, y1) = (SCENARIO.inputs(r, 2)[0] for r in range(2))
    first = SCENARIO.step(model, (x0, y0))
    opt.zero_grad()
    SCENARIO.step(model, (torch.cat([x0, x1]), torch.cat([y0, y1]))).backward()
    opt.step()
    second = SCENARIO.step(model, SCENARIO.inputs(0, 2)[1])
    assert [sum(step) / M for step in losses] == pytest.approx([first.item(), second.item()],
                                                               rel=1e-5)


def test_pp_times_fsdp_records_each_stages_gathers_and_reduce_scatters():
    cap = capture_pp(SCENARIO, 2, schedule="1F1B", mesh={"shard": 2}, timing=TIMING)
    assert cap.world_size == 4 and cap.mesh == {"pp": 2, "shard": 2} and cap.data == "fsdp"
    for st in cap.stages:
        gathers = [e for p in st["actions"]["F"] for e in p["events"]
                   if e["op"] == "all_gather_into_tensor"]
        scatters = [e for e in st["reduce_grad"]["events"] if e["op"] == "reduce_scatter_tensor"]
        # reshard_after_forward=False: each block and the stage root gather once a step, in
        # the first microbatch's forward, and reduce-scatter once after the last backward
        assert gathers and all(e["scope"] == "shard" for e in gathers + scatters)
        assert {id(e) for e in gathers} <= {id(e) for e in st["actions"]["F"][0]["events"]}
        assert sorted(e["bytes"] for e in scatters) == sorted(e["bytes"] for e in gathers)
        # the optimizer state is sharded: about half of the unsharded AdamW moments
        assert st["optimizer_state_bytes"] < 1.01 * st["param_bytes"]
        assert st["unshard"] == st["reshard"] == []  # single-stage: no UNSHARD actions


def test_pp_times_tp_shards_the_stages_and_keeps_the_losses(caps):
    losses: list = []
    cap = capture_pp(SCENARIO, 2, schedule="1F1B", mesh={"tp": 2}, timing=TIMING,
                     losses=losses)
    plain, _ = caps[2, "1F1B"]
    assert cap.world_size == 4 and cap.tp_size == 2
    assert [sum(step) / M for step in losses] == pytest.approx(_reference_losses(SCENARIO),
                                                               rel=1e-5)
    for st, ref in zip(cap.stages, plain.stages):
        # sequence parallelism: the stages exchange sequence shards
        assert st["send_bytes"] == {k: v // 2 for k, v in ref["send_bytes"].items()}
        assert st["activation_bytes"] < 0.7 * ref["activation_bytes"]
        assert st["optimizer_state_bytes"] < 0.6 * ref["optimizer_state_bytes"]
        for kind in ("F", "B"):
            ops = {(e["op"], e["scope"]) for p in st["actions"][kind] for e in p["events"]}
            assert ops == {("all_gather_into_tensor_coalesced", "tp"),
                           ("reduce_scatter_tensor_coalesced", "tp")}


def test_pp_fsdp_tp_on_a_3d_mesh_records_each_dimensions_collectives():
    cap = capture_pp(SCENARIO, 2, schedule="Interleaved1F1B", stages_per_rank=2,
                     mesh={"shard": 2, "tp": 2}, timing=TIMING)
    assert cap.world_size == 8 and cap.mesh == {"pp": 2, "shard": 2, "tp": 2}
    for st in cap.stages:
        assert {e["scope"] for p in st["actions"]["F"] for e in p["events"]} == {"tp"}
        # a multi-stage schedule gathers a stage's parameters in torch's UNSHARD action
        assert len(st["unshard"]) == len(st["reshard"]) == 1
        gathers = st["unshard"][0]["events"]
        assert gathers and {(e["op"], e["scope"]) for e in gathers} == {
            ("all_gather_into_tensor", "shard")}
        assert "shard" in {e["scope"] for e in st["reduce_grad"]["events"]}


def test_real_size_llama3_8b_captures_on_meta():
    sc = workloads.llama3_8b(batch_size=4, seq_len=64)
    cap = capture_pp(sc, 4, schedule="1F1B", device="meta", timing=TIMING)
    assert cap.param_bytes == 8_030_261_248 * 4
    assert [st["layers"] for st in cap.stages] == [[0, 8], [8, 16], [16, 24], [24, 32]]
    assert cap.stages[0]["send_bytes"]["F"] == 64 * 4096 * 4
    assert all(p["seconds"] > 0 for st in cap.stages for p in st["actions"]["B"])


def test_activation_checkpointing_recomputes_each_stage_in_backward_with_the_same_losses(caps):
    plain, plain_losses = caps[2, "1F1B"]
    losses: list = []
    ac = capture_pp(SCENARIO, 2, schedule="1F1B", timing=TIMING, losses=losses,
                    activation_checkpointing=True)
    assert ac.activation_checkpointing and not plain.activation_checkpointing
    assert losses == plain_losses  # the recomputation is the forward, bit for bit
    for st, ref in zip(ac.stages, plain.stages):
        assert ref["recompute_bytes"] == 0
        # a microbatch in flight keeps its blocks' inputs; one block's activations while its
        # backward recomputes it
        assert 0 < st["activation_bytes"] < 0.25 * ref["activation_bytes"]
        assert 0 < st["recompute_bytes"] < ref["activation_bytes"]
        for mb in range(M):
            fwd = ref["actions"]["F"][mb]["seconds"]
            grown = st["actions"]["B"][mb]["seconds"] - ref["actions"]["B"][mb]["seconds"]
            # about one forward (checkpointing also detaches what the recompute saves)
            assert 0.9 * fwd < grown < 2 * fwd


def test_activation_checkpointing_keeps_the_same_on_meta_and_spares_stages_without_blocks():
    tiny = workloads.llama3_tiny(batch_size=2)  # 2 blocks: stage 0 embeds, stage 3 the head
    kw = dict(schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2, mesh={"tp": 2},
              input_weight=1, output_weight=1, timing=TIMING)
    plain = capture_pp(tiny, 2, **kw)
    cpu, meta = (capture_pp(tiny, 2, device=d, activation_checkpointing=True, **kw)
                 for d in ("cpu", "meta"))
    facts = lambda c: [(st["activation_bytes"], st["recompute_bytes"])  # noqa: E731
                       for st in c.stages]
    assert facts(meta) == facts(cpu)
    blocks = [st["layers"][1] - st["layers"][0] for st in cpu.stages]
    assert blocks == [0, 1, 1, 0]
    for st, ref, n in zip(cpu.stages, plain.stages, blocks):
        if n:
            assert st["recompute_bytes"] > 0
            assert st["actions"]["B"][0]["seconds"] > ref["actions"]["B"][0]["seconds"]
        else:  # nothing to checkpoint
            assert (st["activation_bytes"], st["recompute_bytes"]) == (ref["activation_bytes"], 0)
            assert st["actions"]["B"][0]["seconds"] == pytest.approx(
                ref["actions"]["B"][0]["seconds"], rel=1e-9)


def test_whatif_captures_pipeline_layouts_with_activation_checkpointing():
    from simddp.whatif import whatif

    kw = dict(world_size=4, network="dgx-h100", gpu="h100", parallel="pp:2,fsdp",
              microbatches=2, batch_size=2)
    plain, ac = (whatif("llama3-tiny", activation_checkpointing=a, **kw)[0]
                 for a in (False, True))
    assert not ac["oom"] and ac["parallel"] == "pp:2,fsdp"
    assert ac["iteration_time_s"] > plain["iteration_time_s"]
    # a tiny model: both fit one 2 MiB segment of the caching allocator, so compare what is
    # allocated
    assert ac["peak_memory_allocated_bytes"] < plain["peak_memory_allocated_bytes"]
    assert ac["peak_memory_bytes"] <= plain["peak_memory_bytes"]


def test_tensor_parallel_stages_on_meta_leave_no_collective_unwaited(monkeypatch):
    """An embedding-only stage's output is a pending reduce-scatter whose first wait is the
    pipeline's send; on meta that wait must reach c10d's registry of the rank as on CPU (else
    torch warns of "unwaited collective calls" at exit)."""
    from simddp.cosim import capture_pp as module

    left: dict[int, int] = {}
    scope = module.in_meta_scope

    def counted(device, fn):
        run = scope(device, fn)

        def rank_run(rank):
            out = run(rank)
            left[rank] = torch._C._distributed_c10d._get_work_registry_size()
            return out
        return rank_run
    monkeypatch.setattr(module, "in_meta_scope", counted)
    tiny = workloads.llama3_tiny(batch_size=2)  # 2 blocks: stage 0 holds the embedding alone
    for device in ("cpu", "meta"):
        left.clear()
        capture_pp(tiny, 2, schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2,
                   mesh={"tp": 2}, input_weight=1, output_weight=1, device=device)
        # on meta one rank a stage runs, its TP peer's collectives answered for it
        # (simddp.cosim.represent): the ranks that ran leave none unwaited
        assert left == ({0: 0, 2: 0} if device == "meta" else {0: 0, 1: 0, 2: 0, 3: 0}), device


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(pp=3), ValueError, r"3 pipeline stages do not divide the model's 8 blocks; the "
                             r"number of stages \(pp × stages per rank\) must be one of"),
    (dict(pp=2, schedule="2F2B"), ValueError,
     r"unknown pipeline schedule '2F2B'; torch's schedules are GPipe, 1F1B, Interleaved1F1B"),
    (dict(pp=4, schedule="1F1B", microbatches=2), ValueError,
     r"Schedule1F1B refuses 2 microbatches on 4 stages.*greater than or equal to the number "
     r"of stages \(4\)"),
    (dict(pp=2, schedule="GPipe", stages_per_rank=2), ValueError,
     r"GPipe runs one stage per rank.*multi-stage schedules: Interleaved1F1B"),
    (dict(pp=2, schedule="ZBVZeroBubble"), ValueError,
     r"ZBVZeroBubble places exactly 2 stages on each rank"),
    (dict(pp=2, microbatches=3), ValueError,
     r"3 microbatches do not divide the scenario's batch of 4 samples"),
    (dict(pp=2, mesh={"dp": 2}), ValueError,
     r"mesh dimensions \['dp'\] are not accepted inside a stage; give some of replicate, "
     r"shard, tp"),
    (dict(pp=2, param_dtype="bf16"), ValueError, r"FSDP2's mixed precision"),
])
def test_bad_input_names_what_is_accepted(kwargs, error, match):
    with pytest.raises(error, match=match):
        capture_pp(SCENARIO, **kwargs)


def test_a_model_other_than_the_zoo_llama_is_refused():
    with pytest.raises(TypeError, match=r"pipelines the zoo's Llama.*builds"):
        capture_pp(workloads.WORKLOADS["gpt2"](), 2)
