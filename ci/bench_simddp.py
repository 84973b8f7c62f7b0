"""Benchmark: what virtual time costs over the untimed fake cluster, plus a DDP what-if.

Workload (the fakepg benchmark's): 4 ranks × 50 iterations of a 6-layer MLP (width 64,
batch 32) under DistributedDataParallel with SGD. It runs untimed (``fakepg.spawn``) and
timed (``simddp.simulate`` with ``Compute.roofline("cpu")`` and the gloo-loopback network) —
per-op (``coarse=False``) and with tapes (the default) — and with a do-nothing dispatch mode
per rank (the floor of any per-op charging), interleaved in one process, and prints best-of-k
and median wall and CPU times and their ratios (target: timed ≤ 1.5× untimed). Then a
what-if: 8 simulated ranks with one straggler at half speed, against the same run without it.

    python ci/bench_simddp.py [--rounds 7] [--iters 50] [--ranks 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import fakepg
import simddp
from simddp import Compute, Network, Timing


def workload(rank: int, iters: int = 50, width: int = 64, depth: int = 6, batch: int = 32) -> float:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = DDP(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    for _ in range(iters):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return float(loss.detach())


class _NoOpMode(TorchDispatchMode):
    """The floor: a per-rank dispatch mode that only runs each op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **kwargs) if kwargs else func._op(*args)


class _NoOpHooks(fakepg.WorldHooks):
    def __init__(self) -> None:
        self.modes: dict[int, _NoOpMode] = {}

    def rank_started(self, rank: int) -> None:
        self.modes[rank] = _NoOpMode()
        self.modes[rank].__enter__()

    def rank_finished(self, rank: int) -> None:
        self.modes.pop(rank).__exit__(None, None, None)


def _timed(fn, *args, **kwargs) -> tuple[Any, float, float]:
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - w, time.process_time() - c


def overhead(rounds: int, iters: int, ranks: int) -> float:
    """Untimed, the do-nothing dispatch mode (the floor of per-op charging), timed per-op
    (``coarse=False``, the path before tapes) and timed (tapes: the default), interleaved."""
    timing = Timing(network=Network.preset("gloo-loopback"), compute=Compute.roofline("cpu"))
    runs = {
        "untimed fakepg.spawn": lambda: fakepg.spawn(workload, (iters,), ranks),
        "do-nothing dispatch mode": lambda: fakepg.spawn(workload, (iters,), ranks,
                                                         hooks=_NoOpHooks()),
        "timed, per-op": lambda: simddp.simulate(workload, (iters,), ranks, timing=timing,
                                                 coarse=False),
        "timed (tapes)": lambda: simddp.simulate(workload, (iters,), ranks, timing=timing),
    }
    for run in runs.values():  # warm-up: imports, first-call costs
        run()
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    outs: dict[str, Any] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            outs[name], wall, cpu = _timed(run)
            got[name].append((wall, cpu))
    print(f"overhead of virtual time: {ranks} ranks × {iters} iterations, 6-layer MLP (64 wide, "
          f"batch 32), DDP + SGD; {rounds} interleaved rounds; ratios to the untimed run")
    base = got["untimed fakepg.spawn"]
    ratios = {}
    for k, clock in ((0, "wall"), (1, "CPU")):
        bu, mu = min(x[k] for x in base), statistics.median(x[k] for x in base)
        print(f"  {clock} time (untimed: best {bu:.3f} s, median {mu:.3f} s)")
        for name, xs in got.items():
            b, m = min(x[k] for x in xs), statistics.median(x[k] for x in xs)
            ratios[name, clock] = (b / bu, m / mu)
            print(f"    {name:<26} best {b:.3f} s median {m:.3f} s | ratio best {b / bu:.2f}×, "
                  f"median {m / mu:.2f}×")
    ratio = ratios["timed (tapes)", "CPU"][1]
    print(f"  (timed: Compute.roofline('cpu'), Network.preset('gloo-loopback')); target ≤ 1.5×, "
          f"median CPU-time ratio {ratio:.2f}×: {'met' if ratio <= 1.5 else 'NOT met'} "
          f"(CPU time is the robust figure on a shared machine)")
    per_op, tapes = outs["timed, per-op"], outs["timed (tapes)"]
    print(f"  same losses timed and untimed: "
          f"{outs['untimed fakepg.spawn'].returns == tapes.returns == per_op.returns}; "
          f"same virtual times per-op and with tapes: "
          f"{per_op.to_json() == tapes.to_json() and per_op.timeline.to_csv() == tapes.timeline.to_csv()}")
    return ratio


def what_if(ranks: int = 8, iters: int = 10) -> None:
    base = dict(network=Network.preset("100gbe"), compute=Compute.roofline("cpu"))
    print(f"\nwhat-if: {ranks} ranks, {iters} iterations of the same DDP MLP, "
          f"roofline cpu compute, 100 GbE")
    rows = []
    for label, speed in (("all ranks at full speed", {}), ("rank 3 at 0.5 speed", {3: 0.5})):
        res = simddp.simulate(workload, (iters,), ranks, timing=Timing(rank_speed=speed, **base))
        tl = res.timeline
        steady = tl.iteration_times()[1:]
        exposed = tl.exposed_comm()[1:]
        waits = tl.waits()[1:]
        it, ex, wt = (statistics.mean(v) for v in (steady, exposed, waits))
        rows.append(it)
        print(f"  {label:<26} iteration {it * 1e3:.3f} ms   exposed comm {ex * 1e3:.3f} ms   "
              f"longest wait {wt * 1e3:.3f} ms")
        if speed:
            print(tl.summary(max_rows=6))
    print(f"  the straggler costs {(rows[1] - rows[0]) * 1e3:.3f} ms per iteration "
          f"({rows[1] / rows[0]:.2f}× the iteration time)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--ranks", type=int, default=4)
    a = p.parse_args(argv)
    overhead(a.rounds, a.iters, a.ranks)
    what_if()
    return 0


if __name__ == "__main__":
    sys.exit(main())
