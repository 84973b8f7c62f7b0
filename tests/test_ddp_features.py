"""torch's real DDP features, specified on the fake cluster.

Each test states what DDP does and checks it against the mathematics of data parallelism
(``zoo.reference_train`` or a direct full-batch computation), against the bucket layout DDP
reports in ``_get_ddp_logging_data()``, or against the collective trace. Facts about torch 2.13
on CPU (a hook that needs CUDA, a hook that is broken) are asserted as they are, so a change in
torch shows up here.
"""

from __future__ import annotations

import copy
import functools
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.join import Join
from torch.distributed.algorithms.model_averaging import averagers
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
from fakepg import zoo
from fakepg.zoo import Scenario, SeededBatches, rank_generator

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

MB = 1024 * 1024


# -- helpers ---------------------------------------------------------------------------------------


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_steps(rank, sc: Scenario, ws: int, ddp=None, setup=None, per_step=None):
    """The zoo's training loop (no Join); returns (final state, logging data, per-step results)."""
    loop = zoo.TrainLoop()
    model = loop.build(sc, **(ddp or {}))
    extra = setup(model, rank) if setup else None
    steps = []

    def after_step(event: str, i: int) -> None:
        if event == "step" and per_step:
            steps.append(per_step(model, extra))

    loop.run(model, sc, sc.inputs(rank, ws), on_event=after_step)
    return _state(model.module), model._get_ddp_logging_data(), steps


def run(sc: Scenario, ws: int, **kw) -> fakepg.SpawnResult:
    return fakepg.spawn(functools.partial(train_steps, sc=sc, ws=ws, **kw), nprocs=ws)


def assert_states_equal(a, b, keys=None, exact=True):
    for k in keys or b:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k].double() - b[k].double()).abs().max()}"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def assert_same_on_all_ranks(states, keys=None):
    for r, s in enumerate(states[1:], 1):
        for k in keys or states[0]:
            assert torch.equal(s[k], states[0][k]), f"rank {r} differs from rank 0 in {k}"


def grad_allreduces(trace) -> list[int]:
    """Numel of each floating-point all_reduce (gradient buckets), in issue order."""
    return [r.shapes[0][0] if len(r.shapes[0]) == 1 else r.shapes[0] for r in trace
            if r.op == "all_reduce" and r.dtypes[0].startswith(("float", "bfloat"))]


def param_names(sc: Scenario) -> list[str]:
    return [n for n, _ in sc.build_model().named_parameters()]


def bucket_sizes(params, limits) -> list[int]:
    """Byte sizes of torch's own bucket assignment of ``params`` (in that order) for ``limits``."""
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in indices]


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def batch(rank, i, n=6):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def local_grads(module, x, y, scale=1.0):
    module = copy.deepcopy(module)
    module.zero_grad(set_to_none=True)
    (F.mse_loss(module(x), y) * scale).backward()
    return [p.grad.clone() for p in module.parameters()]


# -- bucket assignment and rebuild -----------------------------------------------------------------


