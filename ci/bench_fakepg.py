"""Benchmark: the same DDP training on fakepg, torch's ThreadedProcessGroup and real gloo.

Workload: 4 ranks x 50 iterations of a 6-layer MLP (width 64, batch 32), DDP + SGD, in two
variants: DDP's default buckets (one all_reduce per iteration) and one bucket per parameter
(``bucket_cap_mb=0.01``: six all_reduces per iteration, so the per-collective path dominates).
Each contender runs ``--repeat`` times, interleaved, in one process run; the best and
median times are printed with their ratios (these machines are shared and noisy, so only
ratios measured side by side mean anything). The in-process contenders' CPU time (all their
threads) is printed too: on a busy machine it moves much less than wall time.

A rank of ``fakepg.spawn`` starts with one intra-op thread when OMP_NUM_THREADS is unset (as
torchrun starts its workers); ThreadedProcessGroup's rank threads start with the caller's count.
``--threads-too`` adds both the other way round (fakepg with the caller's count per rank,
ThreadedProcessGroup with one thread per rank), timed in the same rounds.

Targets: fakepg >= 5x faster than multi-process gloo; at most 1.0x ThreadedProcessGroup's time
(issue 27) in both variants, the one-bucket-per-parameter loop above all.

    python ci/bench_fakepg.py [--ranks 4] [--iters 50] [--repeat 3] [--skip-gloo] [--threads-too]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg


VARIANTS = {"default buckets": None, "bucket_cap_mb=0.01": 0.01}


def train(rank: int, iters: int, bucket_cap_mb: float | None = None) -> torch.Tensor:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = DDP(torch.nn.Sequential(*layers), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(iters):
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_fakepg(ranks: int, iters: int, cap: float | None = None) -> torch.Tensor:
    return fakepg.spawn(train, args=(iters, cap), nprocs=ranks).returns[0]


def run_fakepg_callers_threads(ranks: int, iters: int, cap: float | None = None) -> torch.Tensor:
    """fakepg with each rank on the caller's intra-op thread count (spawn's default before a
    rank started with one thread when OMP_NUM_THREADS is unset, as torchrun's workers do)."""
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    return fakepg.spawn(train, args=(iters, cap), nprocs=ranks, env=env).returns[0]


def run_threaded_one_thread(ranks: int, iters: int, cap: float | None = None) -> torch.Tensor:
    """ThreadedProcessGroup with one intra-op thread per rank thread, as fakepg's ranks start."""
    return run_threaded(ranks, iters, cap, intra_op=1)


def run_threaded(ranks: int, iters: int, cap: float | None = None,
                 intra_op: int | None = None) -> torch.Tensor:
    from torch.testing._internal.distributed.multi_threaded_pg import (_install_threaded_pg,
                                                                       _uninstall_threaded_pg)

    callers = torch.get_num_threads()
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    out: list = [None] * ranks

    def worker(rank: int) -> None:
        if intra_op is not None:
            torch.set_num_threads(intra_op)  # this thread's OpenMP count (and new threads')
        dist.init_process_group("threaded", rank=rank, world_size=ranks, store=store)
        out[rank] = train(rank, iters, cap)
        dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(ranks)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
        torch.set_num_threads(callers)
    if any(o is None for o in out):
        raise RuntimeError("a ThreadedProcessGroup rank failed (its traceback is above)")
    return out[0]


def _gloo_worker(rank: int, ranks: int, iters: int, cap: float | None, path: str, out: str) -> None:
    store = dist.FileStore(path, ranks)
    dist.init_process_group("gloo", rank=rank, world_size=ranks, store=store)
    params = train(rank, iters, cap)
    if rank == 0:
        torch.save(params, out)
    dist.destroy_process_group()


