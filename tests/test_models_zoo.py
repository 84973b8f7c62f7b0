"""Specs for the scenario zoo (``fakepg.zoo``, the repository's ``models/``): determinism, the DDP feature each scenario claims to
exercise, and the single-process reference.  No process group is created here: everything is
checked with plain autograd, so the file runs in a few seconds.
"""

from __future__ import annotations

import ast
import doctest
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fakepg import zoo
from fakepg.zoo import Scenario

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(zoo.SCENARIOS)


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested batches (tuples/lists of tensors and plain values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def ready_order(sc: Scenario, batch: Any) -> list[int]:
    """Indices (in registration order) of parameters, in the order their grads become ready."""
    model = sc.build_model()
    params = list(model.parameters())
    order: list[int] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
    sc.step(model, batch).backward()
    return order


def buckets(params: list[torch.Tensor], cap_mb: float, order: list[int] | None = None) -> set:
    """Buckets (sets of registration indices) of DDP's size-capped assignment over ``order``:
    initially reverse registration order; when rebuilt, the grad-ready order."""
    order = list(reversed(range(len(params)))) if order is None else order
    indices, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], [int(cap_mb * 1024 * 1024)]
    )
    return {frozenset(order[i] for i in bucket) for bucket in indices}


# -- every scenario ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_scenario_builds_the_same_model_for_the_same_seed(name: str) -> None:
    sc = zoo.get(name)
    torch.manual_seed(sc.seed)
    a = sc.model().state_dict()
    rng = torch.random.get_rng_state()
    b = sc.build_model().state_dict()
    assert torch.equal(torch.random.get_rng_state(), rng), "build_model must restore the caller's RNG"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = sc.with_(seed=sc.seed + 1).build_model().state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("weight"))


@pytest.mark.parametrize("name", NAMES)
def test_batches_are_deterministic_per_rank_and_differ_between_ranks(name: str) -> None:
    sc = zoo.get(name)
    rng = torch.random.get_rng_state()
    torch.manual_seed(123)  # the global RNG must play no part in the data
    first = [sc.inputs(r, 3) for r in range(3)]
    torch.manual_seed(456)
    again = [sc.inputs(r, 3) for r in range(3)]
    torch.random.set_rng_state(rng)
    assert same(first, again)
    for r in range(3):
        assert len(first[r]) >= 1
        assert not same(first[r][0][0], first[(r + 1) % 3][0][0]), "ranks must see different data"
    # Rank r's data does not depend on the world size (bigger worlds just add ranks).
    assert same(sc.inputs(1, 2), first[1])


def test_inputs_move_to_a_device_without_changing_values() -> None:
    sc = zoo.get("rank_dependent_unused")
    moved = sc.inputs(1, 2, device="meta")
    assert all(b[0].device.type == "meta" and isinstance(b[2], int) for b in moved)
    assert same(sc.inputs(1, 2, device="cpu"), sc.inputs(1, 2))


def test_batches_do_not_touch_the_global_rng() -> None:
    state = torch.random.get_rng_state()
    for name in NAMES:
        zoo.get(name).inputs(0, 2)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("name", NAMES)
def test_every_scenario_trains_a_step_on_one_rank_and_pickles(name: str) -> None:
    sc = zoo.get(name)
    model = sc.build_model()
    opt = sc.optimizer(model.parameters())
    loss = sc.step(model, sc.inputs(0, 2)[0])
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    opt.step()
    # Real-backend harnesses spawn processes: the scenario must survive pickling.
    clone = pickle.loads(pickle.dumps(sc))
    assert clone.name == sc.name and same(clone.inputs(1, 2), sc.inputs(1, 2))
    assert sc.features and sc.description


def test_registry_has_the_promised_scenarios_and_get_routes_overrides() -> None:
    assert set(NAMES) == {
        "mlp", "many_small_few_large", "grad_order_differs", "grad_order_differs_per_rank",
        "rank_dependent_unused", "tied_weights", "buffers", "sparse_embedding", "mixed_dtypes",
        "transformer_block", "param_order", "uneven_inputs",
    }
    for name in NAMES:
        assert zoo.get(name).name == name
    sc = zoo.get("mlp", depth=3, width=16, ddp_kwargs={"static_graph": True}, iterations=2)
    assert sum(1 for k in sc.build_model().state_dict() if k.endswith("weight")) == 3
    assert sc.ddp_kwargs == {"static_graph": True} and len(sc.inputs(0, 1)) == 2
    with pytest.raises(KeyError, match="known"):
        zoo.get("nope")


