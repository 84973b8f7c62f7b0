"""The parallelism registry: one parser resolves a --parallel spec against it, every stage
reads the one object, and a parallelism is a registration (simddp/program/registry.py)."""

import pytest

from simddp import Compute, Network, Timing
from simddp.program import plan, registry
from simddp.program.parallel import Parallel, UsageError
from simddp.program.registry import Parallelism


@pytest.mark.parametrize("spec,world,fields", [
    ("dp:4,tp:2", 8, dict(data="hsdp", flavour="dp", replicate=4, shard=1, tp=2,
                          reshard_after_forward=False)),
    ("zero3", 8, dict(data="fsdp", flavour="zero3", shard=8, reshard_after_forward=True)),
    ("zero1", 8, dict(data="fsdp", flavour="zero1", shard=8, reshard_after_forward=False)),
    ("zero2:4,tp:2", 8, dict(data="fsdp", shard=4, tp=2, reshard_after_forward=False)),
    ("distributed-optimizer,tp:2", 8, dict(data="fsdp", shard=4, tp=2,
                                            reshard_after_forward=False)),
    ("pp:2,dp,tp:2", 16, dict(data="hsdp", pp=2, replicate=4, shard=1, tp=2)),
    ("hsdp:4,tp:2", 16, dict(data="hsdp", replicate=2, shard=4, tp=2,
                             reshard_after_forward=None)),
])
def test_megatron_and_zero_names_resolve_to_what_torch_runs(spec, world, fields):
    par = Parallel.parse(spec, world)
    assert {k: getattr(par, k) for k in fields} == fields
    assert par.world_size == world and par.not_replayed() is None


def test_the_mesh_is_pp_replicate_shard_cp_tp_row_major():
    from simddp.program.registry import MESH_ORDER

    assert MESH_ORDER == ("pp", "replicate", "shard", "cp", "tp")
    mesh = Parallel.parse("pp:2,dp:2,tp:2", 8).mesh()
    assert list(mesh.dims) == ["pp", "replicate", "shard", "tp"] and mesh.dims["shard"] == 1
    assert list(mesh.members(5, "tp")) == [4, 5] and list(mesh.members(5, "pp")) == [1, 5]


@pytest.mark.parametrize("spec,words", [
    ("fsdp:0", "'fsdp:0': a size is a positive integer"),
    ("hsdp", "hsdp needs its shard size"),
    ("cp:0", "'cp:0': a size is a positive integer"),
    ("fsdp,fsdp", "names the data dimension twice"),
    ("ddp,fsdp", "names the data dimension twice (ddp and fsdp)"),
    ("", "an empty --parallel spec"),
    ("fsdp,,tp:2", "an empty dimension"),
    ("tp:", "a size after ':' is a positive integer"),
    ("ep:4", "unknown parallel mode 'ep'"),
])
def test_a_malformed_spec_names_what_is_wrong_whatever_the_world(spec, words):
    for world in (1, 8, 64):
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
            Parallel.parse(spec, world)
    with pytest.raises(UsageError):
        Parallel.fixed_world_size(spec)


@pytest.mark.parametrize("spec,world", [("pp:4,fsdp:16,tp:8", 512), ("dp:8,tp:8", 64),
                                        ("fsdp", None), ("hsdp:8", None), ("pp:2,fsdp", None),
                                        ("zero3:4", 4)])
def test_the_world_size_a_spec_fixes(spec, world):
    assert Parallel.fixed_world_size(spec) == world


def test_layouts_that_do_not_compose_say_why_and_what_would():
    assert "dp:N,tp:T" in Parallel.parse("ddp:4,tp:2", 8).not_replayed()
    assert "FSDP2" in Parallel.parse("pp:2,ddp:2", 4).not_replayed()
    assert Parallel.parse("pp:2,ddp:1", 2).not_replayed() is None  # one replica: no DDP


