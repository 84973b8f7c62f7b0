"""simddp: virtual time for the fake cluster, and what-if timing of DDP.

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

import os as _os

from fakepg.sites import skip_package as _skip_package

from . import replay
from .analysis import (CommSpan, IterationStats, ReplayResult, RunResult, SimResult, Span,
                       SweepResult, Timeline)
from .core import Channel, CollectiveProcess, Fabric
from .program.captured import CapturedIteration
from .sweep import sweep
from .cosim import Observer, capture, mark_iteration, now, simulate
from .cosim.simulate import RerunWarning
from . import faults
from .errors import CollectiveRaceError, CollectiveTimeoutError, ExplorationError
from .exploration import ExplorationSummary, explore
from .models import (Compute, ComputeModel, Contention, DevicePreset, MeasuredNetwork, Network,
                     NetworkModel)
from .timing import Timing

_skip_package(_os.path.dirname(_os.path.abspath(__file__)))  # user_site() skips simddp frames

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


def __getattr__(name: str):  # simddp.strategies needs hypothesis: imported on first use
    if name == "strategies":
        import importlib
        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module 'simddp' has no attribute {name!r}")