def test_with_reseeds_data_resizes_it_and_with_ddp_merges() -> None:
    sc = zoo.get("mlp", iterations=3)
    assert not same(sc.with_(seed=9).inputs(0, 1), sc.inputs(0, 1))
    longer = sc.with_(iterations=5).inputs(0, 1)
    assert len(longer) == 5 and same(longer[:3], sc.inputs(0, 1)), "batch i must not depend on count"
    assert len(sc.with_(iterations=1).inputs(0, 1)) == 1
    merged = zoo.get("rank_dependent_unused").with_ddp(gradient_as_bucket_view=True)
    assert merged.ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}
    assert zoo.get("rank_dependent_unused").ddp_kwargs == {"find_unused_parameters": True}


# -- the feature each scenario exercises --------------------------------------------------------


def test_uneven_inputs_gives_different_batch_counts() -> None:
    sc = zoo.get("uneven_inputs", base=2)
    assert sc.iterations is None
    assert sc.batch_counts(4) == [2, 3, 4, 5]
    assert zoo.get("mlp").batch_counts(4) == [5, 5, 5, 5]


def test_grad_order_differs_from_registration_order() -> None:
    sc = zoo.get("grad_order_differs")
    n = len(list(sc.build_model().parameters()))
    order = ready_order(sc, sc.inputs(0, 1)[0])
    assert sorted(order) == list(range(n))
    # DDP's initial buckets assume reverse registration order; this model follows neither.
    assert order != list(range(n)) and order != list(reversed(range(n)))
    # With the scenario's small cap, buckets built from the ready order (DDP's rebuild) group the
    # parameters differently from the initial assignment.
    params, cap = list(sc.build_model().parameters()), sc.ddp_kwargs["bucket_cap_mb"]
    assert len(buckets(params, cap)) >= 3
    assert buckets(params, cap, order) != buckets(params, cap)


def test_per_rank_variant_gives_each_rank_its_own_grad_order_with_rank_0_as_the_plain_one() -> None:
    plain = zoo.get("grad_order_differs")
    sc = zoo.get("grad_order_differs_per_rank")
    orders = [ready_order(sc, sc.inputs(r, 3)[0]) for r in range(3)]
    assert orders[0] == ready_order(plain, plain.inputs(0, 1)[0])
    assert len({tuple(o) for o in orders}) == 3


def test_rank_dependent_unused_parameters_differ_between_ranks() -> None:
    sc = zoo.get("rank_dependent_unused")
    assert sc.ddp_kwargs.get("find_unused_parameters") is True
    used: list[set[str]] = []
    for r in range(2):
        model = sc.build_model()
        sc.step(model, sc.inputs(r, 2)[0]).backward()
        used.append({k for k, p in model.named_parameters() if p.grad is not None})
    assert used[0] != used[1]
    assert not any(k.startswith("dead.") for k in used[0] | used[1]), "dead layer is never used"
    assert "trunk.weight" in used[0] & used[1]


def test_tied_weights_share_one_parameter() -> None:
    model = zoo.get("tied_weights").build_model()
    assert model.embed.weight is model.proj.weight
    names = [k for k, _ in model.named_parameters()]
    assert "proj.weight" not in names, "parameters() yields the tied tensor once"
    assert "proj.weight" in model.state_dict()


def test_buffers_change_in_a_training_forward() -> None:
    sc = zoo.get("buffers")
    model = sc.build_model()
    before = {k: v.clone() for k, v in model.named_buffers()}
    sc.step(model, sc.inputs(0, 1)[0])
    after = dict(model.named_buffers())
    assert set(before) >= {"bn.running_mean", "bn.running_var", "center.running_mean", "center.steps"}
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert int(after["center.steps"]) == 1


def test_sparse_embedding_produces_sparse_grads() -> None:
    sc = zoo.get("sparse_embedding")
    model = sc.build_model()
    sc.step(model, sc.inputs(0, 1)[0]).backward()
    assert model.embed.weight.grad.is_sparse and not model.head.weight.grad.is_sparse


