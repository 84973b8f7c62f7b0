"""Benchmark: fakepg with ranks as processes (isolation="process") against ranks as threads.

Workload: ci/bench_fakepg.py's (4 ranks x 50 iterations of a 6-layer MLP, DDP + SGD; default
buckets, and one bucket per parameter so the per-collective path dominates), plus a
start-up-only world (DDP construction, no iteration) to show the fixed cost of forking and
reaping the ranks' processes separately. Optionally multi-process gloo (torch.multiprocessing
.spawn) on the same workload. Contenders run interleaved, ``--repeat`` times each, in one
process run; best and median times and their ratios are printed (these machines are shared
and noisy: only ratios measured side by side mean anything).

First, each mode's *first* world in a fresh interpreter (a subprocess per mode and repeat,
interleaved: imports and first-use costs included), the start-up-only world; then the rest.

Targets (issue 9): process mode <= 3x thread mode; >= 10x faster than multi-process gloo.
Issue 27: a first process-mode world <= 2x a first thread-mode one.

    python ci/bench_process_mode.py [--ranks 4] [--iters 50] [--repeat 3] [--gloo]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

_CI = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_CI, os.path.dirname(_CI)]  # this checkout's fakepg, and bench_fakepg beside us
from bench_fakepg import VARIANTS, run_gloo, train  # noqa: E402  (the same workload)

import fakepg  # noqa: E402


def run(isolation: str, ranks: int, iters: int, cap: float | None) -> torch.Tensor:
    return fakepg.spawn(train, args=(iters, cap), nprocs=ranks, isolation=isolation).returns[0]


def first_world(isolation: str, ranks: int) -> float:
    """Seconds of the first start-up-only world in a fresh interpreter (torch, fakepg imported)."""
    code = (f"import sys, time; sys.path[:0] = {[_CI, os.path.dirname(_CI)]!r}\n"
            "from bench_fakepg import train\nimport fakepg\nt = time.perf_counter()\n"
            f"fakepg.spawn(train, args=(0, None), nprocs={ranks}, isolation={isolation!r})\n"
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gloo", action="store_true", help="also time multi-process gloo (slow)")
    args = ap.parse_args(argv)
    first: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(args.repeat):
        for mode in first:
            first[mode].append(first_world(mode, args.ranks))
    ft, fp = (min(first["thread"]), statistics.median(first["thread"])), \
        (min(first["process"]), statistics.median(first["process"]))
    print(f"first world in a fresh interpreter (start-up only, {args.ranks} ranks), best / median s: "
          f"thread {ft[0]:.3f} / {ft[1]:.3f}, process {fp[0]:.3f} / {fp[1]:.3f}; process/thread "
          f"{fp[0] / ft[0]:.2f}x / {fp[1] / ft[1]:.2f}x  (target <= 2x)")
    contenders = {"thread": lambda r, i, c: run("thread", r, i, c),
                  "process": lambda r, i, c: run("process", r, i, c)}
    if args.gloo:
        contenders["gloo_multiprocess"] = run_gloo
    for name in ("thread", "process"):  # warm-up: imports, allocator, first-use costs
        contenders[name](args.ranks, 2, None)
    workloads = {"start-up only (0 iters)": (0, None),
                 **{f"{v} ({args.iters} iters)": (args.iters, cap) for v, cap in VARIANTS.items()}}
    times: dict[tuple[str, str], list[float]] = {(w, k): [] for w in workloads for k in contenders}
    results = {}
    for _ in range(args.repeat):
        for w, (iters, cap) in workloads.items():
            for name, fn in contenders.items():
                if name == "gloo_multiprocess" and iters == 0:
                    continue
                t0 = time.perf_counter()
                results[w, name] = fn(args.ranks, iters, cap)
                times[w, name].append(time.perf_counter() - t0)
    print(f"DDP {args.ranks} ranks, 6-layer MLP (64 wide), torch {torch.__version__}, "
          f"{args.repeat} interleaved runs each; seconds best / median")
    print(f"{'workload':<34}" + "".join(f"{k:>22}" for k in contenders) + f"{'process/thread':>22}")
    for w in workloads:
        cells = [f"{min(times[w, k]):.3f} / {statistics.median(times[w, k]):.3f}" if times[w, k]
                 else "-" for k in contenders]
        ratio = (f"{min(times[w, 'process']) / min(times[w, 'thread']):.2f}x / "
                 f"{statistics.median(times[w, 'process']) / statistics.median(times[w, 'thread']):.2f}x")
        print(f"{w:<34}" + "".join(f"{c:>22}" for c in cells) + f"{ratio:>22}")
    if args.gloo:
        for w in workloads:
            if times[w, "gloo_multiprocess"]:
                print(f"gloo / process (best), {w}: "
                      f"{min(times[w, 'gloo_multiprocess']) / min(times[w, 'process']):.1f}x")
    same = all(torch.equal(results[w, "thread"], results[w, "process"]) for w in workloads)
    print(f"process-mode parameters equal thread mode's bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
