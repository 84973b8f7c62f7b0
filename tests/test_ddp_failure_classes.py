"""Known DDP failure classes, reproduced deterministically on the fake cluster.

Each test asserts the exact symptom torch 2.13 shows (its error text, fakepg's hang or mismatch
report naming the collective and this file's line, or the numbers by which ranks diverge), and
runs the failing program twice to show the symptom is the same every time. Where the same
program was also run on real multi-process gloo while writing these tests, the docstring says
what gloo did.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
from fakepg import zoo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def here(marker: str) -> str:
    """``file:line`` of the line of this file that ends with ``# <marker>``, as fakepg names sites."""
    with open(__file__) as f:
        lines = [i + 1 for i, text in enumerate(f) if text.rstrip().endswith(f"# <{marker}>")]
    assert len(lines) == 1, marker
    rel = os.path.relpath(__file__)
    return f"{rel if not rel.startswith('..') else __file__}:{lines[0]}"


def symptom(fn, nprocs=2):
    """What a run of ``fn`` on ``nprocs`` ranks ends with, as comparable data."""
    try:
        result = fakepg.spawn(fn, nprocs=nprocs)
    except fakepg.CollectiveHangError as e:
        return "hang", e.report
    except fakepg.CollectiveMismatchError as e:
        return "mismatch", str(e)
    except fakepg.RankFailedError as e:
        return "rank failed", e.rank, type(e.__cause__).__name__, str(e.__cause__), str(e)
    return "returned", result.returns


def _comparable(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), x.tolist())
    if isinstance(x, (list, tuple)):
        return tuple(_comparable(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _comparable(v)) for k, v in x.items())
    return x


def twice(fn, nprocs=2):
    first, second = symptom(fn, nprocs), symptom(fn, nprocs)
    assert _comparable(first) == _comparable(second), "the symptom changed between two runs"
    return first


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # 212 parameters


def data(rank, i):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


# -- static_graph ------------------------------------------------------------------------------


def _static_graph_no_sync_first(rank):
    model = DDP(make_model(), static_graph=True)
    try:
        for i in range(3):
            x, y = data(rank, i)
            if i == 0:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()  # <no_sync backward>
            else:
                F.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        return i, str(e)


def test_static_graph_with_no_sync_in_the_first_iteration_communicates_anyway_then_asserts():
    """gloo, 2 processes: the same assertion on both ranks in iteration 1."""
    kind, returns = twice(_static_graph_no_sync_first)
    assert kind == "returned"
    for i, message in returns:
        assert i == 0
        assert message.startswith("expect_autograd_hooks_ INTERNAL ASSERT FAILED at ")
        assert "reducer.cpp" in message and "please report a bug to PyTorch" in message
    # no_sync did not stop the first-iteration delayed all-reduce: the used-parameter map and
    # the whole bucket went out from inside the no_sync backward before the assertion fired.
    result_trace = fakepg.spawn(_static_graph_no_sync_first, nprocs=2).trace[0]
    after_init = [(r.op, r.shapes, r.dtypes, r.site) for r in result_trace[3:]]
    site = here("no_sync backward")
    assert after_init == [("all_reduce", ((4,),), ("int32",), site), ("all_reduce", ((212,),), ("float32",), site)]


def test_static_graph_with_an_output_left_out_of_the_loss_silently_skips_sync_then_raises():
    """gloo, 2 processes: the same error in iteration 3 and the same per-rank gradients
    (iteration 2's differ between ranks: -0.5902 on rank 0, -0.5526 on rank 1)."""

    def body(rank):
        model = DDP(TwoHeads(), static_graph=True)
        grads = []
        try:
            for i in range(3):
                x, y = data(rank, i)
                used, ignored = model(x)  # <static forward>
                model.zero_grad()
                F.mse_loss(used, y).backward()
                grads.append(model.module.a.bias.grad.clone())
        except RuntimeError as e:
            return i, str(e), grads

    kind, returns = twice(body)
    assert kind == "returned"
    for rank, (i, message, grads) in enumerate(returns):
        assert i == 2  # the third forward raises
        assert message.startswith(
            "Expected to have finished reduction in the prior iteration before starting a new one. "
            "This error indicates that your training graph has changed in this iteration, e.g., one "
            "parameter is used in first iteration, but then got unused in the second iteration. this "
            "is not compatible with static_graph set to True.\n"
            f"Parameter indices which did not receive grad for rank {rank}: 2 3\n")
    (_, _, g0), (_, _, g1) = returns
    assert torch.equal(g0[0], g1[0])  # iteration 1: synchronized
    assert not torch.equal(g0[1], g1[1])  # iteration 2: no all_reduce at all, silently
    assert round(g0[1].sum().item(), 4) == -0.5902 and round(g1[1].sum().item(), 4) == -0.5526
    trace = fakepg.spawn(body, nprocs=2).trace[0]
    assert [r.op for r in trace[3:]] == ["all_reduce", "all_reduce"]  # iteration 1's only


