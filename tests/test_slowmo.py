"""fairscale's SlowMoDistributedDataParallel (0.4.13): LocalSGD plus slow momentum on the fake cluster.

SlowMo is not torch's DDP: it wraps the module, averages parameters every
``localsgd_frequency`` steps (an all_reduce over its global group) and every
``slowmo_frequency`` steps takes a slow-momentum step, which in its default
memory-efficient mode reduces each shard of the parameters to its owner rank
(``dist.reduce``) and broadcasts it back. On CPU it needs two things:

* ``torch.cuda.synchronize()`` must not raise: fairscale calls it unconditionally
  (``fakepg.compat.cuda_synchronize_noop()`` makes it a no-op while CUDA is unavailable);
* ``comm_device=torch.device("cpu")``: fairscale only picks the CPU itself when the
  backend is named "gloo".

fairscale is a test dependency (``ci/setup.sh`` installs it); without it these tests fail.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fakepg
from gloo_processes import gloo_results
from fakepg.fidelity.compat import cuda_synchronize_noop

try:
    from fairscale.experimental.nn.data_parallel import SlowMoDistributedDataParallel
except Exception as e:  # noqa: BLE001 - reported by the fixture below, as a failure
    SlowMoDistributedDataParallel = None
    FAIRSCALE_ERROR: Exception | None = e
else:
    FAIRSCALE_ERROR = None

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

ITERS = 8  # LocalSGD averages after steps 2, 4, 6, 8; slow momentum after steps 4 and 8


def need_fairscale() -> None:
    """Fail (not skip) the calling test when fairscale is missing."""
    if FAIRSCALE_ERROR is not None:
        pytest.fail(
            f"fairscale 0.4.13 is not importable ({FAIRSCALE_ERROR!r}). It is a test dependency: "
            "install it with `.venv/bin/python -m pip install --no-deps --no-build-isolation "
            "fairscale==0.4.13` (ci/setup.sh does).", pytrace=False)


def slowmo_train(rank: int, memory_efficient: bool = True, init_buffers_first: bool = True):
    """The script under test: a small MLP under SlowMo; every rank's parameters after each step."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    with cuda_synchronize_noop(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SlowMoDistributedDataParallel(
            module, nprocs_per_node=1, localsgd_frequency=2, slowmo_frequency=4, slowmo_momentum=0.5,
            slowmo_memory_efficient=memory_efficient, comm_device=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if init_buffers_first:
            model._init_global_momentum_buffers(opt)  # else perform_slowmo does it after step 1
        snapshots = []
        for i in range(ITERS):
            g = torch.Generator().manual_seed(1000 * rank + i)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            model.perform_slowmo(opt)
            snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return snapshots


def equal_steps(snapshots) -> list[bool]:
    """Per step: whether every rank holds the same parameters."""
    return [all(torch.equal(s[i], snapshots[0][i]) for s in snapshots) for i in range(ITERS)]


def test_slowmo_with_localsgd_runs_on_the_fake_cluster_and_ranks_agree_after_every_average():
    need_fairscale()
    result = fakepg.spawn(slowmo_train, nprocs=4)
    # Local steps drift apart; every 2nd step LocalSGD averages, every 4th the slow-momentum step
    # (reduce to shard owners, momentum on the shard, broadcast back) makes them equal too.
    assert equal_steps(result.returns) == [False, True] * 4
    ops = [(r.op, r.root) for r in result.trace[0] if r.op in ("reduce", "broadcast")]
    # Memory-efficient mode: 4 shards (one per rank), reduced then broadcast, at steps 4 and 8.
    assert ops == ([("reduce", s) for s in range(4)] + [("broadcast", s) for s in range(4)]) * 2
    params = sum(p.numel() for p in nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).parameters())
    averages = [r for r in result.trace[0] if r.op == "all_reduce" and r.shapes == ((params,),)]
    assert len(averages) == 2  # LocalSGD at steps 2 and 6; steps 4 and 8 average inside SlowMo


def test_slowmo_memory_efficient_and_plain_modes_compute_the_same_parameters():
    need_fairscale()
    efficient = fakepg.spawn(slowmo_train, args=(True,), nprocs=2).returns
    plain = fakepg.spawn(slowmo_train, args=(False,), nprocs=2).returns
    assert equal_steps(plain) == [False, True] * 4
    assert not any(r.op == "reduce" for r in fakepg.spawn(slowmo_train, args=(False,), nprocs=2).trace[0])
    for a, b in zip(efficient[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_slowmo_without_early_momentum_buffers_lets_replicas_diverge_at_every_slow_momentum_step():
    """fairscale initialises the slow-momentum buffers lazily, inside the first perform_slowmo,
    after each rank's first local step: ``old_params`` differ per rank. In the plain
    (non-memory-efficient) mode the momentum step has no communication, so ranks that were just
    averaged diverge again at every slow-momentum step (the research run saw the same on gloo)."""
    need_fairscale()
    lazy = fakepg.spawn(slowmo_train, args=(False, False), nprocs=2).returns
    assert equal_steps(lazy) == [False, True, False, False, False, True, False, False]
    early = fakepg.spawn(slowmo_train, args=(False, True), nprocs=2).returns
    assert equal_steps(early) == [False, True] * 4


def test_cuda_synchronize_noop_is_what_lets_slowmo_start_on_a_cpu_only_machine():
    need_fairscale()
    if torch.cuda.is_available():
        pytest.skip("with CUDA, torch.cuda.synchronize works and the shim steps aside")
    original = torch.cuda.synchronize
    with cuda_synchronize_noop():
        with cuda_synchronize_noop():  # re-entrant: rank threads may each enter it
            assert torch.cuda.synchronize() is None
        assert torch.cuda.synchronize is not original
    assert torch.cuda.synchronize is original

    def without_shim(rank):
        SlowMoDistributedDataParallel(nn.Linear(2, 2), nprocs_per_node=1, comm_device=torch.device("cpu"))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(without_shim, nprocs=2)
    assert "Torch not compiled with CUDA enabled" in str(info.value.__cause__)


@pytest.mark.gloo
def test_slowmo_on_the_fake_cluster_matches_two_process_gloo_bit_for_bit(tmp_path):
    need_fairscale()
    gloo = gloo_results(slowmo_train, 2, tmp_path)
    fake = fakepg.spawn(slowmo_train, nprocs=2).returns
    for rank in range(2):
        for step, (f, g) in enumerate(zip(fake[rank], gloo[rank])):
            assert torch.equal(f, g), f"rank {rank}, step {step + 1}"