def test_first_iteration_uses_one_bucket_then_buckets_are_rebuilt_in_grad_ready_order():
    sc = zoo.get("grad_order_differs", iterations=3)
    result = run(sc, 2)
    state, log, _ = result.returns[0]
    assert log["has_rebuilt_buckets"] == 1
    params = list(sc.build_model().parameters())
    total = sum(p.numel() for p in params)
    # Iteration 1: every gradient in one bucket. Then rank 0 broadcasts the rebuilt layout.
    rebuilt = [s // 4 for s in csv_ints(log["rebuilt_bucket_sizes"])]
    assert len(rebuilt) > 1
    assert grad_allreduces(result.trace[0]) == [total] + rebuilt * 2
    syncs = [r for r in result.trace[0] if r.op == "broadcast" and r.dtypes == ("int32",)]
    assert [r.root for r in syncs] == [0, 0]
    # The rebuilt layout is torch's own assignment over the order gradients became ready.
    order = csv_ints(log["rebuilt_per_bucket_param_indices"])
    assert order == csv_ints(log["prev_iteration_grad_ready_order_indices"])
    assert sorted(order) == list(range(len(params))) and order != list(range(len(params)))[::-1]
    cap = int(sc.ddp_kwargs["bucket_cap_mb"] * MB)
    assert csv_ints(log["rebuilt_bucket_sizes"]) == bucket_sizes([params[i] for i in order], [cap])
    assert_same_on_all_ranks([r[0] for r in result.returns])
    assert_states_equal(state, zoo.reference_train(sc, 2))


def _ready_order(chain_order, rank, n_layers):
    k = rank % len(chain_order)
    applied = tuple(chain_order[k:]) + tuple(chain_order[:k])
    head = [2 * n_layers + 1, 2 * n_layers]  # head.bias, head.weight: ready first
    return head + [i for layer in reversed(applied) for i in (2 * layer + 1, 2 * layer)]


def test_when_ranks_see_different_grad_ready_orders_rank_0s_rebuilt_buckets_win():
    sc = zoo.get("grad_order_differs_per_rank", iterations=3)
    result = run(sc, 3)
    logs = [r[1] for r in result.returns]
    chain = sc.batches.kwargs["order"]
    own = [csv_ints(log["prev_iteration_grad_ready_order_indices"]) for log in logs]
    assert own == [_ready_order(chain, r, len(chain)) for r in range(3)]
    assert len({tuple(o) for o in own}) == 3  # every rank has its own order
    layouts = {log["rebuilt_per_bucket_param_indices"] for log in logs}
    assert len(layouts) == 1  # one layout on every rank ...
    assert csv_ints(layouts.pop()) == own[0]  # ... and it is rank 0's
    assert len({log["rebuilt_bucket_sizes"] for log in logs}) == 1
    assert_same_on_all_ranks([r[0] for r in result.returns])
    assert_states_equal(result.returns[0][0], zoo.reference_train(sc, 3))


def test_bucket_cap_mb_splits_buckets_at_the_cap_in_reverse_registration_order():
    # find_unused_parameters=True: no rebuild, the initial layout is used every iteration.
    sc = zoo.get("many_small_few_large", iterations=2).with_ddp(find_unused_parameters=True)
    result = run(sc, 2)
    log = result.returns[0][1]
    params = list(sc.build_model().parameters())
    expected = bucket_sizes(params, [int(0.02 * MB)])[::-1]  # the Reducer holds them reversed
    assert len(expected) >= 4
    assert log["bucket_cap_bytes"] == int(0.02 * MB)
    assert csv_ints(log["bucket_sizes"]) == expected
    per_iteration = [s // 4 for s in expected]
    assert grad_allreduces(result.trace[0]) == per_iteration * 2
    assert_states_equal(result.returns[0][0], zoo.reference_train(sc, 2))


def test_bucket_cap_mb_list_gives_each_bucket_its_own_cap_before_and_after_the_rebuild():
    caps = [0.002, 0.005, 0.01]
    sc = zoo.get("mlp", depth=4, width=32, iterations=3).with_ddp(bucket_cap_mb_list=caps)
    result = run(sc, 2)
    log = result.returns[0][1]
    params = list(sc.build_model().parameters())
    limits = [int(c * MB) for c in caps]
    initial = bucket_sizes(params, limits)[::-1]
    assert len(initial) == 3  # even in iteration 1, which otherwise uses a single bucket
    assert csv_ints(log["bucket_sizes"]) == initial
    order = csv_ints(log["rebuilt_per_bucket_param_indices"])
    rebuilt = bucket_sizes([params[i] for i in order], limits)
    assert csv_ints(log["rebuilt_bucket_sizes"]) == rebuilt
    assert grad_allreduces(result.trace[0]) == [s // 4 for s in initial] + [s // 4 for s in rebuilt] * 2
    assert_states_equal(result.returns[0][0], zoo.reference_train(sc, 2))


def test_default_cap_puts_the_first_defined_parameters_in_a_small_first_bucket(monkeypatch):
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 4096)  # as torch's own tests do
    sc = zoo.get("mlp", depth=4, width=32, iterations=3)
    params = list(sc.build_model().parameters())
    limits = [4096, 25 * MB]
    # Initial layout (kept with find_unused_parameters=True): the small bucket holds the
    # parameters defined first, whose gradients are ready last: it is all-reduced last.
    unused = run(sc.with_ddp(find_unused_parameters=True), 2)
    initial = bucket_sizes(params, limits)
    assert initial == [4096, sum(p.numel() for p in params) * 4 - 4096]  # l0.weight alone, the rest
    assert csv_ints(unused.returns[0][1]["bucket_sizes"]) == initial[::-1]
    assert grad_allreduces(unused.trace[0])[:2] == [s // 4 for s in initial[::-1]]
    # Rebuilt layout: the small bucket holds the gradients ready *first*: all-reduced first.
    rebuilt_run = run(sc, 2)
    log = rebuilt_run.returns[0][1]
    order = csv_ints(log["rebuilt_per_bucket_param_indices"])
    rebuilt = bucket_sizes([params[i] for i in order], limits)
    assert csv_ints(log["rebuilt_bucket_sizes"]) == rebuilt
    assert rebuilt[0] < rebuilt[1]
    assert grad_allreduces(rebuilt_run.trace[0])[1:3] == [s // 4 for s in rebuilt]


# -- uneven inputs: Join -----------------------------------------------------------------------


def _join_grads(rank, divide):
    """3 ranks with 1, 2, 3 batches, no optimizer step: DDP's and the local gradient per step."""
    model = DDP(mlp())
    out = []
    with Join([model], divide_by_initial_world_size=divide):
        for i in range(1 + rank):
            x, y = batch(rank, i)
            local = local_grads(model.module, x, y)
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            out.append(([p.grad.clone() for p in model.parameters()], local))
    return out


@pytest.mark.parametrize("divide", [True, False], ids=["divide_by_initial_world_size", "divide_by_active_ranks"])
def test_join_scales_gradients_by_the_initial_or_the_active_world_size(divide):
    out = fakepg.spawn(_join_grads, args=(divide,), nprocs=3).returns
    # Step 2: ranks 1 and 2 active; joined rank 0 contributes zeros to the same all_reduce.
    div = 3 if divide else 2
    for j, g in enumerate(out[1][1][0]):
        expected = out[1][1][1][j] * (1.0 / div) + out[2][1][1][j] * (1.0 / div)
        assert torch.equal(g, expected) and torch.equal(out[2][1][0][j], expected)
    # Step 3: only rank 2 is left.
    div = 3 if divide else 1
    for g, local in zip(*out[2][2]):
        assert torch.equal(g, local * (1.0 / div))


@pytest.mark.parametrize("divide", [True, False])
def test_join_training_on_uneven_inputs_matches_the_reference(divide):
    sc = zoo.get("uneven_inputs", base=2, depth=3, width=16)

    def body(rank):
        model = DDP(sc.build_model())
        opt = sc.optimizer(model.parameters())
        with Join([model], divide_by_initial_world_size=divide):
            for b in sc.inputs(rank, 3):
                opt.zero_grad(set_to_none=True)
                sc.step(model, b).backward()
                opt.step()
        return _state(model.module)

    states = fakepg.spawn(body, nprocs=3).returns
    assert_same_on_all_ranks(states)  # Join's final model sync
    assert_states_equal(states[0], zoo.reference_train(sc, 3, divide_by_initial_world_size=divide))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_the_work_join_hands_ddps_reducer_outlives_the_cyclic_collector(isolation, monkeypatch):
    """DDP hands the forward's Join all-reduce to its C++ Reducer, which may wait on it in
    backward. fakepg's Works are Python objects: a collection between forward and backward
    freed the Python half of some (here, without the fix, 3 of 9), and a Reducer that then
    waited blocked for ever in the base Work::wait (the ``-k join`` tests hung in 8 of 9 runs)."""
    import gc
    import weakref

    sc = zoo.get("uneven_inputs", base=2, depth=3, width=16)
    notify, handed = Join.notify_join_context, {}

    def recording(joinable):
        work = notify(joinable)
        if work is not None:
            work.wait()  # done: nothing of fakepg's needs it any more
            handed[id(joinable)] = weakref.ref(work)
        return work

    monkeypatch.setattr(Join, "notify_join_context", staticmethod(recording))

    def body(rank):
        model = DDP(sc.build_model())
        opt = sc.optimizer(model.parameters())
        alive = []
        with Join([model]):
            for b in sc.inputs(rank, 3):
                opt.zero_grad(set_to_none=True)
                loss = sc.step(model, b)
                gc.collect()
                alive.append(handed[id(model)]() is not None)
                loss.backward()
                opt.step()
        return alive

    alive = fakepg.spawn(body, nprocs=3, isolation=isolation, timeout=30).returns
    assert [len(a) for a in alive] == [2, 3, 4] and all(all(a) for a in alive)


def test_zoo_train_loop_joins_uneven_inputs_reports_each_phase_and_matches_the_reference():
    sc = zoo.get("uneven_inputs", base=2, depth=3, width=16)
    counts = sc.batch_counts(3)
    assert len(set(counts)) > 1
    loop = zoo.TrainLoop()  # join=None: Join exactly when the counts differ
    assert loop.joins(sc, 3) and not zoo.TrainLoop(join=False).joins(sc, 3)
    assert not loop.joins(zoo.get("mlp"), 3)

    def body(rank):
        events = []
        model = loop(sc, rank, 3, on_event=lambda event, i: events.append((event, i)))
        return _state(model.module), events

    out = fakepg.spawn(body, nprocs=3).returns
    for rank, (_, events) in enumerate(out):
        assert events == [(e, i) for i in range(counts[rank]) for e in ("start", "forward", "backward", "step")]
    assert_same_on_all_ranks([state for state, _ in out])  # Join's final model sync
    assert_states_equal(out[0][0], zoo.reference_train(sc, 3))


@pytest.mark.parametrize("hook", ["fp16_compress_hook", "builtin FP16_COMPRESS", "powerSGD_hook"])
def test_joined_ranks_shadow_the_comm_hooks_all_reduces_until_the_last_rank_finishes(hook):
    sc = zoo.get("uneven_inputs", base=1, depth=3, width=16)

    def body(rank):
        model = DDP(sc.build_model())
        if hook == "fp16_compress_hook":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powerSGD_hook":
            model.register_comm_hook(powersgd.PowerSGDState(None, 1, start_powerSGD_iter=2), powersgd.powerSGD_hook)
        else:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        opt = sc.optimizer(model.parameters())
        with Join([model]):
            for b in sc.inputs(rank, 4):
                opt.zero_grad(set_to_none=True)
                sc.step(model, b).backward()
                opt.step()
        return _state(model.module)

    result = fakepg.spawn(body, nprocs=4)  # rank r has 1 + r batches: up to 3 ranks joined
    assert_same_on_all_ranks(result.returns)
    # Rank 0 joined first, yet it issued as many gradient all_reduces as rank 3, which ran 4 steps.
    assert grad_allreduces(result.trace[0]) == grad_allreduces(result.trace[3])


def test_join_throw_on_early_termination_raises_on_every_rank_at_the_first_exhausted_input():
    def body(rank):
        model = DDP(mlp())
        steps = 0
        try:
            with Join([model], throw_on_early_termination=True):
                for i in range(1 + rank):
                    x, y = batch(rank, i)
                    F.mse_loss(model(x), y).backward()
                    steps += 1
        except RuntimeError as e:
            return steps, str(e)

    out = fakepg.spawn(body, nprocs=3).returns
    assert out == [(1, "Rank 0 exhausted all inputs."),
                   (1, "Detected at least one rank that exhausted inputs. Throwing across all ranks."),
                   (1, "Detected at least one rank that exhausted inputs. Throwing across all ranks.")]
    with pytest.raises(fakepg.RankFailedError) as info:  # uncaught: rank 0 is the first to fail
        fakepg.spawn(_throw_uncaught, nprocs=2)
    assert info.value.rank == 0 and str(info.value.__cause__) == "Rank 0 exhausted all inputs."


def _throw_uncaught(rank):
    model = DDP(mlp())
    with Join([model], throw_on_early_termination=True):
        for i in range(1 + rank):
            x, y = batch(rank, i)
            F.mse_loss(model(x), y).backward()


def test_join_with_no_sync_accumulation_matches_a_direct_computation():
    # Rank r runs 2 * (1 + r) micro-batches; every pair is one optimizer step (no_sync, then sync).
    def body(rank):
        model = DDP(mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([model]):
            for i in range(2 * (1 + rank)):
                x, y = batch(rank, i)
                if i % 2 == 0:
                    with model.no_sync():
                        F.mse_loss(model(x), y).backward()
                else:
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        return _state(model.module)

    states = fakepg.spawn(body, nprocs=2).returns
    assert_same_on_all_ranks(states)
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        total = None
        for r in (0, 1):
            if step >= 1 + r:
                continue  # rank r has joined: it adds zeros
            a, b = (local_grads(ref, *batch(r, 2 * step + k)) for k in (0, 1))
            acc = [(ga + gb) * 0.5 for ga, gb in zip(a, b)]
            total = acc if total is None else [t + g for t, g in zip(total, acc)]
        for p, g in zip(ref.parameters(), total):
            p.grad = g
        opt.step()
    assert_states_equal(states[0], _state(ref), exact=False)


# -- no_sync, find_unused_parameters ---------------------------------------------------------------


def test_no_sync_accumulation_equals_the_big_batch_gradient_with_one_all_reduce():
    ws, k = 3, 3

    def body(rank):
        model = DDP(mlp())
        with model.no_sync():
            for i in range(k - 1):
                x, y = batch(rank, i)
                (F.mse_loss(model(x), y) / k).backward()
        x, y = batch(rank, k - 1)
        (F.mse_loss(model(x), y) / k).backward()
        return [p.grad.clone() for p in model.parameters()]

    result = fakepg.spawn(body, nprocs=ws)
    big = mlp()
    xs, ys = zip(*(batch(r, i) for r in range(ws) for i in range(k)))
    F.mse_loss(big(torch.cat(xs)), torch.cat(ys)).backward()
    for grads in result.returns:
        for g, p in zip(grads, big.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    assert len(grad_allreduces(result.trace[0])) == 1  # the no_sync backwards issue nothing


def test_find_unused_parameters_with_rank_dependent_unused_sets_matches_the_reference():
    sc = zoo.get("rank_dependent_unused", iterations=3)
    result = run(sc, 3)
    states = [r[0] for r in result.returns]
    assert_same_on_all_ranks(states)
    assert_states_equal(states[0], zoo.reference_train(sc, 3))
    # The never-used layer is never touched; each iteration all-reduces the used-parameter map.
    assert torch.equal(states[0]["dead.weight"], sc.build_model().dead.weight.detach())
    used_maps = [r for r in result.trace[0] if r.op == "all_reduce" and r.dtypes == ("int32",)]
    assert len(used_maps) == 3 and used_maps[0].shapes == ((len(param_names(sc)),),)
    assert result.returns[0][1]["find_unused_parameters"] == 1


# -- static graph --------------------------------------------------------------------------------


def test_static_graph_matches_the_reference_and_set_static_graph_is_the_same_thing():
    sc = zoo.get("grad_order_differs", iterations=3)
    ctor = run(sc.with_ddp(static_graph=True), 2)
    late = run(sc, 2, setup=lambda m, r: m._set_static_graph())
    assert ctor.returns[0][1]["static_graph"] == 1 == late.returns[0][1]["static_graph"]
    assert_states_equal(ctor.returns[0][0], zoo.reference_train(sc, 2))
    assert_states_equal(late.returns[0][0], ctor.returns[0][0])
    assert [(r.op, r.shapes) for r in late.trace[0]] == [(r.op, r.shapes) for r in ctor.trace[0]]


class _WithDeadLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(16, 8)
        self.dead = nn.Linear(16, 8)

    def forward(self, x):
        return self.used(x)


def _dead_scenario(**ddp):
    return Scenario(name="dead", model=_WithDeadLayer, ddp_kwargs=ddp, iterations=3,
                    batches=SeededBatches(zoo.data.regression, 0, dict(
                        iterations=3, batch_size=6, in_shape=(16,), out_features=8)))


def test_static_graph_finds_parameters_unused_in_every_iteration_without_find_unused_parameters():
    sc = _dead_scenario(static_graph=True)
    result = run(sc, 2, per_step=lambda m, _: m.module.dead.weight.grad)
    state, log, dead_grads = result.returns[0]
    assert dead_grads == [None] * 3
    assert log["unused_parameter_size"] == (16 * 8 + 8) * 4
    assert_states_equal(state, zoo.reference_train(sc, 2))


def test_delay_all_reduce_named_params_are_reduced_apart_from_the_buckets():
    def body(rank):
        model = mlp()
        # The last layer's gradients are ready first; the hook fires on the first layer's, last.
        delayed = [("2.weight", model[2].weight), ("2.bias", model[2].bias)]
        ddp = DDP(model, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=model[0].weight)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for i in range(3):
            opt.zero_grad()
            F.mse_loss(ddp(batch(rank, i)[0]), batch(rank, i)[1]).backward()
            opt.step()
        return _state(model)

    result = fakepg.spawn(body, nprocs=2)
    # The delayed parameters (32*8 + 8) travel in their own all_reduce, issued from the hook
    # before the Reducer's bucket of the others (16*32 + 32).
    assert grad_allreduces(result.trace[0]) == [264, 544] * 3
    plain = fakepg.spawn(functools.partial(_plain_train, iters=3), nprocs=2).returns[0]
    assert_same_on_all_ranks(result.returns)
    assert_states_equal(result.returns[0], plain)


def _plain_train(rank, iters):
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(iters):
        opt.zero_grad()
        F.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
        opt.step()
    return _state(model.module)


def test_parameters_set_to_be_ignored_are_not_synchronized():
    def body(rank):
        model = mlp()
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["2.bias"])
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for i in range(2):
            opt.zero_grad()
            F.mse_loss(ddp(batch(rank, i)[0]), batch(rank, i)[1]).backward()
            opt.step()
        return _state(model)

    states = fakepg.spawn(body, nprocs=2).returns
    assert_same_on_all_ranks(states, keys=["0.weight", "0.bias", "2.weight"])
    assert not torch.equal(states[0]["2.bias"], states[1]["2.bias"])


def test_activation_checkpointing_with_static_graph_trains_exactly_like_without_it():
    class Checkpointed(nn.Module):
        def __init__(self, use_checkpoint):
            super().__init__()
            self.use_checkpoint = use_checkpoint
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

        def forward(self, x):
            inner = lambda t: torch.tanh(self.a(t))  # noqa: E731
            h = torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False) if self.use_checkpoint else inner(x)
            return self.b(h)

    def body(rank, use_checkpoint):
        torch.manual_seed(0)
        model = DDP(Checkpointed(use_checkpoint), static_graph=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            opt.zero_grad()
            F.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
            opt.step()
        return _state(model.module)

    with_ckpt = fakepg.spawn(body, args=(True,), nprocs=2)
    without = fakepg.spawn(body, args=(False,), nprocs=2)
    assert_same_on_all_ranks(with_ckpt.returns)
    assert_states_equal(with_ckpt.returns[0], without.returns[0])
    assert grad_allreduces(with_ckpt.trace[0]) == grad_allreduces(without.trace[0])


# -- communication hooks -------------------------------------------------------------------------


def _hooked(rank, register, iters=3):
    model = DDP(mlp())
    state = register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = []
    for i in range(iters):
        opt.zero_grad()
        F.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
        snaps.append(([p.grad.clone() for p in model.parameters()], _state(model.module)))
        opt.step()
    return snaps, state


def hooked(register, ws=2, iters=3):
    return fakepg.spawn(functools.partial(_hooked, register=register, iters=iters), nprocs=ws)


def _no_hook(model):
    return None


def _local_grads_at(snap_state, rank, i):
    model = mlp()
    model.load_state_dict(snap_state)
    return local_grads(model, *batch(rank, i))


def test_allreduce_hook_and_builtin_allreduce_hook_equal_the_default_reduction_bitwise():
    base = hooked(_no_hook)
    python = hooked(lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook))
    builtin = hooked(lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE))
    for other in (python, builtin):
        for (g0, s0), (g1, s1) in zip(base.returns[0][0], other.returns[0][0]):
            assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert grad_allreduces(python.trace[0]) == grad_allreduces(base.trace[0])


@pytest.mark.parametrize("builtin", [False, True], ids=["fp16_compress_hook", "builtin_FP16_COMPRESS"])
def test_fp16_compression_all_reduces_float16_gradients_divided_before_the_sum(builtin):
    ws = 3
    if builtin:
        register = lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)  # noqa: E731
    else:
        register = lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook)  # noqa: E731
    result = hooked(register, ws=ws, iters=1)
    initial = _state(mlp())
    locals_ = [_local_grads_at(initial, r, 0) for r in range(ws)]
    for j, g in enumerate(result.returns[0][0][0][0]):
        acc = locals_[0][j].half() / ws
        for r in range(1, ws):
            acc = acc + locals_[r][j].half() / ws  # fakepg sums in rank order, in float16
        assert torch.equal(g, acc.float())
    assert {r.dtypes for r in result.trace[0] if r.op == "all_reduce"} == {("float16",)}


def test_bf16_compress_hook_is_refused_on_a_cpu_build_but_its_arithmetic_runs_when_wrapped():
    def refuse(rank):
        DDP(mlp()).register_comm_hook(None, default_hooks.bf16_compress_hook)

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(refuse, nprocs=2)
    assert str(info.value.__cause__) == (
        "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and XCCL")

    def bf16(state, bucket):  # DDP checks the hook's __name__ only
        return default_hooks.bf16_compress_hook(state, bucket)

    result = hooked(lambda m: m.register_comm_hook(None, bf16), iters=1)
    initial = _state(mlp())
    locals_ = [_local_grads_at(initial, r, 0) for r in range(2)]
    for j, g in enumerate(result.returns[0][0][0][0]):
        expected = (locals_[0][j].bfloat16() / 2 + locals_[1][j].bfloat16() / 2).float()
        assert torch.equal(g, expected)
    assert {r.dtypes for r in result.trace[0] if r.op == "all_reduce"} == {("bfloat16",)}


def test_future_chaining_hook_all_reduce_then_divide_matches_the_reference():
    def hook(state, bucket):
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))

    result = hooked(lambda m: m.register_comm_hook(None, hook), ws=3)
    base = hooked(_no_hook, ws=3)
    assert_same_on_all_ranks([r[0][-1][1] for r in result.returns])
    for (g_hook, _), (g_base, _) in zip(result.returns[0][0], base.returns[0][0]):
        for a, b in zip(g_hook, g_base):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_powerSGD_runs_vanilla_all_reduce_for_start_iterations_then_compresses_low_rank():
    def register(model):
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return state

    result = hooked(register, iters=4)
    base = hooked(_no_hook, iters=4)
    snaps, state = result.returns[0]
    assert state.iter == 4
    for i, ((g, _), (gb, _)) in enumerate(zip(snaps, base.returns[0][0])):
        same = all(torch.equal(a, b) for a, b in zip(g, gb))
        assert same == (i < 2), f"iteration {i}"
    assert_same_on_all_ranks([s[-1][1] for s, _ in result.returns])
    # Iterations 3-4: the 16x32 and 8x32 weights travel as rank-1 factors P and Q.
    reduced = grad_allreduces(result.trace[0])
    assert reduced[:2] == grad_allreduces(base.trace[0])[:2]
    assert max(reduced[2:]) < reduced[0] and len(reduced) > 4