def test_output_left_out_of_the_loss_without_find_unused_parameters_raises_at_the_next_forward():
    def body(rank):
        model = DDP(TwoHeads())
        for i in range(2):
            x, y = data(rank, i)
            used, ignored = model(x)  # <dynamic forward>
            F.mse_loss(used, y).backward()

    kind, failed_rank, exc, message, text = twice(body)
    assert (kind, failed_rank, exc) == ("rank failed", 1, "RuntimeError")
    assert message.startswith(
        "Expected to have finished reduction in the prior iteration before starting a new one. This "
        "error indicates that your module has parameters that were not used in producing loss. You can "
        "enable unused parameter detection by passing the keyword argument `find_unused_parameters=True`")
    assert "Parameter indices which did not receive grad for rank 1: 2 3" in message
    assert f"(raised at {here('dynamic forward')})" in text


def test_static_graph_with_rank_dependent_unused_parameters_reports_a_changed_graph():
    sc = zoo.get("rank_dependent_unused", iterations=3).with_ddp(find_unused_parameters=False, static_graph=True)

    def body(rank):
        model = DDP(sc.build_model(), **sc.ddp_kwargs)
        for batch in sc.inputs(rank, 3):
            sc.step(model, batch).backward()  # <routed backward>

    kind, failed_rank, exc, message, text = twice(body, nprocs=3)
    assert (kind, exc) == ("rank failed", "RuntimeError")
    assert message == (
        "Your training graph has changed in this iteration, e.g., one parameter is unused in first "
        "iteration, but then got used in the second iteration. this is not compatible with "
        "static_graph set to True.")
    assert f"(raised at {here('routed backward')})" in text


# -- hangs -------------------------------------------------------------------------------------


def test_uneven_inputs_without_join_hang_in_the_bucket_all_reduce_of_the_extra_backward():
    def body(rank):
        model = DDP(make_model())
        for i in range(2 + rank):  # rank 1 has one batch more
            x, y = data(rank, i)
            F.mse_loss(model(x), y).backward()  # <uneven backward>

    kind, report = twice(body)
    assert kind == "hang"
    site = here("uneven backward")
    assert "rank 0: finished (returned)" in report
    assert (f"rank 1: blocked waiting on all_reduce(shapes=[(212,)], dtypes=[float32], op=SUM) #7 on "
            f"group '0' (ranks [0, 1]), issued at {site}; waits for ranks [0]") in report
    assert "group '0' (ranks [0, 1]): rank 0: #6, rank 1: #6" in report
    assert f"pending #7 all_reduce: issued by rank 1 at {site}; still waits for ranks [0]" in report
    assert "use torch.distributed.algorithms.Join" in report


def test_a_rank_that_skips_backward_leaves_the_others_waiting_in_their_last_bucket_all_reduce():
    def body(rank):
        model = DDP(make_model())
        for i in range(3):
            x, y = data(rank, i)
            loss = F.mse_loss(model(x), y)
            if rank == 1 and i == 1:
                continue  # e.g. a NaN loss skipped on one rank
            loss.backward()  # <skipping backward>

    kind, report = twice(body)
    assert kind == "hang"
    site = here("skipping backward")
    # Rank 1's next forward does not notice (no hook fired, nothing to finalize): it runs one
    # backward fewer, so rank 0's third bucket all_reduce never completes.
    assert "rank 1: finished (returned)" in report
    assert (f"rank 0: blocked waiting on all_reduce(shapes=[(212,)], dtypes=[float32], op=SUM) #7 on "
            f"group '0' (ranks [0, 1]), issued at {site}; waits for ranks [1]") in report


# -- mismatches ----------------------------------------------------------------------------------


def test_a_rank_local_all_to_all_meets_another_ranks_bucket_all_reduce():
    def body(rank):
        model = DDP(make_model())
        x, y = data(rank, 0)
        out = model(x)
        if rank == 1:  # e.g. a rank-local expert dispatch
            outputs = [torch.empty(2) for _ in range(2)]
            dist.all_to_all(outputs, [torch.ones(2) for _ in range(2)])  # <all_to_all>
        F.mse_loss(out, y).backward()  # <a2a backward>

    kind, message = twice(body)
    assert kind == "mismatch"
    assert message.startswith("collective #3 on group '0' (ranks [0, 1]) does not match across ranks")
    assert (f"rank 0: all_reduce(shapes=[(212,)], dtypes=[float32], op=SUM) at {here('a2a backward')}"
            in message)
    assert f"rank 1: all_to_all(shapes=[(2,), (2,)], dtypes=[float32, float32]) at {here('all_to_all')}" in message


