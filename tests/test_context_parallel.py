"""Context parallelism: torch's ring attention (its _ContextParallel plan, templated ring
attention and load balancer) with FSDP2 over shard × cp, on the fake cluster; its capture
(simddp.cosim.context_parallel) and its planner (simddp.program.context)."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

import fakepg
from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.cosim.capture_fsdp import checkpoint_units, fsdp_units
from simddp.cosim.context_parallel import capture_cp
from simddp.cosim.ring_attention import (RingAttention, apply_context_parallel,
                                         cpu_ring_attention, shard_sequence)
from simddp.program import CapturedCP, Knobs, plan
from simddp.program.context import CPMesh, plan_cp, ring_collectives
from simddp.program.parallel import Parallel
from simddp.replay import replay

TIMING = Timing(network=Network.preset("dgx-h100"), compute=Compute.roofline("h100"))
SEQ = 32
AGREE = 0.01  # replay vs co-simulation at the capture's world, relative
# co-simulation costs the network's α–β model as it is: replay compares with it with NCCL's
# tuning model and the GPU's contention (on by default on NCCL presets) switched off
AS_COSIM = dict(protocol_latency=False, gpu_contention="off")


def _scenario():
    return zoo.get("llama3-tiny", seq_len=SEQ)


@functools.cache
def _capture(mesh: tuple, rotate: str = "allgather", device: str = "cpu") -> CapturedCP:
    return capture_cp(_scenario(), timing=TIMING, mesh=dict(mesh), rotate_method=rotate,
                      device=device)


def cap_of(rotate: str = "allgather", device: str = "cpu", **mesh: int) -> CapturedCP:
    return _capture(tuple(mesh.items()), rotate, device)


# -- the mathematics: CP trains exactly as one process on the whole sequence ------------------

def _cp_training(cp: int, rotate: str, checkpointed: bool = False, steps: int = 2):
    """Losses (the CP group's mean) and final parameters of ``steps`` steps with context
    parallelism over ``cp`` fake ranks and FSDP2 over them, on rank 0's batches
    (``checkpointed``: every block under torch's checkpoint_wrapper)."""
    sc = _scenario()

    def run(rank: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("shard", "cp"))
        model = sc.build_model()
        route = apply_context_parallel(model, mesh["cp"], SEQ)
        dp = mesh["shard", "cp"]._flatten("shard_cp")
        if checkpointed:
            checkpoint_units(model)
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=dp)
        fully_shard(model, mesh=dp)
        opt = sc.optimizer(model.parameters())
        losses = []
        for batch in sc.inputs(0, 1)[:steps]:
            local = shard_sequence(mesh["cp"], list(batch[:2]), SEQ)
            with route:  # forward and backward (a checkpointed block recomputes in backward)
                loss = sc.step(model, tuple(local))
                loss.backward()
            opt.step()
            opt.zero_grad()
            whole = loss.detach().clone()
            torch.distributed.all_reduce(whole, group=mesh["cp"].get_group())
            losses.append(float(whole) / cp)
        return losses, [p.full_tensor().detach() for p in model.parameters()]

    with cpu_ring_attention(rotate):
        return fakepg.spawn(run, nprocs=cp).returns


def _reference(steps: int = 2):
    sc = _scenario()
    model = sc.build_model()
    opt = sc.optimizer(model.parameters())
    losses = []
    for batch in sc.inputs(0, 1)[:steps]:
        loss = sc.step(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("cp,rotate,checkpointed", [(2, "allgather", False),
                                                    (4, "allgather", False),
                                                    (4, "alltoall", False),
                                                    (2, "allgather", True)])
def test_context_parallel_trains_as_one_process_on_the_whole_sequence(cp, rotate, checkpointed):
    ref_losses, ref_params = _reference()
    returns = _cp_training(cp, rotate, checkpointed)
    for losses, params in returns:  # every rank: the same losses and parameters
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_torchs_own_cp_dispatcher_refuses_cpus_sdpa_kernel():
    """torch's ring attention is registered for the CUDA SDPA kernels only: on CPU, DTensor
    refuses the sequence-sharded call (why cpu_ring_attention registers one)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa
    from torch.distributed.tensor.parallel import parallelize_module

    def run(rank: int):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        ring = parallelize_module(RingAttention(), mesh, cpa._ContextParallel(
            seq_dim=2, attention_type=cpa._ContextParallel.AttentionType.SDPA))
        q = torch.randn(1, 2, 8, 4)
        cpa._enable_context_parallel_dispatcher()
        try:
            ring(q, q, q, is_causal=True)
        finally:
            cpa._disable_context_parallel_dispatcher()

    with pytest.raises(fakepg.RankFailedError, match="sharding strategy"):
        fakepg.spawn(run, nprocs=2)


def test_context_parallel_outside_cpu_ring_attention_is_refused():
    def run(rank: int):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        with apply_context_parallel(_scenario().build_model(), mesh["cp"], SEQ):
            pass

    with pytest.raises(fakepg.RankFailedError, match="cpu_ring_attention"):
        fakepg.spawn(run, nprocs=2)


# -- the collectives are torch's ------------------------------------------------------------------

def _kv_bytes(cp: int, itemsize: int = 4) -> int:
    """One rank's K and V (heads repeated for grouped-query attention, as the model does)."""
    args = _scenario().build_model().args
    batch = _scenario().inputs(0, 1)[0][0].shape[0]
    return 2 * batch * args.n_heads * (SEQ // cp) * args.head_dim * itemsize


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_ring_issues_one_kv_gather_per_attention_and_cp_dkv_rotations(cp):
    cap = cap_of(shard=1, cp=cp)
    layers = _scenario().build_model().args.n_layers
    kv = _kv_bytes(cp)
    fwd, bwd = (ring_collectives(cap.profiles[0][ph]["events"]) for ph in ("forward", "backward"))
    ag = "all_gather_into_tensor_coalesced"
    # torch's _AllGatherRotater: one all-gather of K and V per attention (cp × a rank's bytes)
    assert fwd == {ag: layers}
    # backward: the K/V all-gather again and dK/dV rotated by all-to-all at every ring step
    # (torch's dkv rotater is always ALL_TO_ALL), fp32 (convert_to_f32)
    assert bwd == {ag: layers, "all_to_all_single": cp * layers}
    sizes = {(e["op"], e["bytes"]) for ph in ("forward", "backward")
             for e in cap.profiles[0][ph]["events"] if e["scope"] == "cp"}
    assert sizes == {(ag, cp * kv), ("all_to_all_single", kv)}


def test_alltoall_ring_rotates_kv_at_every_step_but_the_last():
    cp = 4
    cap = cap_of("alltoall", shard=1, cp=cp)
    layers = _scenario().build_model().args.n_layers
    fwd, bwd = (ring_collectives(cap.profiles[0][ph]["events"]) for ph in ("forward", "backward"))
    assert fwd == {"all_to_all_single": (cp - 1) * layers}
    assert bwd == {"all_to_all_single": (cp - 1) * layers + cp * layers}


def test_every_ring_collective_is_waited_for_after_it_is_issued_and_fsdp_runs_on_shard_cp():
    cap = cap_of(shard=2, cp=2)
    scopes = Counter(e["scope"] for p in cap.profiles for ph in p.values() for e in ph["events"])
    assert set(scopes) == {"cp", "shard_cp"}
    for p in cap.profiles:
        for ph in p.values():
            for e in ph["events"]:
                if e["scope"] == "cp":
                    assert e["wait_at"] is not None and e["wait_at"] >= e["offset"]


@pytest.mark.parametrize("mesh", [{"shard": 1, "cp": 2}, {"shard": 1, "cp": 2, "tp": 2}],
                         ids=["cp2", "cp2-tp2"])
def test_a_meta_capture_issues_the_collectives_of_a_cpu_capture(mesh):
    """(on meta the TP ranks are represented by one, simddp.cosim.represent; the CP ranks all
    run)"""
    cpu, meta = cap_of(**mesh), cap_of(device="meta", **mesh)
    ops = lambda cap: [(ph, e["op"], e["scope"], e["bytes"])  # noqa: E731
                       for ph, v in cap.profiles[0].items() for e in v["events"]]
    assert ops(meta) == ops(cpu)
    assert meta.activation_bytes == cpu.activation_bytes
    # on meta the functional collectives' waits (wait_tensor: the ring's, TP's) run beneath
    # the clock (simddp.cosim.meta), where CPU charges each as an op: a few microseconds of
    # this tiny model's step
    for ph in ("forward", "backward"):
        assert meta.profiles[0][ph]["seconds"] == pytest.approx(
            cpu.profiles[0][ph]["seconds"], rel=0.05)


# -- attention compute per rank: 1 / cp, balanced ------------------------------------------------

class _AttentionFlops(TorchDispatchMode):
    """FLOPs of the CPU SDPA kernels run on local tensors (a causal call does half its
    product); DTensor ops are declined, so their local ops come back here (as simddp's clock
    counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            n = sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
            self.flops += n // 2 if (args[4] if len(args) > 4 else kwargs.get("is_causal")) else n
        elif func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            n = sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape,
                                         args[3].shape)
            self.flops += n // 2 if args[7] else n
        return func(*args, **kwargs)


def _attention_flops(cp: int) -> list[int]:
    sc = _scenario()

    def run(rank: int) -> int:
        from torch.distributed.device_mesh import init_device_mesh

        model = sc.build_model()
        batch = list(sc.inputs(0, 1)[0][:2])
        route = None
        if cp > 1:
            mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
            route = apply_context_parallel(model, mesh["cp"], SEQ)
            batch = shard_sequence(mesh["cp"], batch, SEQ)
        counter = _AttentionFlops()
        with counter, (route if route is not None else contextlib.nullcontext()):
            sc.step(model, tuple(batch)).backward()
        return counter.flops

    with cpu_ring_attention():
        return fakepg.spawn(run, nprocs=cp).returns


def test_attention_compute_per_rank_is_one_over_cp_with_causal_load_balancing():
    whole = _attention_flops(1)[0]
    for cp in (2, 4):
        per_rank = _attention_flops(cp)
        assert per_rank == [whole // cp] * cp  # balanced: every rank the same share


# -- the planner --------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", [{"shard": 1, "cp": 2}, {"shard": 2, "cp": 2},
                                  {"shard": 1, "cp": 4}, {"shard": 1, "cp": 2, "tp": 2},
                                  {"replicate": 2, "shard": 1, "cp": 2}],
                         ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_replay_at_the_captures_own_world_agrees_with_its_co_simulation(mesh):
    cap = cap_of(**mesh)
    res = replay(cap, progress=False, **AS_COSIM)
    assert res.iteration_time == pytest.approx(cap.cosim_iteration_time, rel=AGREE)


def test_ring_exchanges_overlap_the_attention_before_their_wait():
    """Each ring collective is issued at its captured offset and waited for at torch's next
    ring step: on a slow network the replay exposes only what the step's compute does not
    hide, less than the exchanges' whole time."""
    cap = cap_of(shard=1, cp=2)
    slow = Network(bandwidth_GBps=0.05, latency_us=5.0)
    res = replay(cap, network=slow, progress=False)
    ring = [c for c in res.collectives if c["op"] in ("all_gather_into_tensor_coalesced", "send")]
    busy = sum(c["end"] - c["start"] for c in ring)
    assert 0 < res.exposed_comm_by_dim["cp"] < busy


def test_a_replay_at_scale_keeps_the_ring_and_shards_fsdp_over_shard_times_cp():
    cap = cap_of(shard=1, cp=2)
    small = replay(cap, progress=False)
    big = replay(cap, 64, parallel="cp:2,fsdp", progress=False)
    assert big.parallel == "fsdp:32,cp:2"
    ring = lambda r: sorted(c["bytes"] for c in r.collectives  # noqa: E731
                            if c["group"].startswith("cp@"))
    assert ring(big)[:len(ring(small))] == ring(small)
    assert big.memory["parameters"] < small.memory["parameters"]
    assert big.memory["activations"] == small.memory["activations"] == cap.activation_bytes
    # both engines run the program (the vectorised one without the GPU's contention)
    simpy, vector = (replay(cap, 64, parallel="cp:2,fsdp", engine=e, progress=False,
                            gpu_contention="off") for e in ("simpy", "vector"))
    assert vector.iteration_time == simpy.iteration_time


def test_checkpointed_blocks_recompute_their_ring_in_backward_and_hold_their_inputs():
    plain = cap_of(shard=1, cp=2)
    ac = capture_cp(_scenario(), timing=TIMING, mesh={"shard": 1, "cp": 2},
                    activation_checkpointing=True)
    layers = _scenario().build_model().args.n_layers
    ag = "all_gather_into_tensor_coalesced"
    bwd = ring_collectives(ac.profiles[0]["backward"]["events"])
    assert bwd == {ag: 2 * layers, "all_to_all_single": 2 * layers}  # the recompute's gather
    assert ac.activation_bytes < plain.activation_bytes and ac.recompute_bytes > 0
    assert replay(ac, progress=False, **AS_COSIM).iteration_time == pytest.approx(
        ac.cosim_iteration_time, rel=AGREE)


def test_a_cp_rank_saves_about_one_over_cp_of_the_activations():
    a2, a4 = cap_of(shard=1, cp=2).activation_bytes, cap_of(shard=1, cp=4).activation_bytes
    assert 0.4 < a4 / a2 < 0.6


@pytest.mark.parametrize("mesh,spec,world", [
    ({"shard": 1, "cp": 2}, "cp:2,fsdp", 64),
    ({"shard": 1, "cp": 2, "tp": 2}, "fsdp,cp:2,tp:2", 32),
    ({"replicate": 2, "shard": 1, "cp": 2}, "hsdp:2,cp:2", 16)], ids=["fsdp", "tp", "hsdp"])
def test_the_cp_planner_keeps_the_planner_contract(mesh, spec, world):
    from simddp.program.contract import Program
    from simddp.replay import check_planner

    prog = check_planner(plan_cp, cap_of(**mesh), Knobs(parallel=spec).checked(world,
                                                                                TIMING.network))
    assert isinstance(prog, Program) and prog.communication_buckets() == ([], [])


def test_the_planner_refuses_another_cp_degree_than_the_captures():
    cap = cap_of(shard=1, cp=2)
    with pytest.raises(ValueError, match="cp=4.*capture.*cp=2"):
        replay(cap, 8, parallel="cp:4,fsdp", progress=False)


def test_the_registry_parses_cp_and_refuses_what_it_does_not_compose_with():
    par = Parallel.parse("cp:8,fsdp:8", 64)
    assert (par.shard, par.cp, str(par)) == (8, 8, "fsdp:8,cp:8")
    par = Parallel.parse("fsdp,cp:4,tp:2", 64)
    assert (par.shard, par.tp, par.cp, par.owner().name) == (8, 2, 4, "cp")
    assert Parallel.parse("cp:8,fsdp:8", 64).not_replayed() is None
    assert "not with DDP" in Parallel.parse("cp:2,ddp:4", 8).not_replayed()
    assert "pipeline stages" in Parallel.parse("pp:2,cp:2,fsdp", 8).not_replayed()
    with pytest.raises(ValueError, match="do not divide"):
        Parallel.parse("cp:3,fsdp", 16)


def test_cp_mesh_flattens_shard_and_cp_into_fsdps_group():
    mesh = CPMesh(16, {"shard": 2, "cp": 4, "tp": 2})
    assert list(mesh.members(5, "cp")) == [1, 3, 5, 7]
    assert list(mesh.members(5, "shard_cp")) == [1, 3, 5, 7, 9, 11, 13, 15]
    assert list(mesh.members(5, "tp")) == [4, 5]
    assert mesh.describe() == {"shard": 2, "cp": 4, "tp": 2}


def test_the_capture_round_trips_through_json_and_plans_the_same():
    cap = cap_of(shard=1, cp=2)
    back = CapturedCP.from_json(cap.to_json())
    assert back == cap
    checked = Knobs().checked(2, TIMING.network)
    assert plan(back, checked).iteration(0, 0) == plan(cap, checked).iteration(0, 0)


def test_capture_refuses_written_out_attention_and_bad_meshes():
    ref = zoo.get("llama3-tiny", seq_len=SEQ, attention="reference")
    with pytest.raises(fakepg.RankFailedError, match="attention='sdpa'"):
        capture_cp(ref, timing=TIMING, mesh={"shard": 1, "cp": 2})
    with pytest.raises(ValueError, match="torchtitan's order"):
        capture_cp(_scenario(), timing=TIMING, mesh={"cp": 2, "shard": 1})
    with pytest.raises(ValueError, match="at least 2"):
        capture_cp(_scenario(), timing=TIMING, mesh={"shard": 2, "cp": 1})
    with pytest.raises(ValueError, match="rotate_method"):
        capture_cp(_scenario(), timing=TIMING, mesh={"shard": 1, "cp": 2}, rotate_method="ring")


# -- the registry: cp:N is a registered parallelism ----------------------------------------

def test_whatif_replays_a_cp_layout_through_the_registry():
    from simddp.whatif import whatif

    rows = whatif("llama3-tiny", parallel="cp:2,fsdp", world_size=[2, 16], network="dgx-h100",
                  gpu="h100", cache=False, reshard_after_forward=[True, False])
    assert all(isinstance(c, CapturedCP) and c.mesh == {"shard": 1, "cp": 2}
               for c in rows.captures)
    # FSDP2's options apply to a CP layout: one capture per reshard_after_forward
    captures = {id(c): c for c in rows.captures}.values()
    assert sorted(c.reshard_after_forward for c in captures) == [False, True]
    assert [(r["world_size"], sorted(r["exposed_comm_by_dim"])) for r in rows] == \
        [(n, ["cp", "shard_cp"]) for n in (2, 16, 2, 16)]


def test_a_cp_capture_loads_as_itself_from_its_json(tmp_path):
    from simddp.program.captured import load_capture

    cap = cap_of(shard=1, cp=2)
    cap.save(tmp_path / "cap.json")
    back = load_capture(tmp_path / "cap.json")
    assert type(back) is CapturedCP and back == cap
