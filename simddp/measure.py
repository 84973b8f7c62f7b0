"""nccl-tests-style measurement of collectives on the backend at hand (gloo on CPU, NCCL where
GPUs are present): one process per rank, warm-up, then the median of ``reps`` timed calls per
op × size × world size, in rounds repeated until the points are stable. Behind
``simddp calibrate``; the rows feed :class:`~simddp.models.MeasuredNetwork` and
:meth:`Network.calibrate`.

Times follow nccl-tests: each rank times the call between two barriers; the row keeps the
slowest rank's median. ``bytes`` follows :class:`simddp.Network`'s convention. The table is
made monotone in message size (:func:`monotone`: a smaller message never takes longer).

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

__all__ = ["measure", "measure_contention", "contention_of", "monotone", "default_sizes",
           "largest_bucket_bytes"]

_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _worker(rank: int, world: int, store_path: str, out_dir: str, backend: str,
            ops: Sequence[str], sizes: Sequence[int], reps: int, min_rounds: int,
            max_rounds: int, tolerance: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    points = [(op, nbytes) for op in ops for nbytes in sizes]
    history: list[list[float]] = []  # per round: the slowest rank's median of each point
    try:
        while True:
            medians = [_time_point(dist, device, backend, world, op, nbytes, reps,
                                   warmup=2 if not history else 1)
                       for op, nbytes in points]
            # every rank takes the slowest rank's figure, so all decide alike when to stop
            t = torch.tensor(medians, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            history.append(t.tolist())
            if len(history) >= max_rounds or (
                    len(history) >= min_rounds
                    and max(_moved(h, min_rounds) for h in zip(*history)) <= tolerance):
                break
    finally:
        dist.destroy_process_group()
    rows = []
    for i, (op, nbytes) in enumerate(points):
        rounds = [h[i] for h in history]
        n = max(1, nbytes // 4)
        counted = n * 4 * (world if op in ("all_gather", "reduce_scatter") else 1)
        rows.append({"op": op, "world_size": world, "bytes": counted,
                     "seconds": statistics.median(rounds), "rounds": len(rounds),
                     "spread": _spread(rounds), "moved": _moved(rounds, min_rounds),
                     "round_seconds": rounds})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def _time_point(dist: Any, device: Any, backend: str, world: int, op: str, nbytes: int,
                reps: int, warmup: int) -> float:
    """The median of ``reps`` timed calls of ``op`` on ``nbytes``, each between barriers (the
    buffers allocated for this point only: a 400 MB bucket's three buffers would not fit
    beside every other size's)."""
    import torch

    n = max(1, nbytes // 4)
    if op == "all_gather":
        chunk, full = torch.empty(n, device=device), torch.empty(n * world, device=device)
        call = lambda: dist.all_gather_into_tensor(full, chunk)  # noqa: E731
    elif op == "reduce_scatter":
        x, chunk = torch.ones(n * world, device=device), torch.empty(n, device=device)
        call = lambda: dist.reduce_scatter_tensor(chunk, x)  # noqa: E731
    else:
        x = torch.ones(n, device=device)
        call = ((lambda: dist.all_reduce(x)) if op == "all_reduce"
                else (lambda: dist.broadcast(x, 0)))
    for _ in range(warmup):
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
    return statistics.median(times)


def _spread(values: Sequence[float]) -> float:
    """The interquartile range over the median: how far apart one point's rounds lie (the
    middle half of them; 0 for a single round)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def _moved(values: Sequence[float], window: int) -> float:
    """How far the estimate (the median over rounds) moved while the last ``window`` rounds
    came in: (max − min) of the medians of the first k rounds, k = n − window + 1 … n, over
    the median of all n. Small = one more round would not change the table.

    >>> round(_moved([1.0, 5.0, 1.0, 1.1, 1.0], 3), 6)   # one disturbed round: the median holds
    0.05
    """
    n = len(values)
    medians = [statistics.median(values[:k]) for k in range(max(1, n - window + 1), n + 1)]
    return (max(medians) - min(medians)) / statistics.median(values)


def monotone(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each (op, world size)'s times made non-decreasing in message size: a point
    slower than a larger message's is lowered to that time (the minimum over it and every
    larger size), its measured time kept as ``measured_seconds``.

    Why the minimum from above, not an average: a message of S bytes can always be sent as a
    larger one, so it never takes longer than a larger message; and what disturbs a
    measurement on a shared machine (another process on the core, a page fault, the OS's time
    slice) only ever adds time. A point above a larger message's is therefore the disturbed
    one, and the larger message's time is the better estimate of it.

    >>> rows = [{"op": "all_reduce", "world_size": 2, "bytes": b, "seconds": s}
    ...         for b, s in [(4096, 1e-4), (65536, 3.8e-3), (1 << 20, 6e-4), (8 << 20, 4e-3)]]
    >>> [r["seconds"] for r in monotone(rows)]
    [0.0001, 0.0006, 0.0006, 0.004]
    """
    out = [dict(r) for r in rows]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in out:
        groups.setdefault((r["op"], r["world_size"]), []).append(r)
    for group in groups.values():
        lowest = float("inf")
        for r in sorted(group, key=lambda r: r["bytes"], reverse=True):
            if r["seconds"] > lowest:
                r["measured_seconds"], r["seconds"] = r["seconds"], lowest
            lowest = min(lowest, r["seconds"])
    return out


def default_sizes(max_bytes: int, min_bytes: int = 4 << 10) -> list[int]:
    """Message sizes for calibrate: powers of 4 from ``min_bytes`` up to ``max_bytes``, and
    ``max_bytes`` itself (the largest bucket the what-if replays needs a measured point, not an
    extrapolation).

    >>> [s >> 10 for s in default_sizes(32 << 20)]
    [4, 16, 64, 256, 1024, 4096, 16384, 32768]
    """
    if max_bytes < min_bytes:
        return [max_bytes]
    sizes = []
    s = min_bytes
    while s < max_bytes:
        sizes.append(s)
        s *= 4
    return sizes + [max_bytes]


def largest_bucket_bytes(model: Any, bucket_cap_mb: float | None = None) -> int:
    """Bytes of the largest gradient bucket DDP's steady state has for ``model`` with
    ``bucket_cap_mb`` (None: DDP's 25 MB): torch's own assignment
    (``torch.distributed._compute_bucket_assignment_by_size``) with the limits DDP's Reducer
    rebuilds its buckets with after the first iteration (``dist._DEFAULT_FIRST_BUCKET_BYTES``,
    then the cap), over the parameters in reverse registration order (DDP's approximation of
    the order gradients become ready). A parameter larger than the cap is a bucket of its own
    (VGG-16's 411 MB classifier weight). Works on the meta device (shapes only)."""
    from .compat import compute_bucket_assignment_by_size, default_first_bucket_bytes

    params = [p for p in model.parameters() if p.requires_grad][::-1]
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    buckets, _ = compute_bucket_assignment_by_size(
        params, [min(default_first_bucket_bytes(), cap), cap], [False] * len(params))
    return max(sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets)


def measure(*, world_sizes: Sequence[int] = (2,), sizes: Sequence[int] = (1 << 10, 1 << 20),
            ops: Sequence[str] = ("all_reduce",), reps: int = 5, backend: str | None = None,
            min_rounds: int = 3, max_rounds: int = 10, tolerance: float = 0.1
            ) -> list[dict[str, Any]]:
    """Rows ``{op, world_size, bytes, seconds, backend, rounds, spread, stable, ...}``.

    Each round times every point (op × size, interleaved, so a busy spell of the machine
    touches all of them) as the median of ``reps`` calls, the slowest rank's median counting.
    A point's estimate is the median over its rounds. Rounds repeat until every estimate held
    still (``moved``: it moved by at most ``tolerance``, relative, while the last
    ``min_rounds`` rounds came in), or ``max_rounds`` are done; ``stable`` says which, and
    ``spread`` (interquartile range / median of the rounds) how noisy the point is. The
    estimates are made monotone in size by :func:`monotone` (the median kept as
    ``measured_seconds`` where it was lowered).
    ``backend``: "gloo" or "nccl" (None: NCCL with enough GPUs, else gloo)."""
    import torch

    for op in ops:
        if op not in _OPS:
            raise ValueError(f"measure: op {op!r} is not one of {', '.join(_OPS)}")
    if not 1 <= min_rounds <= max_rounds:
        raise ValueError(f"measure: need 1 <= min_rounds <= max_rounds, got min_rounds="
                         f"{min_rounds}, max_rounds={max_rounds}")
    if not tolerance >= 0:
        raise ValueError(f"measure: tolerance must be >= 0 (a relative spread, e.g. 0.1), "
                         f"got {tolerance!r}")
    if backend is None:
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= max(world_sizes)
        backend = "nccl" if enough else "gloo"
    out: list[dict[str, Any]] = []
    for world in world_sizes:
        per_rank = _run_ranks(_worker, world, "rank", lambda store, tmp: (
            world, store, tmp, backend, list(ops), list(sizes), reps, min_rounds, max_rounds,
            tolerance))
        for row in per_rank[0]:  # every rank holds the same slowest-rank figures
            out.append({**row, "backend": backend, "stable": row["moved"] <= tolerance})
    return monotone(out)


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
