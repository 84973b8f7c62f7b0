"""Under gloo a future callback runs on gloo's thread when its work finishes, so a collective it
issues races the program's own collectives on that group (fakepg.fidelity.gloo_hazards). fakepg's fixed
order would let such a program pass where real gloo mismatches or hangs: it is reported."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
from fakepg.fidelity.gloo_hazards import GlooHazardError, GlooHazardWarning
from gloo_processes import gloo_results


def _powersgd(rank: int, bucket_cap_mb: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)),
                bucket_cap_mb=bucket_cap_mb)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(4):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _callback_issues(rank: int, wait_first: bool) -> float:
    a, b, c = torch.ones(2), torch.ones(2), torch.ones(2)
    work = dist.all_reduce(a, async_op=True)
    chained = work.get_future().then(lambda _: dist.all_reduce(b, async_op=True))
    if wait_first:
        work.wait()
    dist.all_reduce(c)  # the program's next collective on the same group
    chained.wait()
    return float(a.sum() + c.sum())


def _unwaited_callback(rank: int) -> float:
    a, b, c = torch.ones(2), torch.ones(2), torch.ones(2)
    work = dist.all_reduce(a, async_op=True)
    work.get_future().then(lambda _: dist.all_reduce(b, async_op=True))  # never waited for
    dist.all_reduce(c)
    dist.barrier()
    return float(c.sum())


def test_a_hazard_raised_in_a_callback_fails_the_rank_even_if_its_future_is_never_waited():
    with pytest.raises(fakepg.RankFailedError, match="GlooHazardError"):
        fakepg.spawn(_unwaited_callback, nprocs=2, backend="gloo")


def test_powersgd_with_several_buckets_is_a_gloo_hazard_naming_both_collectives():
    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(_powersgd, args=(0.001,), nprocs=2, backend="gloo")
    err = info.value.__cause__
    while err is not None and not isinstance(err, GlooHazardError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, GlooHazardError), repr(info.value)
    text = str(err)
    assert "from a future callback of all_reduce" in text
    assert "from the program, before it waited for that work: all_reduce" in text
    assert "test_gloo_hazards.py" in text  # the user's source line


def test_the_same_program_passes_under_nccl_whose_callbacks_run_in_issue_order():
    result = fakepg.spawn(_powersgd, args=(0.001,), nprocs=2, backend="nccl")
    assert all(torch.equal(p, q) for p, q in zip(*result.returns))


def test_warn_mode_warns_once_and_the_world_goes_on_and_off_is_silent():
    with pytest.warns(GlooHazardWarning, match="order that depends on timing"):
        fakepg.spawn(_powersgd, args=(0.001,), nprocs=2, backend="gloo", gloo_hazards="warn")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", GlooHazardWarning)
        fakepg.spawn(_powersgd, args=(0.001,), nprocs=2, backend="gloo", gloo_hazards="off")
    with pytest.raises(ValueError, match="gloo_hazards must be one of"):
        fakepg.spawn(_powersgd, args=(0.001,), nprocs=2, gloo_hazards="maybe")


def test_a_callback_collective_racing_the_next_one_is_a_hazard_unless_the_program_waits_first():
    with pytest.raises(fakepg.RankFailedError, match="GlooHazardError"):
        fakepg.spawn(_callback_issues, args=(False,), nprocs=2, backend="gloo")
    assert fakepg.spawn(_callback_issues, args=(True,), nprocs=2, backend="gloo").returns == [8.0, 8.0]


@pytest.mark.gloo
def test_powersgd_with_one_bucket_is_no_hazard_and_trains_as_real_gloo(tmp_path):
    fake = fakepg.spawn(_powersgd, args=(25.0,), nprocs=2, backend="gloo").returns
    real = gloo_results(_powersgd, 2, tmp_path, (25.0,))
    assert all(torch.equal(p, q) for rf, rr in zip(fake, real) for p, q in zip(rf, rr))
