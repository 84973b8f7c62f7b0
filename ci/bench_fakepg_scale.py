"""Benchmark: how a fake world grows — wall time and peak memory of DDP on 1,024 and 4,096 ranks.

Workload: each rank builds DDP around a 2-layer MLP (8 → 8 → 1) and trains 2 iterations
(SGD). Each figure comes from its own subprocess (peak RSS from ``ru_maxrss``). For
comparison, 1,024 ranks also run with torch's own C++ parameter check at DDP construction
(what fakepg used before fakepg.fidelity.ddp_checks), measured side by side. Then each size again with
one rank skipping an all_reduce: the time and memory of the hang verdict and its report.

Targets (issue 11): 4,096 ranks ≤ 60 s and ≤ 4 GB, growing about linearly.

    python ci/bench_fakepg_scale.py [--ranks 1024,4096] [--no-torch-check]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch, fakepg
from fakepg.fidelity import ddp_checks
from torch.nn.parallel import DistributedDataParallel as DDP

n, mode = int(sys.argv[1]), sys.argv[2]
if mode == "torch-check":
    ddp_checks.LARGE_WORLD = 1 << 62

def train(rank):
    torch.manual_seed(0)
    m = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
    return float(m.module[0].weight.sum())

def skip_one(rank):
    if rank != 7:
        torch.distributed.all_reduce(torch.ones(2))

t = time.perf_counter()
lines = 0
if mode == "hang":
    try:
        fakepg.spawn(skip_one, nprocs=n)
    except fakepg.CollectiveHangError as e:
        lines = len(e.report.splitlines())
else:
    res = fakepg.spawn(train, nprocs=n)
    assert len(set(res.returns)) == 1, "replicas diverged"
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "lines": lines,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(n: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), mode],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1024,4096")
    ap.add_argument("--no-torch-check", action="store_true")
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        r = run(n, "ddp")
        rows.append((n, "fakepg", r))
        print(f"{n:>6} ranks  fakepg                  {r['wall_s']:7.1f} s  {r['peak_mb']:7.0f} MB",
              flush=True)
        if n == 1024 and not args.no_torch_check:
            t = run(n, "torch-check")
            rows.append((n, "torch-check", t))
            print(f"{n:>6} ranks  torch's C++ DDP check   {t['wall_s']:7.1f} s  {t['peak_mb']:7.0f} MB"
                  f"   (fakepg: {t['wall_s'] / r['wall_s']:.2f}× faster, "
                  f"{t['peak_mb'] / r['peak_mb']:.2f}× less memory)", flush=True)
        h = run(n, "hang")
        print(f"{n:>6} ranks  hang verdict            {h['wall_s']:7.1f} s  {h['peak_mb']:7.0f} MB"
              f"   (one rank skips an all_reduce; report: {h['lines']} lines)", flush=True)
    big = [r for n, kind, r in rows if kind == "fakepg" and n >= 4096]
    if big:
        ok = big[0]["wall_s"] <= 60 and big[0]["peak_mb"] <= 4096
        print(f"target 4,096 ranks ≤ 60 s and ≤ 4 GB: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
