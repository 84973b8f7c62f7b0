"""DDP's construction-time parameter check, with memory that grows linearly in a large world.

``DistributedDataParallel.__init__`` calls ``dist._verify_params_across_processes`` (C++,
reducer.cpp): every rank all-gathers its parameter count into ``world_size`` one-element output
tensors, then rank 0 broadcasts the sizes and strides of its parameters. In separate processes
that is O(world) per process; in one process all ranks' output lists are alive at once
(each rank has allocated its outputs before the last rank arrives), so 4,096 ranks hold 16.7
million tensors (~8 GB). In worlds of :data:`LARGE_WORLD` ranks or more, fakepg runs the same
check in Python with one ``world_size``-element output per rank (``all_gather_into_tensor``
instead of ``allgather``, the one visible difference: the trace shows that op) and raises
torch's errors with torch's wording.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LARGE_WORLD", "verify_params_across_processes"]

LARGE_WORLD = 512


def verify_params_across_processes(process_group: Any, tensors: list[torch.Tensor],
                                   logger: Any = None) -> None:
    """reducer.cpp's ``verify_params_across_processes``: the same collectives' content, the same
    checks and messages; O(world) memory per rank."""
    me = process_group.rank()
    count = torch.tensor([len(tensors)], dtype=torch.long)
    counts = torch.empty(process_group.size(), dtype=torch.long)
    dist.all_gather_into_tensor(counts, count, group=process_group)
    for i, c in enumerate(counts.tolist()):
        if c != len(tensors):
            raise RuntimeError(f"DDP expects same model across all ranks, but Rank {me} has "
                               f"{len(tensors)} params, while rank {i} has inconsistent {c} "
                               f"params.")
    meta = torch.tensor([x for t in tensors for x in (*t.shape, *t.stride())], dtype=torch.long)
    control = meta.clone()
    dist.broadcast(control, group=process_group, group_src=0)
    i = 0
    for p, t in enumerate(tensors):
        for what, values in (("sizes", list(t.shape)), ("strides", list(t.stride()))):
            if values != control[i:i + len(values)].tolist():
                raise RuntimeError(f"[{me}]: params[{p}] in this process with {what} {values} "
                                   f"appears not to match {what} of the same param in process 0.")
            i += len(values)
