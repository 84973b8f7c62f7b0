"""simddp: virtual time for the fake cluster, and what-if timing of distributed training
(DDP, FSDP2/HSDP, tensor and pipeline parallelism; :mod:`simddp.program.registry`).

:func:`simulate` runs a function on fakepg's in-process ranks, exactly as
:func:`fakepg.spawn` does, while a virtual clock per rank charges every aten op to a
:class:`Compute` model and every collective to a :class:`Network` model (see
:mod:`simddp.cosim.simulate` for the rules: waits, stream semantics, races, timeouts).

Three parts: :mod:`simddp.models` (network, compute and noise models, and the protocols
:class:`NetworkModel` and :class:`ComputeModel` both engines accept), :mod:`simddp.cosim`
(co-simulation, trace-driven replay, the simpy core) and :mod:`simddp.analysis` (the
:class:`Timeline` and the results, which share one shape: ``result.timeline``,
``result.iteration_times``, ``result.exposed_comm``, ``result.summary()``).

Example::

    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import simddp
    from simddp import Compute, Network, Timing

    def train(rank):
        model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]),
                    bucket_cap_mb=0.25)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(32, 256)).sum().backward()
            opt.step()

    timing = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"),
                    rank_speed={3: 0.5}, jitter=0.02)
    result = simddp.simulate(train, nprocs=8, timing=timing, seed=0)
    print(result.timeline.iteration_times())   # seconds per iteration (slowest rank)
    print(result.timeline.exposed_comm())      # communication not hidden behind compute
    print(result.timeline.summary())           # a table
    result.timeline.to_chrome_trace("trace.json")   # open in https://ui.perfetto.dev
    result.timeline.plot("timeline.png")
    rec = result.trace[0][-1]                   # fakepg's trace, with virtual times
    print(rec.op, rec.issue, rec.start, rec.end)

Trace-driven replay at scale (:mod:`simddp.replay`): capture one DDP iteration of the fake
cluster, then replay it at thousands of ranks with what-if knobs::

    from fakepg import zoo
    from simddp.replay import replay
    from simddp import capture, sweep
    cap = simddp.capture(zoo.get("transformer_block"), nprocs=2, timing=timing)
    res = replay(cap, 4096, network=Network.preset("ib-ndr", gpus_per_node=8),
                 bucket_cap_mb=5, comm_hook="fp16")
    res.iteration_time, res.mean_exposed_comm, res.timeline.plot("r.png", ranks=range(8))

(The function is ``simddp.replay.replay``; the package attribute ``simddp.replay`` stays the
module.) Both co-simulation and replay run on the simpy core of :mod:`simddp.core`.

Timing exploration (:mod:`simddp.exploration`, needs hypothesis): :func:`explore` searches
perturbed timings (stragglers, jitter, slow links: :func:`simddp.strategies.timings`) for one
that breaks the program, shrinks it toward the base timing and raises
:class:`ExplorationError` with a replay token; faults from a virtual time are in
:mod:`simddp.faults`::

    base = Timing(compute=Compute.constant(1e-3), timeout=0.05)
    simddp.explore(work, nprocs=4, timing=base, runs=50)   # ExplorationError: rank 3 ... slower
    simddp.simulate(work, nprocs=4, timing=base.with_token("sd1:..."))   # the replay
    simddp.simulate(work, nprocs=4, timing=base, faults=[simddp.faults.slow_rank(3, 4.0, at=0.02)])

Errors: :class:`CollectiveRaceError` (an async collective's tensor touched before its
wait) and :class:`CollectiveTimeoutError` (a wait past the group's timeout, in virtual
time), both subclasses of :class:`fakepg.FakePGError`.
"""

import importlib as _importlib
import sys as _sys
import types as _types
from typing import Any as _Any

# name -> the module that defines it, imported on first use: ``import simddp`` (and so
# ``simddp --help``) loads no torch; simulation imports it when it starts
_LAZY = {
    **dict.fromkeys(("CommSpan", "IterationStats", "ReplayResult", "RunResult", "SimResult",
                     "Span", "SweepResult", "Timeline"), ".analysis"),
    **dict.fromkeys(("Channel", "CollectiveProcess", "Fabric"), ".core"),
    "CapturedIteration": ".program.captured",
    "sweep": ".sweep",
    **dict.fromkeys(("Observer", "capture", "mark_iteration", "now", "simulate"), ".cosim"),
    "RerunWarning": ".cosim.simulate",
    **dict.fromkeys(("CollectiveRaceError", "CollectiveTimeoutError", "ExplorationError"),
                    ".errors"),
    **dict.fromkeys(("ExplorationSummary", "explore"), ".exploration"),
    **dict.fromkeys(("Compute", "ComputeModel", "Contention", "DevicePreset", "MeasuredNetwork",
                     "Network", "NetworkModel"), ".models"),
    "Timing": ".timing",
}
_SUBMODULES = ("replay", "faults", "strategies")  # simddp.strategies needs hypothesis

__all__ = [
    "simulate", "SimResult", "RerunWarning", "Timing", "Network", "MeasuredNetwork", "Contention", "Compute",
    "DevicePreset",
    "NetworkModel", "ComputeModel", "Observer",
    "Timeline", "Span", "CommSpan", "IterationStats", "RunResult",
    "CollectiveRaceError", "CollectiveTimeoutError", "now", "mark_iteration",
    "Fabric", "Channel", "CollectiveProcess",
    "capture", "sweep", "CapturedIteration", "ReplayResult", "SweepResult",
    "explore", "ExplorationError", "ExplorationSummary", "faults", "strategies",
]


def __getattr__(name: str) -> _Any:
    if name in _SUBMODULES:
        return _importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'simddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """``simddp.sweep`` stays the function (as it was when the package imported it eagerly),
    though importing the submodule ``simddp.sweep`` later sets the attribute to the module."""

    def __setattr__(self, name: str, value: _Any) -> None:
        if name == "sweep" and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
