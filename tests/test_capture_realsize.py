"""Capture at real size without arithmetic: the Llama-3 zoo model's published shapes, and
``simddp.capture(device="meta")`` — the real DDP / FSDP2 step on meta tensors — recording what
the same capture with real tensors records."""

from __future__ import annotations

import pytest
import torch

from fakepg import zoo
from models.llama import LLAMA3_405B, LLAMA3_70B, LLAMA3_8B, LLAMA3_TINY, Llama, LlamaArgs
from simddp import Compute, Timing
from simddp.cosim.capture import capture
from simddp.program.captured import CapturedIteration

TIMING = Timing(compute=Compute.roofline("h100"))


def _params_on_meta(args: LlamaArgs) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(args).parameters())


def test_llama3_8b_has_its_published_parameter_count():
    assert LLAMA3_8B.ffn_hidden_dim == 14336
    assert _params_on_meta(LLAMA3_8B) == LLAMA3_8B.num_params() == 8_030_261_248


def test_llama3_70b_has_its_published_parameter_count():
    assert LLAMA3_70B.ffn_hidden_dim == 28672
    assert _params_on_meta(LLAMA3_70B) == LLAMA3_70B.num_params() == 70_553_706_496


def test_llama3_405b_has_its_published_parameter_count():
    assert LLAMA3_405B.ffn_hidden_dim == 53248
    assert _params_on_meta(LLAMA3_405B) == LLAMA3_405B.num_params() == 405_853_388_800


def test_tied_embeddings_count_the_shared_weight_once():
    tied = LlamaArgs(**{**LLAMA3_TINY.__dict__, "tie_embeddings": True})
    assert _params_on_meta(tied) == tied.num_params() \
        == LLAMA3_TINY.num_params() - LLAMA3_TINY.vocab_size * LLAMA3_TINY.dim


def test_bad_llama_shapes_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="n_heads 4 must be a multiple of n_kv_heads 3"):
        LlamaArgs(dim=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="seq_len must be in 1..8192"):
        zoo.get("llama3-8b", seq_len=10_000)


def test_llama3_workloads_are_registered_with_torchtitans_batch():
    for name in ("llama3-8b", "llama3-70b", "llama3-tiny"):
        assert name in zoo.WORKLOADS
    sc = zoo.get("llama3-8b")
    tokens, targets = sc.inputs(0, 8)[0]
    assert tokens.shape == targets.shape == (1, 8192) and tokens.dtype == torch.int64
    assert torch.equal(tokens[0, 1:], targets[0, :-1])  # next-token targets