def test_find_unused_parameters_on_one_rank_only_mismatches_the_used_map_with_the_bucket_rebuild():
    """gloo, 2 processes: both ranks time out in a recv (after the process group's timeout)."""

    def body(rank):
        model = DDP(make_model(), find_unused_parameters=(rank == 0))
        for i in range(3):
            x, y = data(rank, i)
            out = model(x)  # <one-rank forward>
            F.mse_loss(out, y).backward()  # <one-rank backward>

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind, message = twice(body)
    assert kind == "mismatch"
    # Rank 0 all-reduces its used-parameter map at the end of backward; rank 1 (which rebuilds
    # buckets, as find_unused_parameters=False does) broadcasts the rebuilt layout next forward.
    assert message.startswith("collective #4 on group '0' (ranks [0, 1]) does not match across ranks "
                              "(differs in: op, reduce op, root, tensors)")
    assert f"rank 0: all_reduce(shapes=[(4,)], dtypes=[int32], op=SUM) at {here('one-rank backward')}" in message
    assert f"rank 1: broadcast(shapes=[(5,)], dtypes=[int32], root=0) at {here('one-rank forward')}" in message


# -- buffers ---------------------------------------------------------------------------------------


class Recentre(nn.Module):
    """Reads a running centre of its input, then *rebinds* the buffer attribute in forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.register_buffer("center", torch.zeros(8))
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(self.center.clone())
        out = self.lin(x - self.center)
        self.center = 0.9 * self.center + 0.1 * x.mean(0).detach()  # a new tensor, not in place
        return out


def _recentre(rank, broadcast):
    module = Recentre()
    model = DDP(module, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = data(rank, i)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [c.sum().item() for c in module.seen], {k: v.clone() for k, v in module.state_dict().items()}


def test_a_buffer_rebound_in_forward_is_still_broadcast_so_ranks_agree_in_torch_2_13():
    """DDP re-reads the module's buffers before each broadcast (``_assign_modules_buffers``), so
    rebinding does not detach the buffer from synchronization. gloo, 2 processes: the same
    per-forward sums, 0.0, 0.005274, -0.272028, on both ranks."""
    kind, returns = twice(lambda rank: _recentre(rank, True))
    assert kind == "returned"
    (seen0, state0), (seen1, state1) = returns
    assert seen0 == seen1  # every forward starts from rank 0's centre
    assert [round(s, 6) for s in seen0] == [0.0, 0.005274, -0.272028]
    assert torch.equal(state0["lin.weight"], state1["lin.weight"])
    assert not torch.equal(state0["center"], state1["center"])  # each rank's own last update


def test_without_buffer_broadcast_a_rebound_buffer_diverges_between_ranks_silently():
    kind, returns = twice(lambda rank: _recentre(rank, False))
    assert kind == "returned"
    (seen0, state0), (seen1, state1) = returns
    assert seen0[0] == seen1[0] == 0.0 and seen0[1:] != seen1[1:]  # forwards read different centres
    assert torch.equal(state0["lin.weight"], state1["lin.weight"])  # gradients are still averaged


@pytest.mark.parametrize("mismatch", ["count", "shape"])
def test_large_worlds_check_ddp_parameters_with_torchs_own_errors(monkeypatch, mismatch):
    """At LARGE_WORLD ranks DDP's parameter check runs in linear memory (fakepg.fidelity.ddp_checks);
    it must fail exactly as torch's C++ check does."""
    from fakepg.fidelity import ddp_checks

    def body(rank):
        layers = [torch.nn.Linear(4, 4)]
        if rank == 1:
            layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)] if mismatch == "count" \
                else [torch.nn.Linear(4, 5)]
        DDP(torch.nn.Sequential(*layers))

    def failure():
        with pytest.raises(fakepg.RankFailedError) as e:
            fakepg.spawn(body, nprocs=2)
        return type(e.value.__cause__), str(e.value.__cause__).splitlines()[0]

    torchs = failure()
    monkeypatch.setattr(ddp_checks, "LARGE_WORLD", 2)
    ours = failure()
    assert ours == torchs
    assert "DDP expects same model" in torchs[1] or "appears not to match sizes" in torchs[1]
