"""fakepg: a deterministic in-process fake cluster on which torch's real DDP runs.

Example::

    import torch, torch.distributed as dist, fakepg

    def train(rank):
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.randn(8, 4)).sum().backward()
        return [p.grad for p in model.parameters()]

    result = fakepg.spawn(train, nprocs=4, seed=0)
    print(result.summary())
"""

from .errors import (BackendTimeoutError, CollectiveHangError, CollectiveMismatchError,
                     CollectiveTimeoutError, FakePGError, InvalidCollectiveError, PeerCrashedError,
                     NativeWaitError, RankFailedError, RealProcessesWarning, SharedStateError, SpawnTimeoutError, StoreTimeoutError,
                     WorldAbortedError)
from .exploration import ExplorationError, ExplorationSummary, explore
from .gloo_hazards import GlooHazardError, GlooHazardWarning
from .nccl_hazards import NcclHazardError, NcclHazardWarning
from .hooks import WorldHooks
from .isolation import per_rank_globals
from .process_group import BACKEND_NAME, FakeProcessGroup, FakeWork, register_backend
from .world import SpawnResult, spawn
from .process_mode import RankProcessDiedError
from .store import FakeStore
from . import compat  # fakepg.compat.cuda_synchronize_noop() and other CPU shims
from . import faults  # fakepg.faults.crash / raise_in for spawn(faults=[...])
from .trace import CollectiveRecord, dump_flight_recorder, flight_recorder_dump, from_json, to_json

register_backend()

__all__ = [
    "spawn", "SpawnResult", "explore", "ExplorationError", "ExplorationSummary", "CollectiveRecord", "BACKEND_NAME",
    "FakePGError", "CollectiveMismatchError", "CollectiveHangError", "RankFailedError",
    "WorldAbortedError", "CollectiveTimeoutError", "InvalidCollectiveError", "PeerCrashedError", "SpawnTimeoutError", "BackendTimeoutError",
    "StoreTimeoutError", "GlooHazardError", "GlooHazardWarning", "NcclHazardError",
    "NcclHazardWarning", "FakeStore", "RankProcessDiedError", "RealProcessesWarning", "SharedStateError", "NativeWaitError",
    "FakeProcessGroup", "FakeWork", "WorldHooks", "per_rank_globals",
    "to_json", "from_json", "flight_recorder_dump", "dump_flight_recorder",
]
