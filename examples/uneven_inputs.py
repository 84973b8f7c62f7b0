"""Uneven inputs without Join: rank 1 has one batch more, so its last all_reduce never
completes. fakepg reports the hang at once, naming each rank's pending collective."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg


def train(rank: int) -> None:
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(20, 1))
    for _ in range(2 + rank):  # rank 1 has one batch more than rank 0
        model(torch.randn(4, 20)).sum().backward()


try:
    fakepg.spawn(train, nprocs=2, seed=0)
except fakepg.CollectiveHangError as err:
    print(err.report)
