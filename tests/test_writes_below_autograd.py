"""A collective writes into the ranks' tensors the way a backend's C++ kernels do: below
autograd. No autograd graph joins two ranks' tensors, no version counter moves, and a leaf that
requires grad may be written (``dist.broadcast(param, 0)``, a recv buffer that requires grad, as
``torch.distributed.pipelining`` allocates). Each case is compared with real gloo processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fakepg
from gloo_processes import gloo_results


def _autograd_view_of_collectives(rank: int) -> dict:
    out: dict = {}
    p = torch.nn.Parameter(torch.full((3,), float(rank)))
    dist.broadcast(p, 0)  # a leaf that requires grad, written in place
    out["broadcast"] = (p.tolist(), p._version, p.requires_grad, p.grad_fn is None)
    w = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    x = w * 2.0  # a tensor with history, reduced in place
    dist.all_reduce(x)
    out["all_reduce"] = (x.tolist(), x._version, type(x.grad_fn).__name__)
    (x * torch.arange(3.0)).sum().backward()  # its gradient stays on this rank
    out["grad"] = w.grad.tolist()
    buf = torch.zeros(3, requires_grad=True)  # a pipelining-style recv buffer
    if rank == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(buf, 0)
    out["recv"] = (buf.tolist(), buf._version, buf.requires_grad)
    return out


def _pipeline(rank: int, schedule: str) -> bytes:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    world = dist.get_world_size()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    per = len(layers) // world
    stage_mod = torch.nn.Sequential(*layers[rank * per:(rank + 1) * per], torch.nn.ReLU())
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=4, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    for _ in range(2):
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in stage_mod.parameters())


def test_collectives_leave_autograd_as_gloo_does_thread_and_process_mode(tmp_path):
    want = [
        {"broadcast": ([0.0] * 3, 0, True, True), "all_reduce": ([6.0] * 3, 0, "MulBackward0"),
         "grad": [0.0, 2.0, 4.0], "recv": ([0.0] * 3, 0, True)},
        {"broadcast": ([0.0] * 3, 0, True, True), "all_reduce": ([6.0] * 3, 0, "MulBackward0"),
         "grad": [0.0, 2.0, 4.0], "recv": ([1.0] * 3, 0, True)},
    ]
    assert fakepg.spawn(_autograd_view_of_collectives, nprocs=2, backend="gloo").returns == want
    assert fakepg.spawn(_autograd_view_of_collectives, nprocs=2, backend="gloo",
                        isolation="process").returns == want


@pytest.mark.gloo
def test_the_autograd_view_of_collectives_is_real_gloos(tmp_path):
    assert (gloo_results(_autograd_view_of_collectives, 2, tmp_path)
            == fakepg.spawn(_autograd_view_of_collectives, nprocs=2, backend="gloo").returns)


def test_torch_pipelining_gpipe_trains_each_stage_on_the_fake_cluster():
    """torch.distributed.pipelining receives into buffers that require grad: that crashed
    ("a leaf Variable that requires grad is being used in an in-place operation")."""
    stages = fakepg.spawn(_pipeline, nprocs=2, args=("gpipe",), backend="gloo").returns
    assert len(set(stages)) == 2 and all(len(s) == 2 * (8 * 8 + 8) * 4 for s in stages)


@pytest.mark.gloo
def test_torch_pipelining_1f1b_trains_bitwise_as_on_real_gloo(tmp_path):
    real = gloo_results(_pipeline, 4, tmp_path, ("1f1b",))
    assert fakepg.spawn(_pipeline, nprocs=4, args=("1f1b",), backend="gloo").returns == real