def test_the_owner_of_a_capture_is_the_outermost_parallelism_with_one():
    assert Parallel.parse("pp:2,fsdp:2,tp:2", 8).owner().name == "pp"
    assert Parallel.parse("fsdp:2,tp:2", 4).owner().name == "fsdp"
    assert Parallel.parse("dp:2,tp:2", 4).owner().name == "dp"
    assert Parallel.parse("ddp", 4).owner().name == "ddp"
    keys = {Parallel.parse(s, 8).capture_key() for s in ("fsdp", "fsdp:4,tp:2", "zero3", "dp")}
    assert len(keys) == 4  # each captures its own program


def test_a_registered_parallelism_parses_captures_and_plans_without_touching_anything_else(
        monkeypatch):
    from fakepg import zoo
    from simddp.whatif import whatif

    # a new data-parallel flavour, registered in one place: FSDP2 that keeps parameters
    # gathered (its capture and planner are the FSDP2 ones, named by reference)
    mine = Parallelism("my-sharding", "data", "a test's flavour", data="fsdp", layout="shard",
                       reshard_after_forward=False,
                       capture="simddp.parallelisms:capture_fsdp2",
                       captured="simddp.program.captured:CapturedStep",
                       planner="simddp.program.fsdp:plan_fsdp", owner_rank=10,
                       composes_with=frozenset({"tp"}))
    monkeypatch.setitem(registry.REGISTRY, mine.name, mine)
    said = []
    rows = whatif(zoo.get("mlp", batch_size=4), world_size=[4, 8], parallel="my-sharding",
                  status=said.append, cache=False)
    assert [r["world_size"] for r in rows] == [4, 8] and rows[0]["reshard_after_forward"] is False
    assert any("reshard_after_forward=False" in s for s in said)
    assert Parallel.parse("my-sharding,tp:2", 8).not_replayed() is None
    assert "my-sharding does not compose with pp" in \
        Parallel.parse("pp:2,my-sharding:2", 4).not_replayed()


def test_plan_dispatches_through_the_registry_and_refuses_an_unknown_capture():
    from simddp.program.knobs import Knobs

    checked = Knobs().checked(4, Network.preset("ib-ndr"))
    with pytest.raises(TypeError, match="no planner for dict: the captures replay knows are "
                                        "CapturedCP, CapturedIteration, CapturedPipeline, CapturedStep"):
        plan({}, checked)


def test_registering_a_name_twice_is_refused_and_a_bad_dimension_too():
    with pytest.raises(ValueError, match="'fsdp' is registered already"):
        registry.register(Parallelism("fsdp", "shard", "again"))
    with pytest.raises(ValueError, match="dim 'experts' is not 'data' or one of"):
        Parallelism("ep", "experts", "expert parallelism")


def test_megatron_dp_with_tp_and_bf16_runs_as_fsdp2_with_one_shard():
    from fakepg import zoo
    from simddp.whatif import whatif

    said = []
    rows = whatif(zoo.get("llama3-tiny"), world_size=8, parallel=["dp:4,tp:2", "zero3"],
                  param_dtype="bf16", status=said.append, cache=False,
                  compute=Compute.roofline("a100"))
    assert [r["parallel"] for r in rows] == ["dp:4,tp:2", "zero3"]
    assert [r["reshard_after_forward"] for r in rows] == [False, True]
    assert all(r["iteration_time_s"] > 0 for r in rows)
    assert any("on 4 fake ranks" in s and "tp=2" in s for s in said)  # 2 replicas × tp 2
    # Megatron DP all-reduces over replicas: no FSDP2 shard traffic at one shard
    assert set(rows[0]["exposed_comm_by_dim"]) == {"replicate", "tp"}


def test_param_dtype_applies_to_ddp_and_no_sequence_parallel_to_tp():
    from fakepg import zoo
    from simddp.whatif import whatif

    fp32 = whatif(zoo.get("mlp"), world_size=4, cache=False)
    bf16 = whatif(zoo.get("mlp"), world_size=4, param_dtype="bf16", cache=False)
    assert bf16.captured.params[0].dtype == "bfloat16"  # DDP trains the bf16 model
    assert bf16[0]["comm_bytes_per_iteration"] * 2 == fp32[0]["comm_bytes_per_iteration"]
    plain = whatif(zoo.get("llama3-tiny"), world_size=4, parallel="fsdp,tp:2",
                   sequence_parallel=False, cache=False)
    assert plain.captured.sequence_parallel is False
