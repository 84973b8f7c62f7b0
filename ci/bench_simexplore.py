"""Benchmark: what simddp.explore costs per run over plain simddp.simulate, and shrinking time.

1. Per-run cost: the DDP MLP workload of ``ci/bench_simddp.py`` (4 ranks, 10 iterations
   here) run ``--runs`` times by ``simddp.simulate`` under timings drawn up front, against
   ``simddp.explore`` of the same program for the same number of runs (all pass): the ratio
   is explore's overhead per run (hypothesis's draws, bookkeeping, the faults' checks).
   Also prints runs per second on that workload.
2. Shrinking: the straggler-induced barrier timeout of docs/simddp.md, found and shrunk to one
   slowed rank; prints runs and seconds to the first failure and to the shrunk one.

    python ci/bench_simexplore.py [--runs 20] [--iters 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_simddp import workload  # noqa: E402

import simddp  # noqa: E402
from simddp import Compute, Network, Timing  # noqa: E402


def straggler(rank: int) -> float:
    x = torch.ones(8, 8)
    for _ in range(20):
        x = x @ x * 0.01
    dist.barrier()
    return simddp.now()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    base = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("cpu"))
    strat = simddp.strategies.timings(base, a.ranks, max_jitter=0.05, horizon=1e-3)
    # the same kind of timings, drawn once, for plain simulate
    from hypothesis import find, settings
    drawn: list[Timing] = []

    def keep(t: Timing) -> bool:
        drawn.append(t)
        return False
    try:
        find(strat, keep, settings=settings(max_examples=a.runs - 1, database=None))
    except Exception:  # noqa: BLE001 - NoSuchExample: we only wanted the draws
        pass
    timings = [base] + drawn[:a.runs - 1]
    simddp.simulate(workload, (a.iters,), a.ranks, timing=base)  # warm-up (first-run costs)
    plain = expl = float("inf")
    for _ in range(a.rounds):  # alternating, best of rounds
        t0 = time.perf_counter()
        for t in timings:
            simddp.simulate(workload, (a.iters,), a.ranks, timing=t)
        plain = min(plain, time.perf_counter() - t0)
        t0 = time.perf_counter()
        s = simddp.explore(workload, (a.iters,), a.ranks, timing=base, runs=len(timings) - 1,
                           max_jitter=0.05, horizon=1e-3)
        expl = min(expl, time.perf_counter() - t0)
    print(f"DDP MLP, {a.ranks} ranks x {a.iters} iterations, {len(timings)} timings:")
    print(f"  simulate: {plain / len(timings) * 1e3:.1f} ms/run   explore: "
          f"{expl / s.runs * 1e3:.1f} ms/run   ratio {expl / s.runs / (plain / len(timings)):.3f}x"
          f"   ({s.runs / expl:.2f} runs/s)")
    print(f"  {s}")

    tb = Timing(compute=Compute.constant(1e-3), timeout=0.05)
    t0 = time.perf_counter()
    try:
        simddp.explore(straggler, nprocs=4, timing=tb, runs=100)
    except simddp.ExplorationError as e:
        took = time.perf_counter() - t0
        print(f"straggler timeout: found at run {e.runs - e.shrink_runs}, shrunk in "
              f"{e.shrink_runs} runs; {took:.2f} s in all ({took / e.runs * 1e3:.1f} ms/run); "
              f"{e.deviations}")


if __name__ == "__main__":
    main()
