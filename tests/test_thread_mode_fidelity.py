"""What a program sees of the process in thread mode is what it sees under torchrun: torch's
global module hooks per rank (CommDebugMode, ModTracker, FSDPMemTracker install them), and
torch's backend registry without fakepg's own name."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor.debug import CommDebugMode

import fakepg


class _Net(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.layers = nn.ModuleDict({f"r{rank}_{i}": nn.Linear(4, 4) for i in range(2)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
            dist.all_reduce(x)  # a hand-over between layers: the other rank runs its own forward
        return x


def _tracked(rank):
    model = _Net(rank)
    seen = []
    with ModTracker() as tracker:
        handle = nn.modules.module.register_module_forward_pre_hook(
            lambda mod, args: seen.append(sorted(tracker.parents)))
        model(torch.ones(1, 4))
        handle.remove()
    with CommDebugMode() as comm:  # before: "The Module hierarchy tracking is wrong"
        model(torch.ones(1, 4))
    return seen[-1], sorted(comm.comm_module_counts)


def test_each_ranks_module_tracker_sees_only_its_own_modules_as_in_its_own_process():
    threads = fakepg.spawn(_tracked, nprocs=2).returns
    assert threads == [(["Global", "_Net", f"_Net.layers.r{r}_1"], ["Global"]) for r in range(2)]
    assert fakepg.spawn(_tracked, nprocs=2, isolation="process").returns == threads


def test_a_hook_one_rank_registers_is_not_seen_by_the_other_and_the_callers_come_back():
    calls = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: calls.append("host"))

    def train(rank):
        if rank == 0:
            nn.modules.module.register_module_forward_hook(lambda m, a, out: calls.append(rank))
        dist.barrier()  # rank 1 runs with rank 0's hook registered in rank 0 only
        nn.Linear(2, 2)(torch.ones(2))

    try:
        fakepg.spawn(train, nprocs=2)
        assert calls.count(0) == 1  # rank 1's forward did not call rank 0's hook
        calls.clear()
        nn.Linear(2, 2)(torch.ones(2))
        assert calls == ["host"]  # the caller's own hooks are back after the world
    finally:
        handle.remove()


def test_backend_list_shows_torchs_backends_without_fakepgs_own():
    def listed(rank):
        return list(dist.Backend.backend_list), len(dist.Backend.backend_list)

    for isolation in ("thread", "process"):
        for names, count in fakepg.spawn(listed, nprocs=2, isolation=isolation).returns:
            assert "fakepg" not in names and count == len(names)
            assert "gloo" in names
    assert "fakepg" not in list(dist.Backend.backend_list)
    assert fakepg.BACKEND_NAME in dist.Backend.backend_list  # torch's own check still passes
