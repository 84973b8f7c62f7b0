"""The step program: what a planner writes, what both engines run, and what they refuse."""

import pytest

from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.program import Config, Issue, Knobs, Memory, Parallel, Segment, peak_memory, plan
from simddp.replay import replay
from simddp import capture
from simddp.replay.vector_engine import unsupported

NET = Network.preset("ib-ndr", gpus_per_node=8)
TIMING = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"))


@pytest.fixture(scope="module")
def mlp():
    return capture(zoo.get("mlp", bucket_cap_mb=0.02), 2, timing=TIMING)


def test_the_ddp_planner_writes_forward_backward_with_one_mark_per_bucket_then_the_step(mlp):
    prog = plan(mlp, Knobs().checked(16, NET))
    ins = prog.iteration(0, 0)
    kinds = [type(x).__name__ for x in ins]
    assert kinds == ["Segment", "Segment", "WaitAll", "Compute", "Compute", "Compute"]
    forward, backward = ins[0], ins[1]
    assert forward.kind == "forward" and not forward.anchored
    assert backward.kind == "backward" and backward.anchored
    issued = [m.do for m in backward.marks if isinstance(m.do, Issue)]
    assert len(issued) == len(prog.buckets) == len(mlp.buckets())
    assert [x.first.nbytes for x in issued] == [
        sum(mlp.params[i].nbytes for i in b) for b in prog.buckets]
    assert [c.kind for c in ins[3:]] == ["backward", "forward", "optimizer"]


def test_a_comm_hook_changes_the_program_not_the_engines(mlp):
    fp16 = plan(mlp, Knobs(comm_hook="fp16").checked(16, NET)).iteration(0, 0)[1]
    plain = plan(mlp, Knobs().checked(16, NET)).iteration(0, 0)[1]
    for a, b in zip(fp16.marks, plain.marks):
        assert a.do.first.nbytes * 2 == b.do.first.nbytes  # half the bytes on the wire
        assert a.do.pre > 0 and b.do.pre == 0  # the cast before the issue


def test_the_vectorised_engine_says_precisely_what_it_does_not_run(mlp):
    checked = Knobs(uneven={3: 1}, iterations=2).checked(16, NET)
    assert "uneven inputs" in unsupported(plan(mlp, checked), checked)
    with pytest.raises(ValueError, match="not vectorised: uneven inputs"):
        replay(mlp, 16, network=NET, uneven={3: 1}, iterations=2, engine="vector",
               progress=False)


def test_a_joined_rank_shadows_the_buffers_broadcast_so_no_rank_waits_forever():
    cap = capture(zoo.get("buffers"), 2, timing=TIMING)
    assert cap.profiles[0].forward_collectives  # DDP broadcasts the buffers in forward
    res = replay(cap, 8, network=NET, uneven={1: 1, 5: 0}, iterations=2, progress=False)
    assert len(res.iteration_times) == 2
    each = replay(cap, 8, network=NET, uneven={1: 1, 5: 0}, iterations=2, per_rank=True,
                  progress=False)
    assert res.to_json() == each.to_json()
    shadow = [c for c in res.collectives if c["op"] == "broadcast" and "fwd" in c["name"]]
    assert len(shadow) == 2 * len(cap.profiles[0].forward_collectives)  # both iterations


def test_peak_memory_walks_allocations_and_frees_in_program_order():
    ins = [Memory("parameters", 10), Segment("forward", (1.0,), 0, ()),
           Memory("activations", 30), Memory("parameters", -10), Memory("activations", -30)]
    peak, at_peak, end = peak_memory(ins, {"optimizer": 5})
    assert peak == 45 and at_peak == {"optimizer": 5, "parameters": 10, "activations": 30}
    assert end == {"optimizer": 5, "parameters": 0, "activations": 0}


def test_an_unknown_knob_is_refused_naming_the_knobs():
    with pytest.raises(TypeError, match="unknown replay knob.*bucket_size.*bucket_cap_mb"):
        Knobs.of(bucket_size=5)
    with pytest.raises(TypeError, match="unknown replay knob"):
        Config.from_kwargs({"world_size": 8, "hook": "fp16"})


def test_a_config_round_trips_through_replay_keywords():
    c = Config.from_kwargs({"world_size": 64, "network": "ib-ndr", "comm_hook": "fp16",
                            "rank_speed": {3: 0.5}})
    assert c.as_kwargs() == {"world_size": 64, "network": "ib-ndr", "comm_hook": "fp16",
                             "rank_speed": {3: 0.5}}
    assert Config.from_kwargs(c.as_kwargs()) == c


@pytest.mark.parametrize("spec,world,dims", [
    ("fsdp", 64, {"shard": 64}),
    ("hsdp:8", 64, {"replicate": 8, "shard": 8}),
    ("fsdp:32,tp:8", 256, {"shard": 32, "tp": 8}),
    ("pp:4,fsdp:16,tp:8", 512, {"pp": 4, "shard": 16, "tp": 8}),
    ("ddp", 8, {"replicate": 8}),
])
def test_parallel_specs_lay_the_world_out_as_torchtitan_does(spec, world, dims):
    mesh = Parallel.parse(spec, world).mesh()
    assert mesh.dims == dims and list(mesh.dims) == [k for k in
                                                      ("pp", "replicate", "shard", "tp")
                                                      if k in dims]


@pytest.mark.parametrize("spec,world,words", [
    ("zero4", 8, "unknown parallel mode 'zero4'"),
    ("fsdp:3", 8, "lays out 3 ranks, the world has 8"),
    ("fsdp,tp", 8, "leaves data and tp without a size"),
    ("hsdp", 8, "hsdp needs its shard size"),
    ("hsdp:3", 8, "do not divide world size 8"),
])
def test_a_bad_parallel_spec_says_what_is_wrong_and_shows_the_grammar(spec, world, words):
    with pytest.raises(ValueError, match=words):
        Parallel.parse(spec, world)


def test_a_device_mesh_groups_ranks_row_major_with_the_last_dimension_innermost():
    mesh = Parallel.parse("hsdp:4", 16).mesh()
    assert list(mesh.members(5, "shard")) == [4, 5, 6, 7]
    assert list(mesh.members(5, "replicate")) == [1, 5, 9, 13]
    codes, n = mesh.codes("shard")
    assert n == 4 and codes.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4

