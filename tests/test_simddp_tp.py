"""Tensor parallelism × FSDP2: torchtitan's Llama 3 TP plan (torch's real parallelize_module)
captured on the fake cluster and replayed as a step program, with memory per rank and exposed
communication per mesh dimension."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import fakepg
from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.cosim.capture_fsdp import capture_fsdp
from simddp.cosim.tensor_parallel import apply_tensor_parallel, tp_collectives_per_block
from simddp.program import CapturedStep
from simddp.program.parallel import Parallel
from simddp.replay import replay

ROOT = Path(__file__).resolve().parent.parent
TIMING = Timing(network=Network.preset("dgx-h100"), compute=Compute.roofline("h100"))
_AG, _RS = "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"


@pytest.fixture(scope="module")
def caps():
    sc = zoo.get("llama3-tiny")
    return {"fsdp": capture_fsdp(sc, 2, timing=TIMING, mesh={"shard": 2}),
            "fsdp-tp": capture_fsdp(sc, 4, timing=TIMING, mesh={"shard": 2, "tp": 2})}


def _tp_ops(cap, phase):
    return Counter(e["op"] for e in cap.profiles[0][phase]["events"] if e["scope"] == "tp")


def test_sequence_parallel_plan_issues_torchtitans_collectives_per_block(caps):
    cap = caps["fsdp-tp"]
    layers = zoo.get("llama3-tiny").build_model().args.n_layers
    per_block = tp_collectives_per_block(sequence_parallel=True)
    fwd, bwd = _tp_ops(cap, "forward"), _tp_ops(cap, "backward")
    # per block 2 all-gathers (attention, feed-forward inputs) and 2 reduce-scatters (wo,
    # w2); outside the blocks: the embeddings reduce-scatter into sequence shards, the
    # output head all-gathers the sequence in and the vocabulary out
    assert fwd == {_AG: per_block["forward"]["all_gather_into_tensor"] * layers + 2,
                   _RS: per_block["forward"]["reduce_scatter_tensor"] * layers + 1}
    # backward mirrors them (the vocabulary gather's backward is a local split); each
    # sequence-parallel norm's replicated weight all-reduces its partial gradient
    assert bwd == {_AG: 2 * layers + 1, _RS: 2 * layers + 1, "all_reduce": 2 * layers + 1}


def test_tp_collectives_carry_the_full_activation_and_fsdp_gathers_the_tp_local_shard(caps):
    cap = caps["fsdp-tp"]
    sc = zoo.get("llama3-tiny")
    tokens = sc.inputs(0, 1)[0][0]
    dim = sc.build_model().args.dim
    act = tokens.shape[0] * tokens.shape[1] * dim * 4  # (batch, seq, dim) fp32
    evs = [e for e in cap.profiles[0]["forward"]["events"] if e["scope"] == "tp"]
    assert all(e["bytes"] == act for e in evs[:-1])  # the last: the output's vocabulary
    fsdp_fwd = [e["bytes"] for e in caps["fsdp"].profiles[0]["forward"]["events"]]
    tp_fwd = [e["bytes"] for e in cap.profiles[0]["forward"]["events"] if e["scope"] == "shard"]
    assert len(tp_fwd) == len(fsdp_fwd) and sum(tp_fwd) < 0.6 * sum(fsdp_fwd)
    assert cap.tp_param_bytes < 0.6 * cap.param_bytes


def test_every_event_carries_its_mesh_dimension(caps):
    scopes = {e["scope"] for p in caps["fsdp-tp"].profiles for ph in p.values()
              for e in ph["events"]}
    assert scopes == {"shard", "tp"}


def test_a_meta_capture_records_the_tp_collectives_a_real_capture_records(caps):
    meta = capture_fsdp(zoo.get("llama3-tiny"), 4, timing=TIMING, mesh={"shard": 2, "tp": 2},
                        device="meta")
    real = caps["fsdp-tp"]
    for phase in ("forward", "backward", "optimizer"):
        shape = lambda c: [(e["op"], e["scope"], e["bytes"])  # noqa: E731
                           for e in c.profiles[0][phase]["events"]]
        assert shape(meta) == shape(real)
        assert meta.profiles[0][phase]["seconds"] == \
            pytest.approx(real.profiles[0][phase]["seconds"], rel=0.05)
    assert meta.tp_param_bytes == real.tp_param_bytes
    # saved tensors are told apart by their storages, which meta tensors have too
    assert meta.activation_bytes == real.activation_bytes


def test_replay_at_the_capture_world_agrees_with_co_simulation(caps):
    cap = caps["fsdp-tp"]
    # co-simulation costs the network's α–β as it is: replay with NCCL's tuning model and the
    # GPU's contention (on by default on the preset) switched off, to compare like with like
    res = replay(cap, 4, forward_prefetch=0, backward_prefetch=0, progress=False,
                 protocol_latency=False, gpu_contention="off")
    # replay waits for each TP collective where it is issued (the GPU's compute stream); the
    # fake cluster's CPU ranks run a few cheap ops (funcol's wrappers) before they read it
    assert res.iteration_time == pytest.approx(cap.cosim_iteration_time, rel=0.02)
    assert res.parallel == "fsdp:2,tp:2"


def test_fsdp_tp_trains_like_one_process_on_the_data_parallel_ranks_batches():
    sc = zoo.get("llama3-tiny")
    steps = 2

    def run(rank: int) -> list[float]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
        torch.manual_seed(0)
        model = sc.build_model()
        apply_tensor_parallel(model, mesh["tp"])
        for block in model.layers:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        opt = sc.optimizer(model.parameters())
        batch = sc.inputs(rank // 2, 2)[0]
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = sc.step(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        return [float(x) for x in losses], full

    out = fakepg.spawn(run, nprocs=4).returns
    torch.manual_seed(0)
    ref = sc.build_model()
    opt = sc.optimizer(ref.parameters())
    batches = [sc.inputs(d, 2)[0] for d in range(2)]
    for i in range(steps):
        opt.zero_grad()
        losses = [sc.step(ref, b) for b in batches]
        (sum(losses) / 2).backward()  # FSDP2 averages the data-parallel ranks' gradients
        opt.step()
        for d in range(2):
            for t in range(2):
                assert out[2 * d + t][0][i] == pytest.approx(losses[d].item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(out[0][1][name], p.detach(), rtol=1e-4, atol=1e-5)


def test_hsdp_with_tp_all_reduces_shards_across_replicas_and_replays_at_scale():
    cap = capture_fsdp(zoo.get("llama3-tiny"), 8, timing=TIMING,
                       mesh={"replicate": 2, "shard": 2, "tp": 2})
    bwd = cap.profiles[0]["backward"]["events"]
    assert {e["scope"] for e in bwd} == {"replicate", "shard", "tp"}
    assert all(e["op"] == "all_reduce" for e in bwd if e["scope"] == "replicate")
    res = replay(cap, 64, parallel="hsdp:4,tp:2", progress=False)
    assert res.parallel == "hsdp:8x4,tp:2"
    assert set(res.exposed_comm_by_dim) == {"replicate", "shard", "tp"}
    # at real size HSDP runs on the meta device too (FSDP2's all-reduce event there)
    meta = capture_fsdp(zoo.get("llama3-tiny"), 8, timing=TIMING,
                        mesh={"replicate": 2, "shard": 2, "tp": 2}, device="meta")
    shape = lambda c: [(e["op"], e["scope"], e["bytes"])  # noqa: E731
                       for ph in c.profiles[0].values() for e in ph["events"]]
    assert shape(meta) == shape(cap)


def test_memory_per_rank_falls_with_the_tp_degree(caps):
    one = replay(caps["fsdp"], 8, progress=False)
    two = replay(caps["fsdp-tp"], 8, progress=False)
    assert two.memory["parameters"] < one.memory["parameters"] or \
        caps["fsdp-tp"].tp_param_bytes / 4 < caps["fsdp"].param_bytes / 8 + 1
    assert caps["fsdp-tp"].activation_bytes < caps["fsdp"].activation_bytes
    # allocated, not reserved: at this size the caching allocator's segments (2 and 20 MiB) dominate
    assert two.peak_memory_allocated_bytes < one.peak_memory_allocated_bytes
    # parameters per rank: the TP rank's local bytes over the FSDP shard
    static = int(caps["fsdp-tp"].tp_param_bytes / 4)
    assert two.memory["parameters"] >= static


def test_exposed_communication_is_reported_per_mesh_dimension_by_both_engines(caps):
    cap = caps["fsdp-tp"]
    # the vectorised engine has no contention: the preset's GPU share off for both engines
    kw = dict(jitter=0.05, progress=False, gpu_contention="off")
    simpy = replay(cap, 64, engine="simpy", **kw)
    vector = replay(cap, 64, engine="vector", **kw)
    assert set(simpy.exposed_comm_by_dim) == {"shard", "tp"}
    for dim, x in simpy.exposed_comm_by_dim.items():
        assert vector.exposed_comm_by_dim[dim] == pytest.approx(x, rel=1e-9)
        assert 0 < x <= simpy.mean_exposed_comm + 1e-12
    row = simpy.row()
    assert row["parallel"] == "fsdp:32,tp:2" and set(row["exposed_comm_by_dim"]) == {"shard", "tp"}
    assert json.loads(simpy.to_json())["exposed_comm_by_dim"] == simpy.exposed_comm_by_dim


def test_a_tp_capture_round_trips_through_json_and_replays_identically(caps, tmp_path):
    cap = caps["fsdp-tp"]
    cap.save(tmp_path / "cap.json")
    again = CapturedStep.load(tmp_path / "cap.json")
    assert again.tp_size == 2 and again.tp_param_bytes == cap.tp_param_bytes
    a, b = replay(cap, 16, progress=False), replay(again, 16, progress=False)
    assert a.iteration_times == b.iteration_times and a.memory == b.memory


def test_the_same_tp_capture_twice_is_bitwise_identical(caps):
    again = capture_fsdp(zoo.get("llama3-tiny"), 4, timing=TIMING, mesh={"shard": 2, "tp": 2})
    assert again.to_json() == caps["fsdp-tp"].to_json()


def test_activation_checkpointing_with_tp_recomputes_blocks_and_keeps_their_inputs(caps):
    """torchtitan's order: TP, then each block under checkpoint_wrapper, then FSDP2. Backward
    recomputes each block's forward with its TP collectives; per TP rank autograd keeps the
    blocks' inputs, and one block's activations while it is recomputed; meta agrees."""
    plain = caps["fsdp-tp"]
    acs = {d: capture_fsdp(zoo.get("llama3-tiny"), 4, timing=TIMING, device=d,
                           mesh={"shard": 2, "tp": 2}, activation_checkpointing=True)
           for d in ("cpu", "meta")}
    ac = acs["cpu"]
    assert ac.activation_checkpointing and ac.mesh == {"shard": 2, "tp": 2}
    assert 0 < ac.activation_bytes < 0.5 * plain.activation_bytes
    assert 0 < ac.recompute_bytes < plain.activation_bytes
    assert (acs["meta"].activation_bytes, acs["meta"].recompute_bytes) == \
        (ac.activation_bytes, ac.recompute_bytes)
    fwd = plain.profiles[0]["forward"]["seconds"]
    grown = ac.profiles[0]["backward"]["seconds"] - plain.profiles[0]["backward"]["seconds"]
    # about one forward of the blocks (checkpointing also detaches what the recompute saves)
    assert 0.9 * fwd < grown < 2 * fwd
    # the recomputation issues the blocks' TP collectives again, in backward: both
    # all-gathers and the attention's reduce-scatter; torch's checkpoint stops early, once
    # what backward needs is recomputed, before the feed-forward's reduce-scatter
    assert _tp_ops(ac, "forward") == _tp_ops(plain, "forward")
    layers = zoo.get("llama3-tiny").build_model().args.n_layers
    assert _tp_ops(ac, "backward") - _tp_ops(plain, "backward") == {_AG: 2 * layers,
                                                                    _RS: layers}


def test_replaying_another_tp_degree_or_ddp_with_tp_is_refused_with_the_reason(caps):
    with pytest.raises(ValueError, match="capture the TP degree you replay"):
        replay(caps["fsdp-tp"], 8, parallel="fsdp,tp:4")
    with pytest.raises(ValueError, match="capture the TP degree you replay"):
        replay(caps["fsdp"], 8, parallel="fsdp,tp:2")
    assert "FSDP2" in Parallel.parse("ddp:4,tp:2", 8).not_replayed()
    assert Parallel.parse("fsdp:4,tp:2", 8).not_replayed() is None
    assert Parallel.parse("hsdp:2,tp:2", 8).not_replayed() is None


def test_async_tp_and_bad_tp_degrees_are_refused_with_what_is_accepted():
    def run(rank: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("tp",))
        model = zoo.get("llama3-tiny").build_model()
        with pytest.raises(ValueError, match="symmetric memory"):
            apply_tensor_parallel(model, mesh["tp"], async_tp=True)
        with pytest.raises(ValueError, match="n_heads = 4 is not divisible"):
            apply_tensor_parallel(model, mesh["tp"])

    fakepg.spawn(run, nprocs=3)
    with pytest.raises(ValueError, match="'tp': t"):
        capture_fsdp(zoo.get("llama3-tiny"), 4, mesh={"tp": 2, "shard": 2})


def test_the_plan_applies_to_a_pipeline_stage_without_embeddings_norm_or_output():
    def run(rank: int) -> int:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = zoo.get("llama3-tiny").build_model()
        stage = copy.copy(model)  # the blocks only, as a pipeline stage holds them
        stage.tok_embeddings = stage.norm = stage.output = None
        apply_tensor_parallel(stage, mesh["tp"])
        return sum(p.to_local().numel() for p in stage.layers.parameters())

    full = sum(p.numel() for p in zoo.get("llama3-tiny").build_model().layers.parameters())
    local = fakepg.spawn(run, nprocs=2).returns[0]
    assert full / 2 < local < full  # matrices halved, norms replicated


def test_whatif_cli_replays_fsdp_with_tp_and_writes_rows_with_the_mesh(tmp_path):
    env = {**os.environ, "COLUMNS": "100"}
    out = subprocess.run([sys.executable, "-m", "simddp", "whatif", "llama3-tiny",
                          "--parallel", "fsdp,tp:2", "--world-size", "8,64",
                          "--network", "dgx-h100", "--gpu", "h100", "--no-progress",
                          "--json", str(tmp_path / "rows.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert " tp " in out.stdout.splitlines()[1]  # exposed communication per dimension
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["world_size"] for r in rows] == [8, 64]
    assert all(r["parallel"] == "fsdp,tp:2" and set(r["exposed_comm_by_dim"]) == {"shard", "tp"}
               for r in rows)
    bad = subprocess.run([sys.executable, "-m", "simddp", "whatif", "llama3-tiny",
                          "--parallel", "ddp:4,tp:2", "--world-size", "8", "--no-progress"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "FSDP2" in bad.stderr


def test_a_real_size_llama_with_tp_is_captured_on_the_meta_device():
    cap = capture_fsdp(zoo.get("llama3-8b", seq_len=256), 4, timing=TIMING,
                       mesh={"shard": 2, "tp": 2}, device="meta")
    params, norms = 8_030_261_248, (2 * 32 + 1) * 4096  # norm weights stay replicated
    assert cap.param_bytes == params * 4
    assert cap.tp_param_bytes == ((params - norms) // 2 + norms) * 4
    fwd = _tp_ops(cap, "forward")
    assert fwd == {_AG: 2 * 32 + 2, _RS: 2 * 32 + 1}
    res = replay(cap, 256, progress=False)  # fsdp:128,tp:2
    assert res.memory["parameters"] >= cap.tp_param_bytes // 128
    assert res.exposed_comm_by_dim["tp"] > 0
