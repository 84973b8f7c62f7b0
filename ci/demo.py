"""The main job: 4-rank DDP training on the fake cluster, then the same training timed.

    python ci/demo.py [--out DIR]

Part 1 runs torch's real DDP on fakepg's 4 in-process ranks, prints a per-rank summary of the
collective trace and checks that all ranks end with equal parameters (and that a rerun is
bitwise identical). Part 2 runs the same training on 8 simulated ranks (simddp) with rank 3
at half speed, prints a per-iteration summary, and writes the timeline PNG and the Chrome
trace (open it in https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
import simddp

RANKS, ITERS = 4, 20


def train(rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)  # each rank its own shard of data
    for _ in range(ITERS):
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fakepg + simddp demo")
    ap.add_argument("--out", default="out", help="where the PNG and Chrome trace go (default ./out)")
    args = ap.parse_args(argv)
    console = Console()
    console.print(f"[bold]fakepg demo[/]: torch {torch.__version__} DDP, {RANKS} ranks x {ITERS} iterations, "
                  f"6-layer MLP, bucket_cap_mb=0.05, one process")
    result = fakepg.spawn(train, nprocs=RANKS, seed=0)
    table = Table(title=f"collective trace per rank ({result.wall_time:.2f} s wall)")
    for col in ("rank", "collectives", "ops", "MB moved", "last call site"):
        table.add_column(col)
    for rank, recs in enumerate(result.trace):
        ops: dict[str, int] = {}
        for r in recs:
            ops[r.op] = ops.get(r.op, 0) + 1
        table.add_row(str(rank), str(len(recs)), ", ".join(f"{k}×{v}" for k, v in sorted(ops.items())),
                      f"{sum(r.bytes for r in recs) / 1e6:.2f}", recs[-1].site)
    console.print(table)
    equal = all(torch.equal(result.returns[0][k], other[k])
                for other in result.returns[1:] for k in result.returns[0])
    console.print(f"all {RANKS} ranks end with bitwise-equal parameters: "
                  f"{'[green]yes[/]' if equal else '[red]NO[/]'}")
    again = fakepg.spawn(train, nprocs=RANKS, seed=0)
    same = result.to_json() == again.to_json() and all(
        torch.equal(result.returns[0][k], again.returns[0][k]) for k in result.returns[0])
    console.print(f"a rerun gives bitwise-identical parameters and trace: "
                  f"{'[green]yes[/]' if same else '[red]NO[/]'}")
    ok = equal and same and timed_demo(console, args.out)
    return 0 if ok else 1


def timed_demo(console: Console, out: str) -> bool:
    timing = simddp.Timing(network=simddp.Network.preset("100gbe"),
                           compute=simddp.Compute.roofline("cpu"), rank_speed={3: 0.5})
    console.print(f"\n[bold]simddp[/]: the same training on 8 simulated ranks, 100 GbE, roofline CPU "
                  f"compute, rank 3 at half speed (a straggler)")
    sim = simddp.simulate(train, nprocs=8, timing=timing, seed=0)
    fast = simddp.simulate(train, nprocs=8, timing=timing.__class__(
        network=timing.network, compute=timing.compute), seed=0)
    console.print(sim.timeline.summary(max_rows=6))
    its, base = sim.timeline.iteration_times()[1:], fast.timeline.iteration_times()[1:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    console.print(f"steady-state iteration: {mean(its) * 1e3:.3f} ms with the straggler, "
                  f"{mean(base) * 1e3:.3f} ms without: the slow rank costs "
                  f"{(mean(its) / mean(base) - 1) * 100:.0f}%; exposed communication "
                  f"{mean(sim.timeline.exposed_comm()[1:]) * 1e3:.3f} ms per iteration")
    os.makedirs(out, exist_ok=True)
    png, trace = os.path.join(out, "timeline.png"), os.path.join(out, "timeline.json")
    sim.timeline.plot(png)
    sim.timeline.to_chrome_trace(trace)
    console.print(f"wrote {png} (Gantt chart per rank) and {trace} (Chrome trace for Perfetto)")
    return mean(its) > mean(base)


if __name__ == "__main__":
    sys.exit(main())
