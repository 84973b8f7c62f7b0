"""torchtitan's activation-checkpointing policies (full, selective-op, selective-layer:N), run
through torch's checkpoint API in one place (simddp/cosim/checkpointing.py) for every capture."""

import pytest
import torch
from fakepg import zoo
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from simddp import Compute, Timing
from simddp.cosim import checkpointing
from simddp.cosim.capture_fsdp import capture_fsdp


def _blocks(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))


@pytest.mark.parametrize("policy,wrapped", [("full", [0, 1, 2, 3]), ("selective-op", [0, 1, 2, 3]),
                                            ("selective-layer:2", [1, 3]),
                                            ("selective-layer:3", [2]), ("none", [])])
def test_a_policy_wraps_the_blocks_torchtitan_wraps(policy, wrapped):
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
    checkpointing.apply(blocks, policy)
    assert [i for i, b in enumerate(blocks) if isinstance(b, CheckpointWrapper)] == wrapped


@pytest.mark.parametrize("policy", ["full", "selective-op", "selective-layer:2"])
def test_checkpointed_training_computes_the_gradients_of_the_plain_model(policy):
    sc = zoo.get("llama3-tiny")
    plain, ac = sc.build_model(), sc.build_model()
    checkpointing.apply(_blocks(ac), policy)
    batch = sc.inputs(0, 1)[0]
    for model in (plain, ac):
        sc.step(model, batch).backward()
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_selective_op_saves_matmuls_and_attention_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    policy = checkpointing._op_policy()

    class Ctx:
        is_recompute = False
    mm, sdpa = torch.ops.aten.mm.default, \
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    got = [policy(Ctx, f) for f in (mm, mm, mm, sdpa, torch.ops.aten.silu.default)]
    assert got == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE,
                   CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE,
                   CheckpointPolicy.PREFER_RECOMPUTE]  # every second mm is recomputed


def test_what_a_policy_keeps_lies_between_full_checkpointing_and_none():
    sc = zoo.get("llama3-tiny", batch_size=2)
    timing = Timing(compute=Compute.roofline("a100"))
    caps = {p: capture_fsdp(sc, 2, timing=timing, activation_checkpointing=p)
            for p in (None, "full", "selective-op", "selective-layer:2")}
    held = {p: c.activation_bytes for p, c in caps.items()}
    assert held["full"] < held["selective-op"] < held[None]
    assert held["full"] < held["selective-layer:2"] < held[None]
    backward = {p: c.profiles[0]["backward"]["seconds"] for p, c in caps.items()}
    assert backward[None] < backward["selective-layer:2"] < backward["full"]  # recomputation
    assert backward[None] < backward["selective-op"] <= backward["full"]


def test_the_flag_without_a_value_means_full():
    from simddp.cli import _parser

    args = _parser().parse_args(["whatif", "mlp", "--activation-checkpointing"])
    assert args.activation_checkpointing == "full"
    args = _parser().parse_args(["whatif", "mlp", "--activation-checkpointing",
                                 "selective-layer:2"])
    assert args.activation_checkpointing == "selective-layer:2"