def run_gloo(ranks: int, iters: int, cap: float | None = None) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        mp.spawn(_gloo_worker, args=(ranks, iters, cap, os.path.join(tmp, "store"), out),
                 nprocs=ranks)
        return torch.load(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--threads-too", action="store_true",
                    help="also time fakepg with the caller's intra-op thread count per rank and "
                         "ThreadedProcessGroup with one per rank")
    args = ap.parse_args(argv)
    contenders = {"fakepg": run_fakepg, "threaded_pg": run_threaded}
    if args.threads_too:
        contenders["fakepg, caller's threads"] = run_fakepg_callers_threads
        contenders["threaded_pg, 1 thread"] = run_threaded_one_thread
    if not args.skip_gloo:
        contenders["gloo_multiprocess"] = run_gloo
    load0 = os.getloadavg()
    run_fakepg(args.ranks, 2)  # warm-up: imports, allocator, first-use costs
    run_threaded(args.ranks, 2)
    times = {(v, k): [] for v in VARIANTS for k in contenders}
    cpu = {(v, k): [] for v in VARIANTS for k in contenders if "gloo" not in k}
    results = {}
    for _ in range(args.repeat):
        for variant, cap in VARIANTS.items():
            for name, fn in contenders.items():
                for attempt in range(3):
                    t0, c0 = time.perf_counter(), time.process_time()
                    try:
                        results[variant, name] = fn(args.ranks, args.iters, cap)
                        break
                    except mp.ProcessExitedException as e:
                        # gloo sometimes aborts a process at teardown: time a clean run instead
                        if e.signal_name != "SIGABRT" or attempt == 2:
                            raise
                times[variant, name].append(time.perf_counter() - t0)
                if (variant, name) in cpu:
                    cpu[variant, name].append(time.process_time() - c0)
    print(f"DDP {args.ranks} ranks x {args.iters} iterations, 6-layer MLP (64 wide), "
          f"torch {torch.__version__}, {args.repeat} interleaved runs each; caller's intra-op "
          f"threads {torch.get_num_threads()}, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; load average before "
          f"{' '.join(f'{x:.2f}' for x in load0)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'backend':<26}" + "".join(f"{v + ' best/median s':>34}" for v in VARIANTS))
    for name in contenders:
        cells = [f"{min(times[v, name]):.3f} / {statistics.median(times[v, name]):.3f}" for v in VARIANTS]
        print(f"{name:<26}" + "".join(f"{c:>34}" for c in cells))
    best = {key: min(ts) for key, ts in times.items()}
    med = {key: statistics.median(ts) for key, ts in times.items()}
    ratio = lambda d, v, a, b: d[v, a] / d[v, b]  # noqa: E731
    cpu_best = {key: min(ts) for key, ts in cpu.items()}
    cpu_med = {key: statistics.median(ts) for key, ts in cpu.items()}
    for a in (name for name in contenders if name != "threaded_pg" and "gloo" not in name):
        target = "  (target <= 1.0x)" if a == "fakepg" else ""
        print(f"{a} / threaded_pg (best, median):  " + "   ".join(
            f"{v}: {ratio(best, v, a, 'threaded_pg'):.2f}x, {ratio(med, v, a, 'threaded_pg'):.2f}x"
            for v in VARIANTS) + target)
        print("  CPU time (best, median):  " + "   ".join(
            f"{v}: {ratio(cpu_best, v, a, 'threaded_pg'):.2f}x, "
            f"{ratio(cpu_med, v, a, 'threaded_pg'):.2f}x" for v in VARIANTS))
    if args.threads_too:  # like for like: one intra-op thread per rank on both
        a, b = "fakepg", "threaded_pg, 1 thread"
        print(f"{a} / {b} (best, median):  " + "   ".join(
            f"{v}: {ratio(best, v, a, b):.2f}x, {ratio(med, v, a, b):.2f}x" for v in VARIANTS))
    if not args.skip_gloo:
        print("gloo / fakepg (best):  " + "   ".join(
            f"{v}: {ratio(best, v, 'gloo_multiprocess', 'fakepg'):.1f}x faster" for v in VARIANTS)
            + "  (target >= 5x)")
        same = all(torch.allclose(results[v, "fakepg"], results[v, "gloo_multiprocess"], rtol=1e-5, atol=1e-6)
                   for v in VARIANTS)
        print(f"fakepg parameters match gloo's: {same}")
    bitwise = all(torch.equal(results[v, "fakepg"], results[v, "threaded_pg"]) for v in VARIANTS)
    print(f"fakepg parameters match threaded_pg's bitwise: {bitwise}  (threaded_pg's ranks share "
          f"one RNG while they build the model, so it need not reproduce itself; fakepg does)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
