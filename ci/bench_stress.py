"""Stress benchmark: fake worlds under a machine loaded far past its cores -- no false hang
verdict, no crash.

Programs that must end normally (pipelining schedules GPipe, 1F1B and Interleaved1F1B; DDP
training; Python waits handed between ranks; sleeps; ranks that end while the scheduler samples
their clocks; a rank waiting on its subprocess) run as fake worlds, in thread and in process
mode, while CPU hogs keep the load at ``--load`` x the core count. The worlds run in worker
processes, a batch each, so that a crash (SIGSEGV) is counted instead of ending the benchmark.

Printed: worlds run, false hang verdicts (a hang or timeout error from a program that cannot
hang), other failures, crashed workers, and the hogs' load. Target (issue 27): 0 false hang
verdicts and 0 crashes in >= 500 worlds at a load >= 4x the cores.

    python ci/bench_stress.py [--worlds 500] [--load 4] [--batch 50] [--budget 540]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the programs (run in a worker process) ---------------------------------------------------
def _pipeline(rank, kind):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    torch.manual_seed(0)
    world = dist.get_world_size()
    per = 2 if kind == "Interleaved1F1B" else 1
    n = world * per
    layers = [nn.Linear(8, 8) for _ in range(n)]
    stages = [PipelineStage(layers[rank + world * k], rank + world * k, n, torch.device("cpu"))
              for k in range(per)]
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}[kind]
    sched = cls(stages if per > 1 else stages[0], n_microbatches=4,
                loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    losses: list = []
    if rank == 0:
        sched.step(x, target=y, losses=losses)
    elif rank == world - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return len(losses)


def _ddp(rank):
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)),
                bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    return float(next(model.parameters()).sum())


_QUEUE = None


def _python_waits(rank):
    import queue
    import threading
    import time as _time
    import torch.distributed as dist
    global _QUEUE
    if rank == 0:
        _QUEUE = queue.Queue()
    dist.barrier()
    if rank == 0:
        _QUEUE.put(41)
        done = threading.Event()
        threading.Thread(target=lambda: (_time.sleep(0.01), done.set())).start()
        done.wait()
        dist.barrier()
        return None
    item = _QUEUE.get()
    _time.sleep(0.01)
    dist.barrier()
    return item + 1


def _ending_ranks(rank):
    import threading
    import time as _time
    if rank == 0:  # the others end while the scheduler samples their CPU clocks
        done = threading.Event()
        threading.Thread(target=lambda: (_time.sleep(0.004), done.set())).start()
        done.wait()
    return rank


def _subprocess(rank):
    import subprocess as _sp
    import torch.distributed as dist
    if rank == 0:
        _sp.run([sys.executable, "-c", "import time; time.sleep(0.05)"], check=True)
    dist.barrier()
    return rank


def _programs():
    progs = [(f"pipeline {k}", _pipeline, (k,), 2) for k in ("GPipe", "1F1B", "Interleaved1F1B")]
    progs += [("ddp", _ddp, (), 2), ("python waits", _python_waits, (), 2),
              ("ending ranks", _ending_ranks, (), 8), ("subprocess", _subprocess, (), 2)]
    return progs


def _worker(n: int, start: int) -> dict:
    """Run ``n`` worlds (program and mode by index); count outcomes."""
    import fakepg
    counts = {"worlds": 0, "false_hangs": 0, "failures": 0, "examples": []}
    progs = _programs()
    for i in range(start, start + n):
        name, fn, args, nprocs = progs[i % len(progs)]
        isolation = "process" if (i // len(progs)) % 3 == 2 else "thread"  # a third as processes
        if name in ("ending ranks", "python waits", "subprocess") and isolation == "process":
            isolation = "thread"  # their point is thread mode's scheduler
        try:
            fakepg.spawn(fn, args=args, nprocs=nprocs, isolation=isolation, timeout=120)
        except (fakepg.CollectiveHangError, fakepg.SpawnTimeoutError) as e:
            counts["false_hangs"] += 1
            counts["examples"].append(f"{name} [{isolation}]: {type(e).__name__}: {str(e)[:300]}")
        except Exception as e:  # noqa: BLE001 - counted and shown
            counts["failures"] += 1
            counts["examples"].append(f"{name} [{isolation}]: {type(e).__name__}: {str(e)[:300]}")
        counts["worlds"] += 1
    return counts


# -- the driver -------------------------------------------------------------------------------
def _hog() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, default=500)
    ap.add_argument("--load", type=float, default=4.0, help="CPU hogs per core")
    ap.add_argument("--batch", type=int, default=50, help="worlds per worker process")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; stop starting batches after")
    ap.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return 0
    cores = os.cpu_count() or 1
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(int(args.load * cores))]
    for h in hogs:
        h.start()
    t0 = time.monotonic()
    total = {"worlds": 0, "false_hangs": 0, "failures": 0, "crashes": 0}
    examples: list[str] = []
    loads: list[float] = []
    try:
        start = 0
        while total["worlds"] < args.worlds and time.monotonic() - t0 < args.budget:
            n = min(args.batch, args.worlds - total["worlds"])
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n),
                                   str(start)], capture_output=True, text=True, cwd=_ROOT,
                                  env={**os.environ, "PYTHONPATH": _ROOT})
            loads.append(os.getloadavg()[0])
            start += n
            if proc.returncode != 0:
                total["crashes"] += 1
                examples.append(f"worker exit status {proc.returncode}: {proc.stderr[-500:]}")
                continue
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            for k in ("worlds", "false_hangs", "failures"):
                total[k] += got[k]
            examples += got["examples"]
    finally:
        for h in hogs:
            h.kill()
    wall = time.monotonic() - t0
    print(f"cores {cores}, CPU hogs {len(hogs)} ({args.load:g} per core); 1-minute load average "
          f"during the run: min {min(loads, default=0):.1f}, max {max(loads, default=0):.1f} "
          f"({max(loads, default=0) / cores:.1f}x the cores)")
    print(f"worlds {total['worlds']} in {wall:.0f} s; false hang verdicts {total['false_hangs']}; "
          f"other failures {total['failures']}; crashed workers {total['crashes']}")
    for e in examples[:10]:
        print("  " + e.replace("\n", " | "))
    ok = total["false_hangs"] == 0 and total["crashes"] == 0 and total["failures"] == 0
    print("target (0 false hangs, 0 crashes, >= 500 worlds):",
          "met" if ok and total["worlds"] >= 500 else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
