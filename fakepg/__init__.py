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

import sys as _sys
from typing import Any as _Any

from .lazy import lazy_names as _lazy_names

# name -> the module that defines it, imported on first use (PEP 562): ``import fakepg`` loads
# no torch, so what reads only its torch-free modules (simddp's network models read
# ``fakepg.ops``' cost kinds; a warm ``simddp whatif``) runs without it
_LAZY = {
    **dict.fromkeys(("BackendTimeoutError", "CollectiveHangError", "CollectiveMismatchError",
                     "CollectiveTimeoutError", "FakePGError", "InvalidCollectiveError",
                     "PeerCrashedError", "NativeWaitError", "RankFailedError",
                     "RealProcessesWarning", "SharedStateError", "SpawnTimeoutError",
                     "StoreTimeoutError", "WorldAbortedError"), ".errors"),
    **dict.fromkeys(("ExplorationError", "ExplorationSummary", "explore"), ".launch.explore"),
    **dict.fromkeys(("GlooHazardError", "GlooHazardWarning"), ".fidelity.gloo_hazards"),
    **dict.fromkeys(("NcclHazardError", "NcclHazardWarning"), ".fidelity.nccl_hazards"),
    "WorldHooks": ".world.hooks",
    "per_rank_globals": ".world.isolation",
    **dict.fromkeys(("BACKEND_NAME", "FakeProcessGroup", "FakeWork", "register_backend"),
                    ".world.process_group"),
    **dict.fromkeys(("SpawnResult", "spawn"), ".launch.spawn"),
    "RankProcessDiedError": ".process.process_mode",
    "FakeStore": ".fidelity.store",
    **dict.fromkeys(("CollectiveRecord", "dump_flight_recorder", "flight_recorder_dump",
                     "from_json", "to_json"), ".ops.trace"),
}
# submodules read as attributes: fakepg.compat (cuda_synchronize_noop() and other CPU shims),
# fakepg.faults (crash / raise_in for spawn(faults=[...])), fakepg.suites (torch's
# MultiProcessTestCase suites on the fake cluster), fakepg.strategies (loads hypothesis)
_SUBMODULES = {"compat": ".fidelity.compat", "faults": ".choices.faults",
               "suites": ".launch.suites", "strategies": ".choices.strategies"}

__all__ = [
    "spawn", "SpawnResult", "explore", "ExplorationError", "ExplorationSummary", "CollectiveRecord", "BACKEND_NAME",
    "FakePGError", "CollectiveMismatchError", "CollectiveHangError", "RankFailedError",
    "WorldAbortedError", "CollectiveTimeoutError", "InvalidCollectiveError", "PeerCrashedError", "SpawnTimeoutError", "BackendTimeoutError",
    "StoreTimeoutError", "GlooHazardError", "GlooHazardWarning", "NcclHazardError",
    "NcclHazardWarning", "FakeStore", "RankProcessDiedError", "RealProcessesWarning", "SharedStateError", "NativeWaitError",
    "FakeProcessGroup", "FakeWork", "WorldHooks", "per_rank_globals",
    "to_json", "from_json", "flight_recorder_dump", "dump_flight_recorder",
]


_lazy_getattr, __dir__ = _lazy_names(__name__, _LAZY, _SUBMODULES)


def __getattr__(name: str) -> _Any:
    value = _lazy_getattr(name)
    if name in _LAZY:  # a public name (fakepg's own modules import submodules, never these)
        _register_backend_once()
    return value


_registered = False


def _register_backend_once() -> None:
    """Register the "fakepg" backend with torch.distributed (``init_process_group("fakepg")``
    outside a world then says to use fakepg.spawn) once torch is loaded: at ``import fakepg``
    where the program imported torch first (as programs that use it do), else when a name of
    fakepg is first read after torch loaded (spawn registers it again before a world starts)."""
    global _registered
    if not _registered and "torch" in _sys.modules:
        _registered = True
        from .world.process_group import register_backend
        register_backend()


_register_backend_once()
