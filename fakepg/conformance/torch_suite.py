"""torch's own distributed test suite on the fake cluster, next to real gloo.

Runs the test methods of ``DistributedTest._DistTestBase``
(``torch.testing._internal.distributed.distributed_test``, shipped in torch's wheel: the suite
behind torch's ``test/distributed/test_distributed_spawn.py``) once on fakepg, as that file
declares the suite, through :mod:`fakepg.launch.suites` (torch's own ``TestDistBackend._run`` per rank,
torch's return-code rules; every rank a thread, or a process with ``--isolation process``), and
once on real multi-process gloo (forked processes running the same steps as
``TestDistBackend._run``), and prints one row per test with both outcomes. For any other
``MultiProcessTestCase`` suite in a test file, see :mod:`fakepg.conformance.suites`.

    python -m fakepg.conformance.torch_suite                       # every test, world size 2
    python -m fakepg.conformance.torch_suite -k allreduce -k ddp   # names with a pattern
    python -m fakepg.conformance.torch_suite --fake-only --world-size 3

Or from Python: ``run_fake(name, world_size, tmp)`` / ``run_gloo(...)`` after
``prepare(tmp, world_size)``. Needs ``expecttest`` (torch's test utilities import it).

Outcomes: ``pass``, ``skip`` (the test skipped itself: CUDA, world size, backend), ``fail``
(first line of the error), ``hang`` (fakepg's verdict) and ``timeout`` (``--timeout`` seconds of
wall clock). A row is marked ``!=`` where fakepg and gloo disagree.

One adaptation, in thread mode only: the suite's file barrier names each participant's file by
``os.getpid()``, which rank threads share; there it is keyed by rank instead (same files, same
polling). Process mode runs it unmodified.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

_SKIP_CODES: set[int] = set()


def prepare(tmp: str, world_size: int) -> None:
    # The suite reads these at import and in its helpers (as test_distributed_spawn.py sets them).
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(world_size), TEMP_DIR=tmp,
                      MASTER_ADDR="127.0.0.1")
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(tmp, sub), exist_ok=True)


def _suite_class():
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.distributed.distributed_test import (DistributedTest,
                                                                      TestDistBackend)

    _SKIP_CODES.update(s.exit_code for s in TEST_SKIPS.values())

    class Suite(TestDistBackend, DistributedTest._DistTestBase):
        pass

    return Suite


def test_names(patterns: list[str]) -> list[str]:
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    names = sorted(n for n in vars(DistributedTest._DistTestBase) if n.startswith("test_"))
    return [n for n in names if not patterns or any(p in n for p in patterns)]


def _rank_barrier():
    """The suite's Barrier.sync with the participant file keyed by rank, not by pid."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import distributed_test as dt

    ids: dict[int, int] = {}

    def sync(wait_for=None, timeout=10):
        rank = dist.get_rank()
        wait_for = dist.get_world_size() if wait_for is None else wait_for
        ids[rank] = ids.get(rank, 0) + 1
        folder = os.path.join(os.environ["TEMP_DIR"], "barrier")
        with dt._lock():
            with open(os.path.join(folder, f"rank{rank}"), "w") as f:
                f.write(str(ids[rank]))
        start = time.time()
        while True:
            with dt._lock():
                arrived = 0
                for name in os.listdir(folder):
                    with open(os.path.join(folder, name)) as f:
                        arrived += int(f.read()) >= ids[rank]
            if arrived == wait_for:
                return
            if time.time() - start > timeout:
                raise RuntimeError("barrier timeout")
            time.sleep(0.1)

    return sync


def run_rank(rank: int, test_name: str, init_file: str, out_dir: str) -> str:
    """One rank of one test on real gloo, as torch's TestDistBackend._run runs it; writes and
    returns the outcome."""
    import torch.distributed as dist
    from torch.testing._internal import common_utils

    suite = _suite_class()
    outcome = "pass"
    if getattr(getattr(suite, test_name), "__unittest_skip__", False):
        outcome = "skip"  # unittest skips it before any process starts
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(outcome)
        return outcome
    try:
        self = suite(test_name)
        self.rank, self.file_name = rank, init_file
        dist.init_process_group(init_method=self.init_method, backend="gloo",
                                world_size=int(self.world_size), rank=rank,
                                timeout=timedelta(seconds=60))
        self._barrier()
        common_utils.set_rng_seed()
        try:
            getattr(self, test_name)()
        except unittest.SkipTest:
            outcome = "skip"
        except SystemExit as e:
            if e.code not in _SKIP_CODES:
                raise
            outcome = "skip"
        self._barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported in the rank's outcome file
        outcome = "fail: " + _first_line(e)
        traceback.print_exc()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(outcome)
    return outcome


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:110]


