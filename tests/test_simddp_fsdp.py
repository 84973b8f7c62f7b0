"""FSDP2 and HSDP what-ifs: torch's real fully_shard captured on the fake cluster, replayed as a
step program at any world size, with memory per rank."""

import dataclasses
import json

import pytest
import torch

from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.cosim.capture_fsdp import capture_fsdp, fsdp_units
from simddp.program import CapturedStep, Knobs, plan
from simddp.replay import replay

NET = Network.preset("ib-ndr", gpus_per_node=8)
TIMING = Timing(network=NET, compute=Compute.roofline("h100"))


def _adam(scenario):
    return dataclasses.replace(scenario, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))


@pytest.fixture(scope="module")
def caps():
    sc = _adam(zoo.get("transformer_block"))
    return {"fsdp": capture_fsdp(sc, 2, timing=TIMING),
            "fsdp-keep": capture_fsdp(sc, 2, timing=TIMING, reshard_after_forward=False),
            "hsdp": capture_fsdp(sc, 4, timing=TIMING, mesh={"replicate": 2, "shard": 2})}


def _units(cap, phase="forward"):
    return [e for e in cap.profiles[0][phase]["events"] if e["op"] == "all_gather_into_tensor"]


def test_capture_records_one_all_gather_per_unit_of_the_unsharded_size(caps):
    model = zoo.get("transformer_block").build_model()

    def padded(p, world=2):  # FSDP2 pads dim 0 to a multiple of the shard size
        rows = -(-p.shape[0] // world) * world if p.dim() else world
        return rows * (p.numel() // max(1, p.shape[0] if p.dim() else 1)) * p.element_size()

    unit_bytes = sorted(sum(padded(p) for p in u.parameters()) for u in fsdp_units(model))
    gathered = sorted(e["bytes"] for e in _units(caps["fsdp"]))
    assert gathered == unit_bytes  # one per unit (this root holds no parameters of its own)
    assert all(e["scope"] == "shard" for e in _units(caps["fsdp"]))
    scatters = [e for e in caps["fsdp"].profiles[0]["backward"]["events"]
                if e["op"] == "reduce_scatter_tensor"]
    assert sorted(e["bytes"] for e in scatters) == gathered


def test_reshard_after_forward_false_gathers_nothing_again_in_backward(caps):
    assert _units(caps["fsdp"], "backward")
    assert not _units(caps["fsdp-keep"], "backward")


def test_hsdp_all_reduces_each_reduced_shard_across_replicas(caps):
    evs = caps["hsdp"].profiles[0]["backward"]["events"]
    ars = [e for e in evs if e["op"] == "all_reduce"]
    rss = [e for e in evs if e["op"] == "reduce_scatter_tensor"]
    assert ars and all(e["scope"] == "replicate" for e in ars)
    assert sorted(a["bytes"] for a in ars) == sorted(r["bytes"] // 2 for r in rss)


def test_replay_at_the_capture_world_without_prefetch_matches_co_simulation(caps):
    cap = caps["fsdp"]
    # co-simulation costs the α–β network: NCCL's tuning model (a preset default) off here
    res = replay(cap, 2, forward_prefetch=0, backward_prefetch=0, progress=False,
                 protocol_latency=False, gpu_contention="off")
    # co-simulation waits for every reduce-scatter where FSDP2 issued it (CPU ranks); replay
    # overlaps them with the backward compute after them, as on a GPU: never slower, and the
    # difference is at most the reduce-scatters' exposed time
    assert res.iteration_time <= cap.cosim_iteration_time
    assert res.iteration_time == pytest.approx(cap.cosim_iteration_time, rel=0.01)


def test_prefetching_hides_all_gathers_behind_compute(caps):
    cap = caps["fsdp"]
    none = replay(cap, 64, forward_prefetch=0, backward_prefetch=0, progress=False)
    one = replay(cap, 64, progress=False)
    assert one.mean_exposed_comm < none.mean_exposed_comm
    assert one.iteration_time < none.iteration_time


def test_communication_stops_hiding_as_the_world_grows(caps):
    times = [replay(caps["fsdp"], n, progress=False).mean_exposed_comm for n in (8, 64, 512)]
    assert times[0] < times[1] < times[2]


def test_all_gather_bytes_stay_unsharded_and_hsdp_all_reduce_bytes_shrink_with_the_shard(caps):
    for n in (8, 64):
        prog = plan(caps["hsdp"], Knobs(parallel="hsdp:4").checked(n, NET))
        issues = [m.do for seg in prog.iteration(0, 0) if hasattr(seg, "marks")
                  for m in seg.marks if type(m.do).__name__ == "Issue"]
        ars = [c for x in issues for c, _ in x.stages if c.op == "all_reduce"]
        ags = [c for x in issues for c, _ in x.stages if c.op == "all_gather_into_tensor"]
        captured_ar = sorted(e["bytes"] for e in caps["hsdp"].profiles[0]["backward"]["events"]
                             if e["op"] == "all_reduce")
        assert sorted(c.nbytes for c in ars) == [round(b * 2 / 4) for b in captured_ar]
        assert sorted({c.nbytes for c in ags}) == sorted({e["bytes"] for e in _units(caps["hsdp"])})


def test_sharded_memory_shrinks_with_the_shard_size_and_activations_do_not(caps):
    cap = caps["fsdp"]
    small, big = (plan(cap, Knobs().checked(n, NET)) for n in (8, 64))
    assert small.static_memory()["parameters"] == cap.param_bytes // 8
    assert big.static_memory()["optimizer"] == cap.optimizer_state_bytes * 2 // 64
    peak8, cats8 = small.memory()
    peak64, cats64 = big.memory()
    assert peak64 < peak8
    # backward frees each unit's activations after its reduce-scatter: at the peak, at most
    # what autograd saved, the same at any shard size
    assert cats8["activations"] == cats64["activations"] <= cap.activation_bytes
    assert cats8["activations"] > 0


def test_keeping_parameters_after_forward_costs_memory_at_the_peak():
    sc = zoo.get("mlp")  # six units: resharding frees all but the ones in flight
    keep = replay(capture_fsdp(sc, 2, timing=TIMING, reshard_after_forward=False), 64,
                  progress=False)
    reshard = replay(capture_fsdp(sc, 2, timing=TIMING), 64, progress=False)
    assert keep.memory["parameters"] > reshard.memory["parameters"]
    assert keep.iteration_time < reshard.iteration_time  # no all-gathers in backward


def test_every_row_gives_an_oom_verdict_against_the_device_memory(caps):
    fits = replay(caps["fsdp"], 8, gpu_memory_gb=80, progress=False)
    assert fits.oom is False
    tiny = fits.peak_memory_bytes / 2 / 1e9
    assert replay(caps["fsdp"], 8, gpu_memory_gb=tiny, progress=False).oom is True
    assert replay(caps["fsdp"], 8, progress=False).oom is None
    row = fits.row()
    assert row["peak_memory_bytes"] == fits.peak_memory_bytes and row["oom"] is False


def test_both_engines_run_the_fsdp_program_and_agree(caps):
    kw = dict(jitter=0.05, seed=3, iterations=2, progress=False)
    fast = replay(caps["hsdp"], 64, parallel="hsdp:8", engine="vector", **kw)
    slow = replay(caps["hsdp"], 64, parallel="hsdp:8", engine="simpy", **kw)
    assert fast.engine == "vector" and slow.engine == "simpy"
    assert fast.iteration_times == slow.iteration_times


def test_a_layout_or_knob_the_capture_cannot_replay_is_refused_with_the_reason(caps):
    with pytest.raises(ValueError, match="cannot replay a FSDP capture"):
        replay(caps["fsdp"], 64, parallel="hsdp:8", progress=False)
    with pytest.raises(ValueError, match="each needs its own capture"):
        replay(caps["fsdp"], 64, reshard_after_forward=False, progress=False)
    with pytest.raises(ValueError, match="do not apply to an FSDP2 replay"):
        replay(caps["fsdp"], 64, bucket_cap_mb=5, progress=False)
    with pytest.raises(ValueError, match="forward_prefetch must be an integer"):
        replay(caps["fsdp"], 64, forward_prefetch=-1, progress=False)


def test_a_capture_round_trips_through_json_and_replays_identically(caps, tmp_path):
    cap = caps["hsdp"]
    path = tmp_path / "cap.json"
    cap.save(path)
    again = CapturedStep.load(path)
    a = replay(cap, 32, parallel="hsdp:4", progress=False)
    b = replay(again, 32, parallel="hsdp:4", progress=False)
    assert a.to_json() == b.to_json()


def test_the_same_capture_twice_is_bitwise_identical():
    sc = zoo.get("mlp")
    a = capture_fsdp(sc, 2, timing=TIMING, seed=1).to_json()
    b = capture_fsdp(sc, 2, timing=TIMING, seed=1).to_json()
    assert a == b and json.loads(a)["profiles"]


def _tracked_peak(rank, scenario):
    """torch's own FSDPMemTracker on the same model and step (one rank process)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    model = scenario.build_model()
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = scenario.optimizer(model.parameters())
    batches = scenario.inputs(rank, 2)
    tracker = FSDPMemTracker(model, opt)
    with tracker:
        for i in range(2):
            opt.zero_grad()
            model(batches[i][0]).sum().backward()  # the scenario's forward, a plain loss
            opt.step()
            if i == 0:
                tracker.reset_mod_stats()
    (cats,) = tracker.get_tracker_snapshot("peak").values()
    return {str(k).split(".")[-1].lower(): v for k, v in cats.items()}


@pytest.mark.slow
def test_memory_agrees_with_torchs_fsdp_mem_tracker_where_both_model_the_same_thing(caps):
    import fakepg

    # FSDPMemTracker hooks every module globally: one tracker per rank process
    tracked = fakepg.spawn(_tracked_peak, args=(_adam(zoo.get("transformer_block")),),
                           nprocs=2, isolation="process").returns[0]
    prog = plan(caps["fsdp"], Knobs().checked(2, NET))
    static = prog.static_memory()
    assert static["optimizer"] == tracked["opt"]
    # torch counts each parameter's shard; the capture's whole model over 2 (padding aside)
    assert static["parameters"] == pytest.approx(tracked["sharded_param"], rel=0.02)
    # activations: torch's tracker sees what is live at its peak, simddp what autograd saves
    assert prog.memory()[1]["activations"] == pytest.approx(tracked["act"], rel=0.25)


def test_activation_checkpointing_trades_held_activations_for_recompute_time():
    sc = zoo.get("llama3-tiny")
    plain = capture_fsdp(sc, 2, timing=TIMING)
    ac = capture_fsdp(sc, 2, timing=TIMING, activation_checkpointing=True)
    assert ac.activation_checkpointing and 0 < ac.recompute_bytes < plain.activation_bytes
    assert ac.activation_bytes < plain.activation_bytes
    # backward recomputes each block's forward: more compute, less memory at the peak
    back = lambda cap: cap.profiles[0]["backward"]["seconds"]  # noqa: E731
    assert back(ac) > back(plain)
    assert replay(ac, 8, progress=False).peak_memory_bytes < \
        replay(plain, 8, progress=False).peak_memory_bytes


def test_a_real_size_llama_step_is_captured_on_the_meta_device_with_sharded_memory():
    cap = capture_fsdp(zoo.get("llama3-8b", seq_len=512), 2, timing=TIMING, device="meta",
                       param_dtype="bf16", reduce_dtype="fp32")
    assert cap.param_bytes == 8_030_261_248 * 4
    gathers = [e for e in cap.profiles[0]["forward"]["events"]
               if e["op"] == "all_gather_into_tensor"]
    assert len(gathers) == 33  # 32 blocks and the root (embeddings, norm, output)
    assert sum(e["bytes"] for e in gathers) == pytest.approx(8_030_261_248 * 2, rel=1e-6)
    res = replay(cap, 64, gpu_memory_gb=80, progress=False)
    # AdamW's two fp32 moments and the fp32 shard of 8 B parameters over 64 ranks
    assert res.memory["optimizer"] == pytest.approx(2 * 8_030_261_248 * 4 / 64, rel=1e-3)
    assert res.memory["parameters"] >= 8_030_261_248 * 4 // 64


def test_a_steps_memory_events_free_everything_they_allocate(caps):
    """Replayed twice through the caching allocator, a step must leave what it found: every
    allocation of the FSDP2 event stream (all-gather outputs, unsharded parameters and
    gradients, reduce-scatter buffers, activations, temporaries) is freed within the step."""
    from simddp.program.steps import allocator_memory, memory_events

    for name in ("fsdp", "fsdp-keep", "hsdp"):
        prog = plan(caps[name], Knobs().checked(8, NET))
        (steps, start), = prog.memory_programs()
        assert sum(m.nbytes for m in memory_events(steps)) == 0
        once = allocator_memory(steps, start, iterations=1)
        twice = allocator_memory(steps, start, iterations=2)
        # what is left after one step is what is left after two: nothing leaks per step
        assert twice.stats.allocated == once.stats.allocated >= sum(start.values())
        assert twice.allocated_peak >= once.allocated_peak
