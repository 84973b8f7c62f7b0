"""Stress benchmark: fake worlds under a machine loaded far past its cores -- no false hang
verdict, no crash.

Programs that must end normally run as fake worlds while CPU hogs hold the 1-minute load
average above a bar of ``--load`` x the core count (``--hogs``, default the bar plus 2, so
the hogs alone keep it there; the run starts once the load has reached the bar): torch's
pipelining schedules (GPipe, 1F1B, Interleaved1F1B on 2 ranks; 1F1B and Interleaved1F1B on 4)
and DDP training, in thread and in process mode; Python waits handed between ranks (thread
mode) and on a rank's own thread; a rank waiting on its subprocess and, in C, on a child that
computes (``os.system``), each with a collective in flight; ranks that end while the
scheduler samples their clocks; a rank process stopped by SIGSTOP for a moment; a proxy
reducing a large tensor while its process waits for the reply. Each world reads the load as
it starts; only those started at or above the bar count toward ``--worlds``. With
``--suite-every N`` (or ``--suite-only``), the suite's hang-free tests (``SUITE``: the
process-mode tests among them) also run under pytest and every world they start counts; a
test failing with a hang or timeout error is a false verdict. Each batch runs in its own
worker process, so that a crash (SIGSEGV) is counted instead of ending the benchmark.

Printed: the hogs and the warm-up, the load as program worlds started (min, median, max),
program worlds per kind (at the bar / all, false hang verdicts, other failures), the suite's
tests and worlds, crashed and hung workers, the wall. Target (issue 27): 0 false hang
verdicts and 0 crashes in >= 500 worlds at a load >= 4x the cores. Measured on the 2-core
build machine (shared with other jobs), 2026-11-28; docs/threads-and-waits.md, "The
inactivity fallback on a loaded machine":

    08:36-08:51 UTC, --load 4 (10 hogs, bar 8): 500 program worlds, all 500 started at a
    1-minute load of 10.4-23.3 (median 17.3); 260 in process mode; every kind 21-22 times:
    0 false hang verdicts, 0 other failures, 0 crashes, 0 hung; wall 873 s.
    08:53-09:18 UTC, --suite-only: hung in test_ctrl_c_during_a_process_world_ends_every_
    rank_process[sleeping] (the lost interrupt_main; 15 tests, 20 worlds before it passed).
    09:19-09:26 UTC, --suite-only with that test deselected: 110 tests, 427 worlds (52 in
    process mode), all at a 1-minute load of 11.6-13.7: 0 false verdicts, 0 failures, 0
    crashes, 0 hung; wall 419 s.

    python ci/bench_stress.py [--worlds 500] [--load 4] [--hogs N] [--batch 50]
                              [--suite-every N | --suite-only] [--suite-deselect NODEID]
                              [--budget 2700]
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
    return float(next(model.parameters()).detach().sum())


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


def _own_thread_waits(rank):
    import queue
    import threading
    import time as _time
    import torch
    import torch.distributed as dist
    work = dist.all_reduce(torch.ones(2), async_op=True)  # in flight while the rank waits
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: (_time.sleep(0.01), q.put(41))).start()
    item = q.get()
    work.wait()
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
    import torch
    import torch.distributed as dist
    work = dist.all_reduce(torch.ones(2), async_op=True)  # in flight while rank 0 waits
    if rank == 0:
        _sp.run(["sleep", "0.05"], check=True)
    work.wait()
    dist.barrier()
    return rank


def _child_computes(rank):
    import torch
    import torch.distributed as dist
    work = dist.all_reduce(torch.ones(2), async_op=True)
    status = 0
    if rank == 0:  # waits in C (waitpid) while its child burns CPU
        status = os.system(f"{sys.executable} -c 'import time\nwhile time.process_time() < 0.05: pass'")
    work.wait()
    return status


def _stopped(rank):
    import signal
    import subprocess as _sp
    import torch
    import torch.distributed as dist
    work = dist.all_reduce(torch.ones(2), async_op=True)
    if rank == 0:  # a rank process stopped (state T) for a moment: slow, not blocked
        waker = _sp.Popen(["sh", "-c", f"sleep 0.2; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        waker.wait()
    work.wait()
    return rank


def _large_reduce(rank):
    import torch
    import torch.distributed as dist
    big = torch.ones(2_000_000)  # the last rank's proxy reduces while its process waits
    if rank == 1:
        sent = dist.isend(torch.ones(2), 0)
    dist.all_reduce(big)
    if rank == 0:
        dist.recv(torch.empty(2), 1)
    else:
        sent.wait()
    return float(big[0])


_BOTH, _THREAD, _PROCESS = ("thread", "process"), ("thread",), ("process",)


def _programs():
    """(name, function, args, ranks, the modes it runs in)."""
    progs = [(f"pipeline {k}", _pipeline, (k,), 2, _BOTH) for k in ("GPipe", "1F1B", "Interleaved1F1B")]
    progs += [(f"pipeline {k} x4", _pipeline, (k,), 4, _BOTH) for k in ("1F1B", "Interleaved1F1B")]
    progs += [("ddp", _ddp, (), 2, _BOTH),
              ("python waits across ranks", _python_waits, (), 2, _THREAD),  # a shared queue
              ("own thread waits", _own_thread_waits, (), 2, _BOTH),
              ("ending ranks", _ending_ranks, (), 8, _BOTH),
              ("subprocess", _subprocess, (), 2, _BOTH),
              ("child computes", _child_computes, (), 2, _BOTH),
              ("stopped rank process", _stopped, (), 2, _PROCESS),
              ("large reduce", _large_reduce, (), 2, _PROCESS)]
    return [(name, fn, args, n, mode) for name, fn, args, n, modes in progs for mode in modes]


def _worker(n: int, start: int) -> dict:
    """Run ``n`` worlds (program and mode by index); count outcomes, each world with the
    1-minute load average read as it starts."""
    import fakepg
    counts: dict = {"worlds": [], "false_hangs": 0, "failures": 0, "examples": []}
    progs = _programs()
    for i in range(start, start + n):
        name, fn, args, nprocs, isolation = progs[i % len(progs)]
        load = os.getloadavg()[0]
        outcome = "ok"
        try:
            fakepg.spawn(fn, args=args, nprocs=nprocs, isolation=isolation, timeout=120)
        except (fakepg.CollectiveHangError, fakepg.SpawnTimeoutError) as e:
            outcome = "false_hang"
            counts["false_hangs"] += 1
            counts["examples"].append(f"{name} [{isolation}] at load {load:.1f}: "
                                      f"{type(e).__name__}: {str(e)[:1500]}")
        except Exception as e:  # noqa: BLE001 - counted and shown
            outcome = "failure"
            counts["failures"] += 1
            counts["examples"].append(f"{name} [{isolation}] at load {load:.1f}: "
                                      f"{type(e).__name__}: {str(e)[:1500]}")
        counts["worlds"].append([f"{name} [{isolation}]", round(load, 2), outcome])
        print("world " + json.dumps(counts["worlds"][-1]), file=_ERR[0], flush=True)
    return counts


# The suite's tests whose worlds must end normally or with the verdict the test expects (the
# process-mode tests among them): each world they start counts; a test failing with a hang or
# timeout error is a false verdict.
SUITE = ["tests/test_process_mode.py", "tests/test_process_liveness.py", "tests/test_spawn.py",
         "tests/test_ddp_on_fake_cluster.py", "tests/test_per_rank_globals.py",
         "tests/test_python_waits.py", "tests/test_rank_failures.py"]


_ERR = [sys.stderr]  # the worker's real stderr (pytest captures fd 2 while a test runs)


class _SuiteCounter:
    """pytest plugin: counts the worlds the tests start and classifies failed tests."""

    def __init__(self) -> None:
        import fakepg.launch.spawn as spawn_module
        self.counts = {"worlds": 0, "process_worlds": 0, "tests": 0, "false_hangs": 0,
                       "failures": 0, "examples": [], "loads": []}
        original = spawn_module._run_world

        def counting(*a, **k):
            self.counts["worlds"] += 1
            self.counts["loads"].append(round(os.getloadavg()[0], 2))  # as the world starts
            isolation = k.get("isolation", a[13] if len(a) > 13 else "thread")
            self.counts["process_worlds"] += isolation == "process"
            return original(*a, **k)

        spawn_module._run_world = counting

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        print(f"running {nodeid}", file=_ERR[0], flush=True)  # the last one names a hung test

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "teardown":  # the counts so far, should the worker hang later
            print("counts " + json.dumps({k: v for k, v in self.counts.items() if k != "examples"}),
                  file=_ERR[0], flush=True)
        if report.when == "call":
            self.counts["tests"] += 1
        if not report.failed:
            return
        text = str(report.longrepr)
        hang = any(w in text for w in ("CollectiveHangError", "SpawnTimeoutError", "hang detected"))
        self.counts["false_hangs" if hang else "failures"] += 1
        self.counts["examples"].append(f"{report.nodeid} ({report.when}): {text[-1500:]}")


def _suite_worker(deselect: list[str]) -> dict:
    import pytest
    counter = _SuiteCounter()
    pytest.main([*SUITE, "-q", "-m", "not slow", "-p", "no:cacheprovider", "--no-header",
                 "-W", "ignore", *(f"--deselect={d}" for d in deselect)], plugins=[counter])
    return counter.counts


# -- the driver -------------------------------------------------------------------------------
def _hog() -> None:
    while True:
        pass


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, default=500,
                    help="program worlds to run at or above the load bar")
    ap.add_argument("--load", type=float, default=4.0,
                    help="the load bar, x the cores: only program worlds started while the "
                         "1-minute load average was at or above it count")
    ap.add_argument("--hogs", type=int, default=None,
                    help="CPU hogs (default: the bar rounded up, plus 2, so that the hogs "
                         "alone hold the load above it)")
    ap.add_argument("--warmup", type=float, default=300.0,
                    help="seconds to wait for the load to reach the bar before the first world")
    ap.add_argument("--batch", type=int, default=50, help="worlds per worker process")
    ap.add_argument("--suite-every", type=int, default=0,
                    help="run the suite's tests (SUITE) after every N program batches; 0: never")
    ap.add_argument("--budget", type=float, default=2700.0,
                    help="seconds; stop starting batches after")
    ap.add_argument("--suite-only", action="store_true", help="run only the suite's tests")
    ap.add_argument("--worker-timeout", type=float, default=900.0,
                    help="seconds a worker may take; past it its threads' stacks are dumped and "
                         "it counts as hung (a wait that got no verdict)")
    ap.add_argument("--suite-deselect", action="append", default=[], metavar="NODEID",
                    help="leave this suite test out (repeatable): one known to hang")
    ap.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--suite-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker or args.suite_worker:
        import faulthandler
        _ERR[0] = os.fdopen(os.dup(2), "w", buffering=1)  # stderr past pytest's capture of fd 2
        faulthandler.dump_traceback_later(args.worker_timeout, exit=True, file=_ERR[0])  # a hung worker says where
        counts = _suite_worker(args.suite_deselect) if args.suite_worker else _worker(*args.worker)
        print("\n" + json.dumps(counts))
        return 0
    cores = os.cpu_count() or 1
    bar = args.load * cores
    n_hogs = args.hogs if args.hogs is not None else int(-(-bar // 1)) + 2
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(n_hogs)]
    t0 = time.monotonic()
    for h in hogs:
        h.start()
    while os.getloadavg()[0] < bar and time.monotonic() - t0 < args.warmup:
        time.sleep(1.0)
    warm = time.monotonic() - t0
    print(f"cores {cores}, CPU hogs {n_hogs}; load bar {bar:g} ({args.load:g}x the cores); "
          f"warm-up {warm:.0f} s (1-minute load {os.getloadavg()[0]:.1f})", flush=True)
    keys = ("worlds", "process_worlds", "false_hangs", "failures")
    worlds: list[list] = []  # [kind, load as it started, outcome] per program world
    suite = {**{k: 0 for k in keys}, "tests": 0, "runs": 0}
    suite_loads: list[float] = []  # the 1-minute load as each suite world started
    crashes = hung = 0
    examples: list[str] = []
    loads: list[float] = []  # the 1-minute load after each batch (suite runs included)

    def counted() -> int:
        return sum(1 for _, load, _o in worlds if load >= bar)

    try:
        start = batches = 0
        while counted() < args.worlds and time.monotonic() - t0 < args.budget:
            run_suite = args.suite_only or (args.suite_every > 0 and
                                             batches % (args.suite_every + 1) == args.suite_every)
            batches += 1
            if run_suite:
                cmd = ["--suite-worker", *(f"--suite-deselect={d}" for d in args.suite_deselect)]
            else:
                cmd = ["--worker", str(args.batch), str(start)]
                start += args.batch
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *cmd,
                                   "--worker-timeout", str(args.worker_timeout)],
                                  capture_output=True, text=True, cwd=_ROOT,
                                  env={**os.environ, "PYTHONPATH": _ROOT})
            loads.append(os.getloadavg()[0])
            err = proc.stderr
            if not run_suite:  # every world that ended, even in a worker that crashed later
                worlds += [json.loads(ln[len("world "):]) for ln in err.splitlines()
                           if ln.startswith("world ")]
            if proc.returncode != 0:
                hung_here = "Timeout (" in err  # faulthandler's dump_traceback_later
                hung += hung_here
                crashes += not hung_here
                last = [ln for ln in err.splitlines() if ln.startswith("running ")][-1:]
                partial = [ln for ln in err.splitlines() if ln.startswith("counts ")][-1:]
                if run_suite and partial:  # the tests that ended before it hung count
                    got = json.loads(partial[0][len("counts "):])
                    for k in keys + ("tests",):
                        suite[k] += got[k]
                    suite_loads += got["loads"]
                examples.append(f"{'suite' if run_suite else 'program'} worker "
                                f"{'hung' if hung_here else 'exit status ' + str(proc.returncode)}"
                                f" {' '.join(last)}: {err[-3000:]}")
            else:
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                if run_suite:
                    for k in keys + ("tests",):
                        suite[k] += got[k]
                    suite_loads += got["loads"]
                    suite["runs"] += 1
                examples += got["examples"]
            print(f"  {time.monotonic() - t0:5.0f} s: {len(worlds)} program worlds "
                  f"({counted()} at the bar), suite worlds {suite['worlds']}; load "
                  f"{loads[-1]:.1f}; crashed {crashes}, hung {hung}", flush=True)
            if args.suite_only:  # one run of the suite's tests
                break
    finally:
        for h in hogs:
            h.kill()
    wall = time.monotonic() - t0
    at_bar = [w for w in worlds if w[1] >= bar]
    world_loads = [w[1] for w in worlds]
    false_hangs = sum(w[2] == "false_hang" for w in worlds) + suite["false_hangs"]
    failures = sum(w[2] == "failure" for w in worlds) + suite["failures"]
    if worlds:
        print(f"1-minute load average as program worlds started: min {min(world_loads, default=0):.1f}, "
              f"median {_median(world_loads):.1f}, max {max(world_loads, default=0):.1f} "
              f"(bar {bar:g}); after each batch: min {min(loads, default=0):.1f}, "
              f"max {max(loads, default=0):.1f}")
        print(f"program worlds {len(worlds)}, {len(at_bar)} of them at load >= {bar:g} "
              f"({sum(w[0].endswith('[process]') for w in at_bar)} in process mode); per kind "
              f"(at the bar / all, false hang verdicts, other failures):")
        for kind in dict.fromkeys(w[0] for w in worlds):
            mine = [w for w in worlds if w[0] == kind]
            print(f"  {kind:<42} {sum(w[1] >= bar for w in mine):4d} / {len(mine):4d}  "
                  f"{sum(w[2] == 'false_hang' for w in mine)}  {sum(w[2] == 'failure' for w in mine)}")
    if suite["runs"] or suite["worlds"]:
        print(f"suite: {suite['runs']} runs, {suite['tests']} tests, {suite['worlds']} worlds "
              f"({suite['process_worlds']} in process mode, {sum(x >= bar for x in suite_loads)} "
              f"at load >= {bar:g}); load as they started: min {min(suite_loads, default=0):.1f}, "
              f"median {_median(suite_loads):.1f}, max {max(suite_loads, default=0):.1f}")
    print(f"wall {wall:.0f} s; false hang verdicts {false_hangs}; other failures {failures}; "
          f"crashed workers {crashes}; hung workers {hung}")
    for e in examples[:10]:
        print("  " + e.replace("\n", " | "))
    ok = false_hangs == 0 and crashes == 0 and failures == 0 and hung == 0
    what, n = (("suite worlds", sum(x >= bar for x in suite_loads)) if args.suite_only
               else ("program worlds", len(at_bar)))
    print(f"target (0 false hangs, 0 crashes, 0 hangs, >= {args.worlds} {what} at load "
          f">= {bar:g}):", "met" if ok and n >= args.worlds else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
