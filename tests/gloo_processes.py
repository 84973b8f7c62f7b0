"""The reference a fake world is compared with: a function run on real multi-process gloo."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist


def _rank(rank: int, nprocs: int, fn: Callable[..., Any], args: tuple, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=nprocs)
    try:
        result = fn(rank, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def gloo_results(fn: Callable[..., Any], nprocs: int, tmp_path: Any, args: tuple = ()) -> list[Any]:
    """``fn(rank, *args)`` on ``nprocs`` real gloo processes (spawned; ``fn`` must pickle), after
    ``init_process_group("gloo")``; their return values, by rank.

    Real gloo sometimes aborts a process as it tears down, after the work ("terminate called
    without an active exception", SIGABRT): that is the reference failing, so it runs again.
    """
    import torch.multiprocessing as mp

    for attempt in range(3):
        out = tempfile.mkdtemp(dir=tmp_path)
        try:
            mp.start_processes(_rank, args=(nprocs, fn, args, os.path.join(out, "init"), out),
                               nprocs=nprocs, start_method="spawn")
            return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
                    for r in range(nprocs)]
        except mp.ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
    raise AssertionError("unreachable")
