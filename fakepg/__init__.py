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
                     NativeWaitError, RankFailedError, RealProcessesWarning, SharedStateError,
                     SpawnTimeoutError, StoreTimeoutError, WorldAbortedError)
from .launch.explore import ExplorationError, ExplorationSummary, explore
from .fidelity.gloo_hazards import GlooHazardError, GlooHazardWarning
from .fidelity.nccl_hazards import NcclHazardError, NcclHazardWarning
from .world.hooks import WorldHooks
from .world.isolation import per_rank_globals
from .world.process_group import BACKEND_NAME, FakeProcessGroup, FakeWork, register_backend
from .launch.spawn import SpawnResult, spawn
from .process.process_mode import RankProcessDiedError
from .fidelity.store import FakeStore
from .fidelity import compat  # fakepg.compat.cuda_synchronize_noop() and other CPU shims
from .choices import faults  # fakepg.faults.crash / raise_in for spawn(faults=[...])
from .launch import suites  # fakepg.suites: torch's MultiProcessTestCase suites on the fake cluster
from .ops.trace import CollectiveRecord, dump_flight_recorder, flight_recorder_dump, from_json, to_json

register_backend()


def __getattr__(name: str):
    # ``fakepg.strategies`` (hypothesis strategies) loads hypothesis, so it is imported when first used
    if name == "strategies":
        from .choices import strategies
        return strategies
    raise AttributeError(f"module 'fakepg' has no attribute {name!r}")

__all__ = [
    "spawn", "SpawnResult", "explore", "ExplorationError", "ExplorationSummary", "CollectiveRecord", "BACKEND_NAME",
    "FakePGError", "CollectiveMismatchError", "CollectiveHangError", "RankFailedError",
    "WorldAbortedError", "CollectiveTimeoutError", "InvalidCollectiveError", "PeerCrashedError", "SpawnTimeoutError", "BackendTimeoutError",
    "StoreTimeoutError", "GlooHazardError", "GlooHazardWarning", "NcclHazardError",
    "NcclHazardWarning", "FakeStore", "RankProcessDiedError", "RealProcessesWarning", "SharedStateError", "NativeWaitError",
    "FakeProcessGroup", "FakeWork", "WorldHooks", "per_rank_globals",
    "to_json", "from_json", "flight_recorder_dump", "dump_flight_recorder",
]
