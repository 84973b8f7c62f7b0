"""nccl-tests-style measurement of collectives on the backend at hand (gloo on CPU, NCCL where
GPUs are present): one process per rank, warm-up, then the median of ``reps`` timed calls per
op × size × world size. Behind ``simddp calibrate``; the rows feed :meth:`Network.calibrate`.

Times follow nccl-tests: each rank times the call between two barriers; the row keeps the
slowest rank's median. ``bytes`` follows :class:`simddp.Network`'s convention.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Sequence

__all__ = ["measure"]

_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _worker(rank: int, world: int, store_path: str, out_dir: str, backend: str,
            ops: Sequence[str], sizes: Sequence[int], reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    rows = []
    try:
        for op in ops:
            for nbytes in sizes:
                n = max(1, nbytes // 4)
                x = torch.ones(n * (world if op == "reduce_scatter" else 1), device=device)
                chunk = torch.empty(n, device=device)
                full = torch.empty(n * world, device=device)

                def call() -> None:
                    if op == "all_reduce":
                        dist.all_reduce(x)
                    elif op == "all_gather":
                        dist.all_gather_into_tensor(full, chunk)
                    elif op == "reduce_scatter":
                        dist.reduce_scatter_tensor(chunk, x)
                    else:
                        dist.broadcast(x, 0)

                for _ in range(2):
                    call()
                times = []
                for _ in range(reps):
                    dist.barrier()
                    if backend == "nccl":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    call()
                    if backend == "nccl":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                counted = n * 4 * (world if op in ("all_gather", "reduce_scatter") else 1)
                rows.append({"op": op, "world_size": world, "bytes": counted,
                             "seconds": statistics.median(times)})
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def measure(*, world_sizes: Sequence[int] = (2,), sizes: Sequence[int] = (1 << 10, 1 << 20),
            ops: Sequence[str] = ("all_reduce",), reps: int = 5,
            backend: str | None = None) -> list[dict[str, Any]]:
    """Rows ``{op, world_size, bytes, seconds, backend}``: the slowest rank's median time.
    ``backend``: "gloo" or "nccl" (None: NCCL with enough GPUs, else gloo)."""
    import torch
    import torch.multiprocessing as mp

    for op in ops:
        if op not in _OPS:
            raise ValueError(f"measure: op {op!r} is not one of {', '.join(_OPS)}")
    if backend is None:
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= max(world_sizes)
        backend = "nccl" if enough else "gloo"
    out: list[dict[str, Any]] = []
    for world in world_sizes:
        tmp = tempfile.mkdtemp(prefix="simddp-measure-")
        try:
            for attempt in range(3):
                try:
                    mp.start_processes(_worker, args=(world, os.path.join(tmp, f"store{attempt}"),
                                                      tmp, backend, list(ops), list(sizes), reps),
                                       nprocs=world, join=True, start_method="spawn")
                    break
                except mp.ProcessExitedException as e:
                    # real gloo sometimes aborts a process as it tears down ("terminate called
                    # without an active exception"): measure again
                    if e.signal_name != "SIGABRT" or attempt == 2:
                        raise
            per_rank = []
            for r in range(world):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    per_rank.append(json.load(f))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for rows in zip(*per_rank):
            out.append({**rows[0], "seconds": max(x["seconds"] for x in rows),
                        "backend": backend})
    return out