def test_mixed_dtypes_splits_buckets_by_dtype() -> None:
    params = list(zoo.get("mixed_dtypes").build_model().parameters())
    assert {p.dtype for p in params} == {torch.float32, torch.float64}
    indices, _ = dist._compute_bucket_assignment_by_size(params, [2**62])
    assert len(indices) == 2, "even an unlimited first bucket splits by dtype"
    assert all(len({params[i].dtype for i in bucket}) == 1 for bucket in indices)


def test_many_small_few_large_forms_several_buckets_of_uneven_size() -> None:
    sc = zoo.get("many_small_few_large")
    params = list(sc.build_model().parameters())
    sizes = sorted(p.numel() for p in params)
    assert len(params) >= 30 and sizes[-1] > 50 * sizes[0]
    assert len(buckets(params, sc.ddp_kwargs["bucket_cap_mb"])) >= 4


def test_transformer_block_has_no_dropout() -> None:
    sc = zoo.get("transformer_block")
    model = sc.build_model()
    batch = sc.inputs(0, 1)[0]
    assert torch.equal(sc.step(model, batch), sc.step(model, batch)), "training forward is deterministic"
    assert any(isinstance(m, torch.nn.TransformerEncoderLayer) for m in model.modules())


def test_param_order_changes_registration_but_not_values() -> None:
    fwd = zoo.get("param_order", order="forward").build_model()
    rev = zoo.get("param_order", order="reversed").build_model()
    fwd_names = [k for k, _ in fwd.named_parameters()]
    rev_names = [k for k, _ in rev.named_parameters()]
    assert fwd_names != rev_names and sorted(fwd_names) == sorted(rev_names)
    assert all(torch.equal(v, rev.state_dict()[k]) for k, v in fwd.state_dict().items())


# -- the reference -------------------------------------------------------------------------------


