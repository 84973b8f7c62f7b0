"""torch's own entry points, captured when fakepg is first imported, before any world patches them.

A running world replaces some of torch.distributed's entry points (:mod:`.patches` on rank
threads, :mod:`fakepg.process.remote.entry_points` in a rank process); each replacement falls
back to, or builds on, torch's own, named once here.
"""

from __future__ import annotations

import datetime

import torch.distributed.distributed_c10d as c10d

from ..torch_private import new_process_group_helper

TORCH_INIT_PROCESS_GROUP = c10d.init_process_group
TORCH_MONITORED_BARRIER = c10d.monitored_barrier
TORCH_NEW_GROUP_HELPER = new_process_group_helper
TORCH_GET_BACKEND = c10d.get_backend
PG_TIMEOUT = datetime.timedelta(minutes=30)  # c10d's default for gloo

__all__ = ["TORCH_INIT_PROCESS_GROUP", "TORCH_MONITORED_BARRIER", "TORCH_NEW_GROUP_HELPER",
           "TORCH_GET_BACKEND", "PG_TIMEOUT"]
