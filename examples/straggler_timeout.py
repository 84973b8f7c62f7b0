"""A barrier under a 50 ms watchdog passes on even ranks; simddp.explore finds the straggler
that turns it into a timeout, and shrinks it to one rank at the smallest slowdown that fails."""

import torch
import torch.distributed as dist

import simddp
from simddp import Compute, Timing


def work(rank: int) -> None:
    x = torch.ones(8, 8)
    for _ in range(20):
        x = x @ x * 0.01          # 40 ops: 40 ms of virtual time at 1 ms per op
    dist.barrier()                # under a 50 ms watchdog


base = Timing(compute=Compute.constant(1e-3), timeout=0.05)
try:
    simddp.explore(work, nprocs=4, timing=base, runs=100)
except simddp.ExplorationError as err:
    print(f"{type(err).__name__}: {err}")