def _gloo_rank(rank: int, test_name: str, init_file: str, out_dir: str) -> None:
    # The rank's output (C++ included) goes to its log file, not the table.
    with open(os.path.join(out_dir, f"log{rank}"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            run_rank(rank, test_name, init_file, out_dir)


def _combine(outcomes: list[str]) -> str:
    fails = [o for o in outcomes if o.startswith("fail")]
    if fails:
        return fails[0]
    return "skip" if "skip" in outcomes else "pass"


def run_fake(test_name: str, world_size: int, tmp: str, isolation: str, timeout: float) -> str:
    """One test on the fake cluster through :mod:`fakepg.launch.suites` (torch's own
    ``TestDistBackend`` with only its process start-up replaced); returns the outcome."""
    from torch.testing._internal.distributed import distributed_test as dt

    from ..launch.suites import on_fake_cluster

    class Spawned(_suite_class()):  # as torch's test_distributed_spawn.py declares it
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    on_fake_cluster(Spawned, isolation=isolation, timeout=timeout)
    os.environ["TEMP_DIR"] = tmp  # setUp makes a fresh one per test; put the caller's back
    saved = dt.Barrier.sync
    if isolation == "thread":
        dt.Barrier.sync = staticmethod(_rank_barrier())
    result = unittest.TestResult()
    try:
        Spawned(test_name).run(result)
    finally:
        dt.Barrier.sync = saved
        os.environ["TEMP_DIR"] = tmp
    if result.errors or result.failures:
        return "fail: " + _exception_line((result.errors + result.failures)[0][1])
    return "skip" if result.skipped else "pass"


def _exception_line(text: str) -> str:
    """The first line of the first rank's exception in the traceback of torch's verdict
    ("Process i exited with error code 10 and exception: ..."), else the verdict's own."""
    head, marker, rank_part = text.partition("exited with error code 10 and exception:")
    lines = (rank_part if marker else head).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = frames[0] if frames else 0
    for line in lines[after:]:
        if line and not line.startswith(" ") and not line.startswith("Traceback"):
            return line.strip()[:110]
    return (lines[-1] if lines else "").strip()[:110]


def run_gloo(test_name: str, world_size: int, tmp: str, timeout: float) -> str:
    import torch.multiprocessing as mp
    from torch.testing._internal.distributed.distributed_test import Barrier

    Barrier.init()
    init_file = tempfile.mktemp(dir=tmp, prefix="init")
    out_dir = tempfile.mkdtemp(dir=tmp, prefix="out")
    ctx = mp.start_processes(_gloo_rank, args=(test_name, init_file, out_dir), nprocs=world_size,
                             join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return "timeout"
    except Exception:  # a rank exited non-zero: its outcome file says why
        pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    outcomes = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}")
        outcomes.append(open(path).read() if os.path.exists(path) else "fail: rank died")
    return _combine(outcomes)


def reset_barrier(tmp: str) -> None:
    folder = os.path.join(tmp, "barrier")
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="run tests whose name contains this (repeatable)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--isolation", default="thread", choices=["thread", "process"])
    ap.add_argument("--fake-only", action="store_true", help="skip the real gloo runs")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per test and backend")
    args = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="torch-dist-suite-")
    prepare(tmp, args.world_size)
    names = test_names(args.patterns)
    print(f"{len(names)} tests of DistributedTest._DistTestBase, world size {args.world_size}, "
          f"fakepg isolation={args.isolation}" + ("" if args.fake_only else " vs real gloo"))
    counts: dict[tuple[str, str], int] = {}
    disagree = 0
    t_fake = t_gloo = 0.0
    for name in names:
        reset_barrier(tmp)
        t0 = time.perf_counter()
        fake = run_fake(name, args.world_size, tmp, args.isolation, args.timeout)
        t_fake += time.perf_counter() - t0
        gloo = ""
        if not args.fake_only:
            reset_barrier(tmp)
            t0 = time.perf_counter()
            gloo = run_gloo(name, args.world_size, tmp, args.timeout)
            t_gloo += time.perf_counter() - t0
        kf, kg = fake.split(":")[0], gloo.split(":")[0]
        counts[(kf, kg)] = counts.get((kf, kg), 0) + 1
        mark = "!=" if gloo and kf != kg else "  "
        disagree += mark == "!="
        print(f"{mark} {name:<62} fakepg: {fake:<10.60}" + (f"  gloo: {gloo:.60}" if gloo else ""),
              flush=True)
    print("\noutcome counts (fakepg, gloo):")
    for (kf, kg), n in sorted(counts.items()):
        print(f"  {kf:<8} {kg or '-':<8} {n}")
    print(f"disagreements: {disagree}; wall time fakepg {t_fake:.1f} s"
          + ("" if args.fake_only else f", gloo {t_gloo:.1f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
