"""The main job: 4-rank DDP training on the fake cluster, with a per-rank trace summary.

    python ci/demo.py            # the fake cluster (and, once simddp is present, a timed run)
"""

from __future__ import annotations

import sys

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg

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


def main() -> int:
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
    return 0 if equal and same else 1


if __name__ == "__main__":
    sys.exit(main())
