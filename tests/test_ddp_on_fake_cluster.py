"""torch's real DDP Reducer on the fake cluster: the mathematics of data parallelism."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg

WORLD, ITERS, BATCH = 4, 5, 8


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(rank, it):
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def ddp_train(rank, bucket_cap_mb=25.0):
    model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for it in range(ITERS):
        x, y = batch(rank, it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def reference_train():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for it in range(ITERS):
        xs, ys = zip(*(batch(r, it) for r in range(WORLD)))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model.state_dict()


def test_four_rank_ddp_matches_single_process_full_batch_reference():
    result = fakepg.spawn(ddp_train, nprocs=WORLD)
    ref = reference_train()
    for rank_state in result.returns:
        for k, v in ref.items():
            torch.testing.assert_close(rank_state[k], v, rtol=1e-5, atol=1e-6)


def test_all_ranks_end_with_bitwise_equal_parameters():
    result = fakepg.spawn(ddp_train, nprocs=WORLD)
    for other in result.returns[1:]:
        for k, v in result.returns[0].items():
            assert torch.equal(other[k], v), k


def test_ddp_training_is_bitwise_identical_across_reruns_with_its_trace():
    a = fakepg.spawn(ddp_train, args=(0.001,), nprocs=WORLD, seed=7)
    b = fakepg.spawn(ddp_train, args=(0.001,), nprocs=WORLD, seed=7)
    for sa, sb in zip(a.returns, b.returns):
        for k in sa:
            assert torch.equal(sa[k], sb[k])
    assert a.to_json() == b.to_json()


def test_small_bucket_cap_splits_gradients_into_several_bucket_allreduces():
    result = fakepg.spawn(ddp_train, args=(0.001,), nprocs=2)
    allreduces = [r for r in result.trace[0] if r.op == "all_reduce"]
    assert len(allreduces) > ITERS  # more than one bucket per iteration
    assert {r.site.split(":")[0] for r in allreduces} == {"tests/test_ddp_on_fake_cluster.py"}


def test_unseeded_model_construction_is_synced_from_rank_zero_by_ddp():
    def body(rank):
        model = torch.nn.Linear(3, 3)  # each rank draws different initial weights
        before = model.weight.detach().clone()
        DDP(model)
        return before, model.weight.detach().clone()

    out = fakepg.spawn(body, nprocs=3).returns
    assert not torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(o[1], out[0][0]) for o in out)


def test_ddp_logging_data_reports_the_fake_backend():
    def body(rank):
        model = DDP(make_model())
        x, y = batch(rank, 0)
        model(x).sum().backward()
        return model._get_ddp_logging_data()

    data = fakepg.spawn(body, nprocs=2).returns[0]
    assert data["backend_name"] == "fakepg"
    assert data["world_size"] == 2


def test_a_rank_runs_its_whole_backward_before_handing_over_and_the_grads_still_agree():
    """The Reducer's default all_reduces settle when backward ends, not bucket by bucket:
    one hand-over per backward (the speed of a fake world) and the same averaged gradients."""
    events = []

    def body(rank):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]),
                    bucket_cap_mb=0.01)
        for p in model.parameters():
            p.register_hook(lambda g, rank=rank: events.append(rank) or g)
        for i in range(2):  # the second backward runs on the rebuilt, one-per-layer buckets
            events.clear()
            model(torch.randn(2, 64, generator=torch.Generator().manual_seed(rank))).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    res = fakepg.spawn(body, nprocs=2)
    assert events == [0] * 8 + [1] * 8
    for a, b in zip(*res.returns):
        assert torch.equal(a, b)
