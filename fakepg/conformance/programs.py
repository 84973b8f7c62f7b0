"""Programs the runner runs on each rank: ``train(scenario, rank, world_size, device) -> module``.

The default is the zoo's training loop, :class:`fakepg.zoo.TrainLoop` (DDP, the scenario's
optimizer, Join when batch counts differ). :class:`CollectiveTour` runs no DDP: one call of each
collective of the Python API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..zoo import TrainLoop

__all__ = ["CollectiveTour", "DEFAULT_TRAIN"]

DEFAULT_TRAIN = TrainLoop()


@dataclass(frozen=True)
class CollectiveTour:
    """A ``train`` function that runs no DDP: one call of each collective of the Python API
    (plus a subgroup allreduce and a ring of point-to-point messages, where the world allows),
    on integer-valued float tensors so every backend's results are exact whatever its sum order.
    Returns a module whose buffers hold the results, so :func:`~fakepg.conformance.compare`
    checks each op's name, shapes and dtypes *and* its results against the other backend's.
    """

    def __call__(self, scenario: Any, rank: int, world_size: int, device: torch.device) -> Any:
        n, dev, f32 = world_size, device, torch.float32
        out = torch.nn.Module()

        def keep(name: str, t: torch.Tensor) -> None:
            out.register_buffer(name, t.detach().clone())

        x = torch.arange(6, dtype=f32, device=dev) + 10 * rank
        t = x.clone(); dist.all_reduce(t); keep("all_reduce_sum", t)  # noqa: E702
        t = x.clone(); dist.all_reduce(t, op=dist.ReduceOp.MAX); keep("all_reduce_max", t)  # noqa: E702
        t = x.clone(); dist.broadcast(t, src=n - 1); keep("broadcast", t)  # noqa: E702
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        keep("all_gather", torch.stack(parts))
        t = torch.empty(6 * n, dtype=f32, device=dev)
        # torch 2.13 renamed these (the old names warn); 2.11 has only the old ones.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(t, x)
        keep("all_gather_into_tensor", t)
        t = torch.empty(2, dtype=f32, device=dev)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            t, torch.arange(2 * n, dtype=f32, device=dev) * (rank + 1))
        keep("reduce_scatter_tensor", t)
        t = torch.empty(2 * n, dtype=f32, device=dev)
        dist.all_to_all_single(t, torch.arange(2 * n, dtype=f32, device=dev) + 100 * rank)
        keep("all_to_all_single", t)
        t = x.clone(); dist.reduce(t, dst=0)  # noqa: E702 - only the destination's result is defined
        keep("reduce", t if rank == 0 else torch.zeros_like(t))
        bucket = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        dist.gather(x, bucket, dst=0)
        keep("gather", torch.stack(bucket) if rank == 0 else torch.zeros(n, 6, device=dev))
        t = torch.empty_like(x)
        src = [torch.full((6,), float(i), device=dev) for i in range(n)] if rank == n - 1 else None
        dist.scatter(t, src, src=n - 1)
        keep("scatter", t)
        objects: list[Any] = [None] * n
        dist.all_gather_object(objects, {"rank": rank, "square": rank * rank})
        keep("all_gather_object", torch.tensor([o["square"] for o in objects]))
        dist.barrier()
        if n >= 3:
            members = list(range(0, n, 2))
            sub = dist.new_group(members)
            t = x.clone()
            if rank in members:
                dist.all_reduce(t, group=sub)
            keep("subgroup_all_reduce", t)
        if n >= 2:
            t = torch.empty_like(x)
            req = dist.isend(x, (rank + 1) % n)
            dist.recv(t, (rank - 1) % n)
            req.wait()
            keep("ring", t)
        return out