def test_batched_powerSGD_hook_in_torch_2_13_fails_at_its_first_compressed_step():
    def register(model):
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd.batched_powerSGD_hook)
        return state

    def body(rank):
        try:
            _hooked(rank, register, iters=3)
        except AssertionError as e:
            return traceback.extract_tb(e.__traceback__)[-1].name
        return "no error"

    # _orthogonalize asserts a batch of matrices (3-D) but batched_powerSGD_hook passes 2-D.
    assert fakepg.spawn(body, nprocs=2).returns == ["_orthogonalize"] * 2
    two_vanilla = hooked(register, iters=2)
    base = hooked(_no_hook, iters=2)
    assert all(torch.equal(a, b) for a, b in zip(two_vanilla.returns[0][0][-1][0], base.returns[0][0][-1][0]))


def test_post_localSGD_hook_with_periodic_model_averager_syncs_subgroups_then_averages_periodically():
    def body(rank):
        subgroup, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        model = DDP(mlp())
        model.register_comm_hook(post_local.PostLocalSGDState(
            process_group=None, subgroup=subgroup, start_localSGD_iter=2), post_local.post_localSGD_hook)
        averager = averagers.PeriodicModelAverager(period=3, warmup_steps=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        snaps = []
        for i in range(8):
            opt.zero_grad()
            F.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
            opt.step()
            averager.average_parameters(model.parameters())
            snaps.append(_state(model.module))
        return snaps

    result = fakepg.spawn(body, nprocs=4)
    snaps = result.returns
    for i in range(8):
        within = all(torch.equal(snaps[0][i][k], snaps[1][i][k]) and torch.equal(snaps[2][i][k], snaps[3][i][k])
                     for k in snaps[0][i])
        across = all(torch.equal(snaps[0][i][k], snaps[2][i][k]) for k in snaps[0][i])
        assert within, f"iteration {i}"
        # global all_reduce in iterations 0-1, then the averager at steps 2, 5
        assert across == (i in (0, 1, 2, 5)), f"iteration {i}"
    sub = [r for r in result.trace[0] if r.op == "all_reduce" and r.group_ranks == (0, 1)]
    assert len(sub) == 6  # gradient buckets of iterations 2..7 stay in the subgroup


# -- gradients, buffers ----------------------------------------------------------------------------


def test_gradient_as_bucket_view_makes_grads_views_of_one_bucket_without_changing_results():
    def body(rank, as_view):
        model = DDP(mlp(), gradient_as_bucket_view=as_view)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(2):
            opt.zero_grad()
            F.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
            opt.step()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        return _state(model.module), len(storages)

    views = fakepg.spawn(body, args=(True,), nprocs=2).returns
    plain = fakepg.spawn(body, args=(False,), nprocs=2).returns
    assert views[0][1] == 1 and plain[0][1] == 4  # one bucket: all grads share its storage
    assert views[0][0].keys() == plain[0][0].keys()
    assert_states_equal(views[0][0], plain[0][0])


def _buffers_at_forward(sc, ws, **ddp):
    def body(rank):
        seen = []
        module = sc.build_model()
        module.register_forward_pre_hook(lambda m, _: seen.append({k: v.clone() for k, v in m.named_buffers()}))
        model = DDP(module, **ddp)
        opt = sc.optimizer(model.parameters())
        for b in sc.inputs(rank, ws):
            opt.zero_grad(set_to_none=True)
            sc.step(model, b).backward()
            opt.step()
        return seen, _state(module)

    return fakepg.spawn(body, nprocs=ws).returns


@pytest.mark.parametrize("broadcast", [True, False])
def test_broadcast_buffers_syncs_buffers_from_rank_0_before_each_forward_or_lets_them_diverge(broadcast):
    sc = zoo.get("buffers", iterations=3)
    out = _buffers_at_forward(sc, 3, broadcast_buffers=broadcast)
    for i in range(3):
        same = all(torch.equal(out[r][0][i][k], out[0][0][i][k]) for r in range(3) for k in out[0][0][i])
        assert same == (broadcast or i == 0), f"iteration {i}"
    # Parameters stay equal either way; buffers end as each rank's own (rank r's reference).
    params = param_names(sc)
    assert_same_on_all_ranks([s for _, s in out], keys=params)
    ref_sc = sc.with_ddp(broadcast_buffers=broadcast)
    for r in range(3):
        assert_states_equal(out[r][1], zoo.reference_train(ref_sc, 3, rank=r))


def test_buffer_comm_hook_replaces_the_broadcast_with_an_averaging_all_reduce():
    from torch.nn.parallel.distributed import _BufferCommHookLocation

    def average(state, named_buffers):
        ws = dist.get_world_size()
        return [dist.all_reduce(b, async_op=True).get_future().then(lambda f: f.value()[0].div_(ws))
                for b in named_buffers.values() if b.is_floating_point()]

    def body(rank):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
        local = copy.deepcopy(module)
        model = DDP(module)
        model._register_buffer_comm_hook(None, average, _BufferCommHookLocation.POST_FORWARD)
        x, y = batch(rank, 0)
        F.mse_loss(model(x), y).backward()
        local(x)  # the rank's own running-stat update
        return module[1].running_mean.clone(), local[1].running_mean.clone()

    result = fakepg.spawn(body, nprocs=3)
    expected = result.returns[0][1]
    for r in (1, 2):
        expected = expected + result.returns[r][1]
    expected = expected / 3
    assert all(torch.equal(out, expected) for out, _ in result.returns)
    after_init = [r for r in result.trace[0][4:] if r.op == "broadcast"]
    assert after_init == []  # no forward-time buffer broadcast
    assert [r.shapes for r in result.trace[0] if r.op == "all_reduce"][:2] == [((8,),), ((8,),)]


# -- torch 2.13 features that need an accelerator ---------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only behaviour")
def test_native_mixed_precision_needs_an_accelerator_in_torch_2_13():
    from torch.nn.parallel.distributed import _MixedPrecision

    def body(rank):
        model = DDP(mlp(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
        assert all(p._mp_param.dtype == torch.bfloat16 for p in model.parameters())
        model(batch(rank, 0)[0])  # the forward pre-hook records a torch.Event

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2)
    assert str(info.value.__cause__) == "cpu backend doesn't support events."


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only behaviour")
def test_apply_optimizer_in_backward_steps_with_averaged_grads_then_needs_an_accelerator():
    from torch.distributed.optim import _apply_optimizer_in_backward

    def body(rank):
        module = mlp()
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
        model = DDP(module)
        try:
            F.mse_loss(model(batch(rank, 0)[0]), batch(rank, 0)[1]).backward()
        except RuntimeError as e:
            return str(e), _state(module)

    out = fakepg.spawn(body, nprocs=2).returns
    # The end-of-backward callback waits on torch.accelerator.current_stream() ...
    assert [msg for msg, _ in out] == ["Cannot access accelerator device when none is available."] * 2
    # ... after each parameter's in-backward SGD step already used the averaged gradient.
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (sum(F.mse_loss(ref(x), y) for x, y in (batch(0, 0), batch(1, 0))) / 2).backward()
    opt.step()
    assert_same_on_all_ranks([s for _, s in out])
    assert_states_equal(out[0][1], _state(ref), exact=False)


# -- the rest of DDP's surface ---------------------------------------------------------------------


def test_remove_autograd_hooks_stops_gradient_synchronization():
    def body(rank):
        model = DDP(mlp())
        model._remove_autograd_hooks()
        x, y = batch(rank, 0)
        F.mse_loss(model(x), y).backward()
        return [p.grad for p in model.parameters()], local_grads(mlp(), x, y)

    result = fakepg.spawn(body, nprocs=2)
    for grads, local in result.returns:
        assert all(torch.equal(g, l) for g, l in zip(grads, local))  # unscaled, rank-local
    assert not torch.equal(result.returns[0][0][0], result.returns[1][0][0])
    assert grad_allreduces(result.trace[0]) == []


def test_sparse_embedding_gradients_are_all_reduced_as_sparse_tensors():
    sc = zoo.get("sparse_embedding", iterations=3)
    result = run(sc, 3, per_step=lambda m, _: m.module.embed.weight.grad.is_sparse)
    states = [r[0] for r in result.returns]
    assert all(r[2] == [True] * 3 for r in result.returns)
    assert_same_on_all_ranks(states)
    assert_states_equal(states[0], zoo.reference_train(sc, 3), exact=False)
    sparse = [r for r in result.trace[0] if r.op == "all_reduce" and r.shapes == ((100, 16),)]
    assert len(sparse) == 3 and all(r.bytes < 100 * 16 * 4 for r in sparse)  # values only


def test_two_ddp_models_in_one_step_each_reduce_their_own_buckets_and_match_the_reference():
    def body(rank):
        torch.manual_seed(0)
        trunk, head = nn.Linear(16, 32), nn.Linear(32, 8)
        a, b = DDP(trunk), DDP(head)
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
        for i in range(3):
            opt.zero_grad()
            F.mse_loss(b(torch.tanh(a(batch(rank, i)[0]))), batch(rank, i)[1]).backward()
            opt.step()
        return {**{f"0.{k}": v for k, v in _state(trunk).items()}, **{f"2.{k}": v for k, v in _state(head).items()}}

    result = fakepg.spawn(body, nprocs=2)
    # Per step: the head's bucket (ready first), then the trunk's.
    assert grad_allreduces(result.trace[0]) == [32 * 8 + 8, 16 * 32 + 32] * 3
    plain = fakepg.spawn(functools.partial(_plain_train, iters=3), nprocs=2).returns[0]
    assert_same_on_all_ranks(result.returns)
    assert_states_equal(result.returns[0], plain)


def test_coalescing_manager_averages_gradients_in_one_coalesced_all_reduce_exactly_like_ddp():
    def body(rank):
        model = mlp()
        x, y = batch(rank, 0)
        F.mse_loss(model(x), y).backward()
        grads = [p.grad * 0.5 for p in model.parameters()]
        with dist._coalescing_manager(async_ops=True) as cm:
            for g in grads:
                dist.all_reduce(g)
        cm.wait()
        ddp = DDP(mlp())
        F.mse_loss(ddp(x), y).backward()
        return grads, [p.grad for p in ddp.parameters()]

    result = fakepg.spawn(body, nprocs=2)
    mine, ddps = result.returns[0]
    assert all(torch.equal(a, b) for a, b in zip(mine, ddps))
    coalesced = [r for r in result.trace[0] if r.op == "all_reduce_coalesced"]
    assert len(coalesced) == 1 and coalesced[0].shapes == ((32, 16), (32,), (8, 32), (8,))


def test_ddp_logging_data_describes_the_model_the_world_and_the_features_in_use():
    def body(rank):
        model = DDP(mlp(), static_graph=True, bucket_cap_mb=1)
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        with Join([model]):
            for i in range(2 + rank):
                F.mse_loss(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
        return model._get_ddp_logging_data()

    logs = fakepg.spawn(body, nprocs=2).returns
    n_bytes = (16 * 32 + 32 + 32 * 8 + 8) * 4
    for rank, log in enumerate(logs):
        assert {k: log[k] for k in ("backend_name", "world_size", "rank", "module_name", "num_parameter_tensors",
                                    "total_parameter_size_bytes", "bucket_cap_bytes", "static_graph",
                                    "comm_hook", "join_uneven_inputs", "find_unused_parameters",
                                    "gradient_as_bucket_view", "dtypes", "master_addr", "master_port")} == {
            "backend_name": "fakepg", "world_size": 2, "rank": rank, "module_name": "Sequential",
            "num_parameter_tensors": 4, "total_parameter_size_bytes": n_bytes, "bucket_cap_bytes": MB,
            "static_graph": 1, "comm_hook": "fp16_compress_hook", "join_uneven_inputs": 1,
            "find_unused_parameters": 0, "gradient_as_bucket_view": 0, "dtypes": "float",
            "master_addr": "127.0.0.1", "master_port": "29500"}
        assert log["iteration"] == 1 + rank


# -- properties ------------------------------------------------------------------------------------


class _Branchy(nn.Module):
    """A trunk and ``n_branches`` heads; a batch names the heads its loss uses."""

    def __init__(self, widths, n_branches):
        super().__init__()
        dims = list(widths)
        self.trunk = nn.ModuleList(nn.Linear(dims[i], dims[i + 1]) for i in range(len(dims) - 1))
        self.branches = nn.ModuleList(nn.Linear(dims[-1], 2) for _ in range(n_branches))

    def forward(self, x, used):
        for layer in self.trunk:
            x = torch.tanh(layer(x))
        return sum(self.branches[b](x) for b in used)


def _branchy_batches(seed, rank, world_size, *, in_features, iterations, patterns):
    g = rank_generator(seed, rank, "branchy")
    return [(torch.randn(4, in_features, generator=g), torch.randn(4, 2, generator=g),
             patterns[(rank + i) % len(patterns)]) for i in range(iterations)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 12), min_size=2, max_size=4),
    n_branches=st.integers(1, 3),
    data=st.data(),
    cap=st.sampled_from([None, 1e-4, 1e-3, 0.05]),
    ws=st.integers(1, 6),
)
def test_any_model_bucket_cap_world_size_and_unused_pattern_matches_the_reference(widths, n_branches, data, cap, ws):
    patterns = data.draw(st.lists(
        st.lists(st.integers(0, n_branches - 1), min_size=1, max_size=n_branches, unique=True).map(tuple),
        min_size=1, max_size=3), label="used branches per (rank + iteration)")
    unused = any(set(p) != set(range(n_branches)) for p in patterns)
    ddp = {"find_unused_parameters": True} if unused else {}
    if cap is not None:
        ddp["bucket_cap_mb"] = cap
    sc = Scenario(
        name="branchy", model=functools.partial(_Branchy, tuple(widths), n_branches),
        batches=SeededBatches(_branchy_batches, 0, dict(in_features=widths[0], iterations=3, patterns=patterns)),
        forward=zoo.catalog.forward_with_extra, ddp_kwargs=ddp, iterations=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(sc, ws)
    states = [r[0] for r in result.returns]
    assert_same_on_all_ranks(states)
    assert_states_equal(states[0], zoo.reference_train(sc, ws))