def test_reference_matches_manual_two_rank_average() -> None:
    """DDP's gradient is the mean of per-rank mean-losses' gradients; with equal per-rank batch
    sizes that is also the gradient of the mean loss over the concatenated global batch."""
    sc = zoo.get("mlp", depth=3, width=16, iterations=1)
    ref = zoo.reference_train(sc, world_size=2)
    (x0, y0), (x1, y1) = sc.inputs(0, 2)[0], sc.inputs(1, 2)[0]
    assert x0.shape == x1.shape

    def sgd_after(loss_fn) -> dict[str, torch.Tensor]:
        model = sc.build_model()
        grads = torch.autograd.grad(loss_fn(model), list(model.parameters()))
        return {k: p.detach() - 0.1 * g for (k, p), g in zip(model.named_parameters(), grads)}

    per_rank = sgd_after(lambda m: (F.mse_loss(m(x0), y0) + F.mse_loss(m(x1), y1)) / 2)
    full = sgd_after(lambda m: F.mse_loss(m(torch.cat([x0, x1])), torch.cat([y0, y1])))
    for k in per_rank:
        torch.testing.assert_close(ref[k], per_rank[k], rtol=0, atol=1e-7)
        torch.testing.assert_close(ref[k], full[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ref["l0.weight"], sc.build_model().state_dict()["l0.weight"])


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), depth=st.integers(1, 4), iterations=st.integers(1, 3))
def test_reference_on_one_rank_is_plain_training(seed: int, depth: int, iterations: int) -> None:
    sc = zoo.get("mlp", seed=seed, depth=depth, width=8, batch_size=4, iterations=iterations)
    model = sc.build_model()
    opt = sc.optimizer(model.parameters())
    for batch in sc.inputs(0, 1):
        opt.zero_grad(set_to_none=True)
        sc.step(model, batch).backward()
        opt.step()
    ref = zoo.reference_train(sc, 1)
    assert all(torch.equal(ref[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", NAMES)
def test_reference_is_deterministic_and_runs_every_reference_ok_scenario(name: str) -> None:
    sc = zoo.get(name)
    assert sc.reference_ok
    a, b = zoo.reference_train(sc, 3), zoo.reference_train(sc, 3)
    assert a.keys() == sc.build_model().state_dict().keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_reference_keeps_buffers_per_rank_and_parameters_shared() -> None:
    sc = zoo.get("buffers")
    r0, r1 = zoo.reference_train(sc, 2, rank=0), zoo.reference_train(sc, 2, rank=1)
    params = {k for k, _ in sc.build_model().named_parameters()}
    assert all(torch.equal(r0[k], r1[k]) for k in params)
    assert not torch.equal(r0["bn.running_mean"], r1["bn.running_mean"])
    # Without the per-forward broadcast the buffer the forward reads diverges, and so do params.
    nosync = zoo.reference_train(sc.with_ddp(broadcast_buffers=False), 2)
    assert not torch.equal(nosync["out.weight"], r0["out.weight"])


def test_reference_applies_join_semantics_only_to_uneven_inputs() -> None:
    sc = zoo.get("uneven_inputs")
    initial = zoo.reference_train(sc, 3)  # counts differ: Join is implied
    assert all(torch.equal(initial[k], v) for k, v in zoo.reference_train(sc, 3, join=True).items())
    active = zoo.reference_train(sc, 3, divide_by_initial_world_size=False)
    assert not torch.equal(initial["l0.weight"], active["l0.weight"])
    with pytest.raises(ValueError, match="Join"):
        zoo.reference_train(sc, 3, join=False)


def test_reference_refuses_what_it_does_not_model() -> None:
    with pytest.raises(ValueError, match="mixed_precision"):
        zoo.reference_train(zoo.get("mlp").with_ddp(mixed_precision=object()), 2)
    with pytest.raises(ValueError, match="reference_ok"):
        zoo.reference_train(zoo.get("mlp").with_(reference_ok=False), 2)


# -- the training loop ---------------------------------------------------------------------------


def test_run_iterations_steps_once_per_batch_and_reports_each_phase_in_order() -> None:
    model = torch.nn.Linear(2, 1)
    start = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.ones(1, 2), 2 * torch.ones(1, 2)]
    events: list[tuple[str, int, bool]] = []
    zoo.run_iterations(opt, batches, loss=lambda x: model(x).sum(),
                       on_event=lambda e, i: events.append((e, i, model.weight.grad is not None)))
    # zero_grad(set_to_none) right after "start"; the gradient exists from "backward" on.
    assert events == [(e, i, g) for i in range(2) for e, g in
                      (("start", i > 0), ("forward", False), ("backward", True), ("step", True))]
    # One SGD step per batch, each by d(w.x + b)/dw = x: w moved by -0.1 * (1 + 2).
    assert torch.allclose(model.weight, start - 0.3)


def test_run_iterations_takes_either_a_loss_or_a_gradient_rule() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exactly one of loss= and gradients="):
        zoo.run_iterations(opt, [torch.ones(1, 2)])
    with pytest.raises(ValueError, match="exactly one of loss= and gradients="):
        zoo.run_iterations(opt, [], loss=lambda x: x.sum(), gradients=lambda x: None)
    seen: list[tuple[str, int]] = []

    def rule(x: torch.Tensor) -> None:  # sets .grad itself, as reference_train's rule does
        model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.zeros(1)

    zoo.run_iterations(opt, [None], gradients=rule, on_event=lambda e, i: seen.append((e, i)))
    assert seen == [("start", 0), ("backward", 0), ("step", 0)]  # no separate forward


# -- packaging -----------------------------------------------------------------------------------


def test_zoo_imports_only_torch_and_itself() -> None:
    # Statically: every import in models/ names the standard library or torch; the zoo's own
    # modules are imported relatively (it is installed as fakepg.zoo, not as `models`).
    for path in (ROOT / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = [(node.module or "").split(".")[0]]
            else:
                continue
            for top in tops:
                assert top in sys.stdlib_module_names or top in {"torch", "__future__"}, (path, top)
    # Dynamically, in a fresh interpreter: importing fakepg.zoo after fakepg loads nothing but
    # the zoo's modules, the standard library and torch.
    code = (
        "import sys, torch, fakepg; before = set(sys.modules); import fakepg.zoo; "
        "bad = sorted(m for m in set(sys.modules) - before if not m.startswith('fakepg.zoo') "
        "and m.split('.')[0] not in set(sys.stdlib_module_names) | {'torch'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module", [zoo, zoo.scenario, zoo.catalog, zoo.data, zoo.nets,
                                    zoo.workloads, zoo.resnet, zoo.reference, zoo.training])
def test_docstring_examples_run(module: Any) -> None:
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0