def test_tiny_llama_trains_on_cpu():
    sc = zoo.get("llama3-tiny", iterations=6)
    model = sc.build_model()
    opt = sc.optimizer(model.parameters())
    batch = sc.inputs(0, 1)[0]
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = sc.step(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _program(cap: CapturedIteration, rank: int) -> list[tuple]:
    """A rank's collectives in issue order: op, bytes, group size, phase."""
    return [(c["op"], c["bytes"], c["group_size"], c["phase"])
            for c in cap.profiles[rank].collectives]


def _offsets(cap: CapturedIteration, rank: int) -> list[float | None]:
    return [x for c in cap.profiles[rank].collectives for x in (c["offset"], c["wait_at"])]


# Virtual times are differences of absolute clocks, which other work before the recorded
# iteration shifts (DDP's constructor collectives run on real tensors only): equal to rounding.
SAME = dict(rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_meta_capture_records_what_the_real_capture_records(parallel):
    sc = zoo.get("llama3-tiny")
    real = capture(sc, 2, timing=TIMING, parallel=parallel)
    meta = capture(sc, 2, timing=TIMING, parallel=parallel, device="meta")
    assert (real.device, meta.device) == ("cpu", "meta")
    for rank in range(2):
        assert _program(meta, rank) == _program(real, rank)  # same collectives, same order
        a, b = real.profiles[rank], meta.profiles[rank]
        # compute costed from shapes alone: the same without data
        assert [x is None for x in _offsets(meta, rank)] == [x is None for x in _offsets(real, rank)]
        assert [x for x in _offsets(meta, rank) if x is not None] == \
            pytest.approx([x for x in _offsets(real, rank) if x is not None], **SAME)
        assert (b.forward, b.backward, b.optimizer) == \
            pytest.approx((a.forward, a.backward, a.optimizer), **SAME)
        assert b.marks == pytest.approx(a.marks, **SAME)
        assert [r is None for r in a.ready] == [r is None for r in b.ready]
        assert [r for r in b.ready if r is not None] == \
            pytest.approx([r for r in a.ready if r is not None], **SAME)
    assert meta.cosim_iteration_time == pytest.approx(real.cosim_iteration_time, **SAME)
    assert [p.name for p in meta.params] == [p.name for p in real.params]
    assert meta.bucket_indices == real.bucket_indices
    assert meta.fsdp_groups == real.fsdp_groups


def test_meta_ddp_capture_replays_like_the_real_one():
    from simddp.replay import replay

    sc = zoo.get("llama3-tiny")
    real = capture(sc, 2, timing=TIMING)
    meta = capture(sc, 2, timing=TIMING, device="meta")
    assert meta.profiles[0].collectives[-1]["op"] == "all_reduce"  # the bucket
    a = replay(real, world_size=64)
    b = replay(CapturedIteration.from_json(meta.to_json()), world_size=64)
    assert b.iteration_time == pytest.approx(a.iteration_time, **SAME)


def test_fsdp_capture_holds_its_all_gathers_and_reduce_scatters_in_issue_order():
    sc = zoo.get("llama3-tiny")
    cap = capture(sc, 4, timing=TIMING, parallel="fsdp", device="meta")
    groups = cap.fsdp_groups
    assert [g["module"] for g in groups] == ["", "layers.0", "layers.1"]
    unsharded = [sum(int(torch.Size(p["shape"]).numel()) for p in g["params"]) * 4
                 for g in groups]  # float32
    padded = [sum(p["padded_shard_numel"] for p in g["params"]) * 4 * 4 for g in groups]
    prog = cap.profiles[0].collectives
    ag = [c for c in prog if c["op"] == "all_gather_into_tensor"]
    rs = [c for c in prog if c["op"] == "reduce_scatter_tensor"]
    # forward: root, then each block; backward re-gathers the resharded blocks in reverse
    assert [c["bytes"] for c in ag if c["phase"] == "forward"] == padded
    assert [c["bytes"] for c in ag if c["phase"] == "backward"] == [padded[2], padded[1]]
    assert [c["bytes"] for c in rs] == [padded[2], padded[1], padded[0]]
    assert all(c["group_size"] == 4 for c in prog)
    assert unsharded[1] <= padded[1]
    assert [c["offset"] for c in prog] == sorted(c["offset"] for c in prog)
    assert cap.parallel == "fsdp" and cap.bucket_indices == []


def test_capture_options_are_checked():
    sc = zoo.get("llama3-tiny")
    with pytest.raises(ValueError, match="device must be one of cpu, meta"):
        capture(sc, 2, device="cuda:7")
    with pytest.raises(ValueError, match="parallel must be one of ddp, fsdp"):
        capture(sc, 2, parallel="zero3")
    with pytest.raises(ValueError, match="find_unused_parameters"):
        capture(sc, 2, device="meta", ddp_kwargs={"find_unused_parameters": True})
    with pytest.raises(ValueError, match="fsdp_kwargs"):
        capture(sc, 2, parallel="fsdp", ddp_kwargs={"bucket_cap_mb": 1})


def test_fsdp_knobs_change_the_captured_program_as_torch_does():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    sc = zoo.get("llama3-tiny")
    plain = capture(sc, 2, timing=TIMING, parallel="fsdp", device="meta")
    knobs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32),
             "reshard_after_forward": False}
    meta = capture(sc, 2, timing=TIMING, parallel="fsdp", device="meta", fsdp_kwargs=knobs)
    real = capture(sc, 2, timing=TIMING, parallel="fsdp", fsdp_kwargs=knobs)
    assert _program(meta, 0) == _program(real, 0)
    ag = lambda cap, phase: [c["bytes"] for c in cap.profiles[0].collectives  # noqa: E731
                             if c["op"] == "all_gather_into_tensor" and c["phase"] == phase]
    assert ag(meta, "forward") == [b // 2 for b in ag(plain, "forward")]  # bf16 parameters
    assert ag(meta, "backward") == []  # not resharded after forward: nothing to re-gather
    rs = lambda cap: [c["bytes"] for c in cap.profiles[0].collectives  # noqa: E731
                      if c["op"] == "reduce_scatter_tensor"]
    assert rs(meta) == rs(plain)  # gradients reduced in float32
    assert {g["param_dtype"] for g in meta.fsdp_groups} == {"bfloat16"}
    assert not any(g["reshard_after_forward"] for g in meta.fsdp_groups)


def test_fsdp_on_meta_patches_fsdp2_only_while_active():
    import importlib

    from simddp.cosim.meta import fsdp_on_meta

    fully_shard = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    group = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    before = (fully_shard._get_device_from_mesh,
              group.FSDPParamGroup._validate_no_meta_params)
    with fsdp_on_meta():
        assert fully_shard._get_device_from_mesh(None) == torch.device("meta")
    assert (fully_shard._get_device_from_mesh,
            group.FSDPParamGroup._validate_no_meta_params) == before
