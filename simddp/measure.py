"""nccl-tests-style measurement of collectives on the backend at hand (gloo on CPU, NCCL where
GPUs are present): one process per rank, warm-up, then the median of ``reps`` timed calls per
op × size × world size. Behind ``simddp calibrate``; the rows feed :meth:`Network.calibrate`.

Times follow nccl-tests: each rank times the call between two barriers; the row keeps the
slowest rank's median. ``bytes`` follows :class:`simddp.Network`'s convention.

:func:`measure_contention` (``simddp calibrate``'s second step on gloo) measures what the
α–β table cannot: how much a rank's compute slows while its own gloo all_reduce is in flight
(gloo's reduction and TCP copies run on CPU threads of the same process), and what issuing a
collective costs the calling thread — a :class:`simddp.models.Contention`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Sequence

__all__ = ["measure", "measure_contention", "contention_of"]

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

    for op in ops:
        if op not in _OPS:
            raise ValueError(f"measure: op {op!r} is not one of {', '.join(_OPS)}")
    if backend is None:
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= max(world_sizes)
        backend = "nccl" if enough else "gloo"
    out: list[dict[str, Any]] = []
    for world in world_sizes:
        per_rank = _run_ranks(_worker, world, "rank", lambda store, tmp: (
            world, store, tmp, backend, list(ops), list(sizes), reps))
        for rows in zip(*per_rank):
            out.append({**rows[0], "seconds": max(x["seconds"] for x in rows),
                        "backend": backend})
    return out


def _contention_worker(rank: int, world: int, store_path: str, out_dir: str, comm_bytes: int,
                       reps: int, kernel_n: int, min_window_ms: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    a, b = torch.randn(kernel_n, kernel_n), torch.randn(kernel_n, kernel_n)
    x = torch.ones(max(1, comm_bytes // 4))
    clock = time.perf_counter
    alone, overlapped, issue, comm_alone, comm_overlapped = [], [], [], [], []
    try:
        for _ in range(3):  # warm-up: the kernel, the connection, the buffers
            torch.mm(a, b)
            dist.all_reduce(x)
        for _ in range(reps):
            # the collective alone
            dist.barrier()
            t = clock()
            dist.all_reduce(x)
            window = clock() - t
            comm_alone.append(window)
            # the kernel with every rank computing (the cores shared as in training) and no
            # communication, for as long as the collective took: windows of milliseconds, so
            # the OS's time slices show in the mean as they do in training
            dist.barrier()
            t_end = clock() + max(window, min_window_ms * 1e-3)
            while True:
                t = clock()
                torch.mm(a, b)
                alone.append(clock() - t)
                if t > t_end:
                    break
            # the kernel while the collective runs: only kernels that ended before it did
            dist.barrier()
            t0 = clock()
            work = dist.all_reduce(x, async_op=True)
            issue.append(clock() - t0)
            while True:
                t = clock()
                torch.mm(a, b)
                dt = clock() - t
                if work.is_completed():  # this kernel may have outlived it: not counted
                    break
                overlapped.append(dt)
            comm_overlapped.append(clock() - t0)
            work.wait()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"contention{rank}.json"), "w") as f:
        json.dump({"alone": alone, "overlapped": overlapped, "issue": issue,
                   "comm_alone": comm_alone, "comm_overlapped": comm_overlapped}, f)


def measure_contention(*, world_sizes: Sequence[int] = (2,), comm_bytes: int = 8 << 20,
                       reps: int = 5, kernel_n: int = 128, min_window_ms: float = 20.0
                       ) -> list[dict[str, Any]]:
    """Per world size, on real gloo processes (one intra-op thread each): a ``kernel_n``²
    matmul's mean time with every rank computing and no communication (for as long as the
    all_reduce takes alone, at least ``min_window_ms``), and while a ``comm_bytes`` all_reduce
    between the same processes is in flight (kernels that outlived it are dropped); their ratio
    is ``slowdown``. Means, not medians: the OS takes a core away for whole time slices, which
    a median of µs-kernels never sees. ``per_collective_us``: the median time the async
    all_reduce call takes on the calling thread. ``comm_slowdown`` (reported, not modelled):
    the all_reduce's time while the rank computes over its time alone.

    Rows ``{world_size, backend, slowdown, per_collective_us, comm_slowdown, ...}``;
    :func:`contention_of` makes the calibrate file's ``"contention"`` entry of them.
    """
    out: list[dict[str, Any]] = []
    for world in world_sizes:
        per_rank = _run_ranks(_contention_worker, world, "contention", lambda store, tmp: (
            world, store, tmp, comm_bytes, reps, kernel_n, min_window_ms))
        pooled = {k: [v for d in per_rank for v in d[k]] for k in per_rank[0]}
        if not pooled["overlapped"]:
            raise RuntimeError(f"measure_contention: at {world} ranks no kernel ran while a "
                               f"{comm_bytes}-byte all_reduce was in flight; use a larger "
                               f"comm_bytes or a smaller kernel_n")
        alone = sum(pooled["alone"]) / len(pooled["alone"])
        over = sum(pooled["overlapped"]) / len(pooled["overlapped"])
        c_alone = statistics.median(pooled["comm_alone"])
        c_over = statistics.median(pooled["comm_overlapped"])
        out.append({"world_size": world, "backend": "gloo", "bytes": comm_bytes,
                    "kernel": f"mm {kernel_n}x{kernel_n}", "slowdown": max(1.0, over / alone),
                    "per_collective_us": statistics.median(pooled["issue"]) * 1e6,
                    "comm_slowdown": c_over / c_alone, "compute_alone_s": alone,
                    "compute_overlapped_s": over, "comm_alone_s": c_alone,
                    "comm_overlapped_s": c_over, "overlapped_kernels": len(pooled["overlapped"])})
    return out


def contention_of(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``"contention"`` entry of a calibrate file: the median over world sizes of
    :func:`measure_contention`'s rows (:meth:`~simddp.models.Contention.from_dict` reads it),
    the rows kept under ``"measurements"``."""
    return {"slowdown": statistics.median(r["slowdown"] for r in rows),
            "per_collective_us": statistics.median(r["per_collective_us"] for r in rows),
            "source": "simddp calibrate: gloo, a matmul alone vs beside an all_reduce, "
                      f"world sizes {', '.join(str(r['world_size']) for r in rows)}",
            "measurements": list(rows)}


def _run_ranks(worker: Any, world: int, result: str, args: Any) -> list[Any]:
    """``worker(rank, *args(store_path, out_dir))`` on ``world`` real processes (spawned);
    the JSON each rank wrote to ``out_dir/{result}{rank}.json``, by rank. Real gloo sometimes
    aborts a process as it tears down ("terminate called without an active exception",
    SIGABRT): that run is measured again, twice at most."""
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="simddp-measure-")
    try:
        for attempt in range(3):
            try:
                mp.start_processes(worker, args=args(os.path.join(tmp, f"store{attempt}"), tmp),
                                   nprocs=world, join=True, start_method="spawn")
                break
            except mp.ProcessExitedException as e:
                if e.signal_name != "SIGABRT" or attempt == 2:
                    raise
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"{result}{r}.json")) as f:
                per_rank.append(json.load(f))
        return per_rank
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
