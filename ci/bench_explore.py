"""What exploring schedules costs: per run vs a plain spawn, runs per second, shrinking.

    python ci/bench_explore.py

The workload is a small DDP MLP (3 ranks, 3 iterations, a bucket per parameter so there are
hand-offs to choose at). ``explore`` runs it under drawn schedules; the plain side spawns it
with no schedule the same number of times. Rounds alternate; best and median are printed, as
ratios measured side by side. Shrinking is timed on the store-counter race of docs/races.md.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg

RUNS, ROUNDS = 40, 3


def ddp_mlp(rank: int) -> float:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=g)).sum().backward()
        opt.step()
    return float(next(model.parameters()).detach().sum())


def counter(rank: int) -> None:
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("n", "0")
    dist.barrier()
    store.set("n", str(int(store.get("n")) + 1))
    dist.barrier()
    if int(store.get("n")) != dist.get_world_size():
        raise AssertionError("lost update")


def main() -> None:
    plain, explored = [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(RUNS):
            fakepg.spawn(ddp_mlp, nprocs=3)
        plain.append((time.perf_counter() - t0) / RUNS)
        t0 = time.perf_counter()
        summary = fakepg.explore(ddp_mlp, nprocs=3, runs=RUNS)
        explored.append((time.perf_counter() - t0) / summary.runs)
    print(f"DDP MLP, 3 ranks x 3 iterations, {RUNS} runs per round, {ROUNDS} rounds, torch {torch.__version__}")
    print(f"plain spawn    per run: best {min(plain) * 1e3:7.1f} ms  median {statistics.median(plain) * 1e3:7.1f} ms")
    print(f"explore        per run: best {min(explored) * 1e3:7.1f} ms  median {statistics.median(explored) * 1e3:7.1f} ms")
    print(f"explore / plain (best, median): {min(explored) / min(plain):.2f}x, "
          f"{statistics.median(explored) / statistics.median(plain):.2f}x  (goal <= 1.2x); "
          f"{1 / min(explored):.1f} runs/s; choice points per run: {summary.choice_points}")
    t0 = time.perf_counter()
    try:
        fakepg.explore(counter, nprocs=2, runs=200)
    except fakepg.ExplorationError as e:
        print(f"store-counter race: found and shrunk to {len(e.deviations)} deviation(s) in "
              f"{e.runs} runs, {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
