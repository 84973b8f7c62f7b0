"""replay(): a captured step replayed at any world size, on the engine that fits.

It checks the knobs (:class:`~simddp.program.knobs.Knobs`), has the capture's planner write
the step program (:mod:`simddp.program`) and runs it on one engine:

* the **simpy engine** (:class:`~simddp.replay.simpy_engine.SimpyReplay`), one simpy process per class of
  identical ranks (:mod:`~simddp.replay.classes`) — without jitter a million ranks are a few
  classes — or per rank (``per_rank=True``, and where nothing else applies);
* the **vectorised engine** (:class:`~simddp.replay.vector_engine.VectorReplay`), every rank a slot
  of numpy arrays, when ``jitter`` makes every rank distinct (or ``engine="vector"``), unless
  :func:`~simddp.replay.vector_engine.unsupported` names what of the program it does not run
  (uneven inputs, NICs shared between groups, …): then the simpy engine runs, and the
  result's ``engine_reason`` says why.

Both give the same figures (iteration ends bit for bit; see :mod:`simddp.replay.vector_engine`).
"""

from __future__ import annotations

import gc
import time as _time
from typing import Any

import numpy as np
from fakepg.arguments import integer

from ..analysis import PerRank, ReplayResult
from ..models import Network, NetworkModel
from ..program import Knobs, plan
from ..program.captured import CapturedIteration
from ..program.steps import job_memory
from .progress import progress_display
from .simpy_engine import SimpyReplay
from .vector_engine import DrawOrderUnsettled, VectorReplay, unsupported

__all__ = ["replay", "ENGINES"]

ENGINES = (None, "auto", "simpy", "vector")


def _network(network: Any, cap: CapturedIteration) -> NetworkModel:
    if network is None:
        net = cap.network_model()
        if net is None:
            raise ValueError("replay(network=...) is needed: the capture's network was not a "
                             "simddp.Network")
        return net
    if isinstance(network, str):
        return Network.preset(network)
    if not isinstance(network, NetworkModel):
        raise TypeError(f"network must be a preset name or a network model (simddp.Network, or "
                        f"anything with name, gpus_per_node, collective_time(op, nbytes, "
                        f"nranks) and describe(): simddp.models.NetworkModel), got {network!r}")
    return network


def replay(captured: Any, world_size: int | None = None, *,
           network: NetworkModel | str | None = None, knobs: Knobs | None = None,
           per_rank: bool = False, engine: str | None = None, progress: Any = None,
           program: Any = None, **knob_values: Any) -> ReplayResult:
    """Replay ``captured`` on ``world_size`` ranks (default: the captured world size). See
    :mod:`simddp.replay` for the model and every knob.

    Knobs: a :class:`~simddp.program.knobs.Knobs` (``knobs=``), and/or its fields as keywords
    (``bucket_cap_mb=5, comm_hook="fp16"``; these override ``knobs``'s); an unknown keyword is
    an error naming the knobs. The capture's planner (:func:`simddp.program.plan`) turns it into
    a step program for this world, which one engine runs:

    ``engine``: None or "auto" runs the vectorised engine when ``jitter`` > 0 (every rank
    distinct) and it runs the whole program, else the simpy engine in classes of identical
    ranks; the result's ``engine`` and ``engine_reason`` say which ran and why. "simpy" forces
    the simpy engine; "vector" the vectorised one (a ``ValueError`` says precisely why where it
    cannot). ``per_rank=True`` simulates every rank on the simpy engine, instead of one
    representative per class (same results, much slower at scale: for benchmarks and tests).
    ``progress``: None shows a rich progress bar on stderr when stderr is a terminal, True
    always, False never; a callable ``progress(done, total, description)`` hears it instead.
    None of these changes the result (the vectorised engine's per-iteration figures agree to
    float rounding, its iteration ends exactly). ``program``: the step program
    :func:`simddp.program.plan` already wrote for this capture, world and knobs (a caller that
    read its memory first, as ``simddp plan`` does, need not plan twice); None: planned here."""
    t_wall = _time.perf_counter()
    cap = captured
    world = integer("world_size", cap.world_size if world_size is None else world_size,
                    minimum=1)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if knobs is not None and not isinstance(knobs, Knobs):
        raise TypeError(f"knobs must be a simddp.program.Knobs, got {knobs!r}")
    base = knobs or Knobs()
    k = base.replace(**knob_values)
    net = _network(network, cap)
    checked = k.checked(world, net)
    if program is None:
        program = plan(cap, checked)
    limit = None if k.gpu_memory_gb is None else int(k.gpu_memory_gb * 1e9)
    mem = job_memory(program, gpu_memory_bytes=limit,
                     expandable_segments=k.expandable_segments)
    # a knob the planner resolved from the capture (a pipeline's schedule) shows its value
    resolved = program.knob_values()
    buckets, bucket_bytes = program.communication_buckets()
    result = dict(world_size=world, iterations=program.iterations,
                  knobs={**checked.describe(), **resolved},
                  buckets=buckets, bucket_bytes=bucket_bytes,
                  peak_memory_bytes=mem.reserved_peak, memory=mem.by_category,
                  memory_limit_bytes=limit, peak_memory_allocated_bytes=mem.allocated_peak,
                  memory_outside_bytes=mem.outside, memory_ooms=mem.ooms,
                  memory_fragmentation=mem.fragmentation, memory_margin=mem.margin,
                  parallel=None if program.parallel is None else str(program.parallel))
    why = unsupported(program, checked)
    if engine == "vector" and why is not None:
        raise ValueError(f"replay(engine='vector'): not vectorised: {why}")
    if engine == "vector":
        chosen, reason = "vector", "asked for"
    elif engine == "simpy":
        chosen, reason = "simpy", "asked for"
    elif per_rank:
        chosen, reason = "simpy", "per_rank=True"
    elif k.jitter <= 0:
        chosen, reason = "simpy", "no jitter: identical ranks replay once per class"
    elif why is not None:
        chosen, reason = "simpy", f"the vectorised engine does not model {why}"
    else:
        chosen, reason = "vector", "jitter makes every rank distinct"
    if chosen == "vector":
        vec = VectorReplay(program, checked)
        was_enabled = gc.isenabled()
        gc.disable()  # no cyclic garbage here; the collectives' records are many dicts
        try:
            with progress_display(progress) as report:
                timeline = vec.run(report)
            colls = vec.collectives()
        except DrawOrderUnsettled as e:
            if engine == "vector":
                raise
            chosen, reason = "simpy", f"the vectorised engine's draw order did not settle ({e})"
        else:
            ncoll, nbytes = vec.rank_totals()
            one = np.zeros(world, dtype=np.int8)  # every rank alike: one class
            return ReplayResult(
                **result, collectives=colls,
                rank_collectives=PerRank([ncoll], one), rank_comm_bytes=PerRank([nbytes], one),
                timeline=timeline, wall_time=_time.perf_counter() - t_wall,
                engine=chosen, engine_reason=reason)
        finally:
            if was_enabled:
                gc.enable()
    sim = SimpyReplay(program, checked, classes=not per_rank)
    with progress_display(progress) as report:
        timeline = sim.run(report)
    colls = [{"name": c.info["name"], "op": c.info["op"], "group": c.info["group"],
              "members": len(c.info["members"]), "seq": c.info["seq"],
              "bytes": c.info["bytes"], "start": c.start, "end": c.end} for c in sim.order]
    return ReplayResult(
        **result, collectives=colls, bubble_fraction=program.bubble_fractions(timeline),
        rank_collectives=sim.per_rank([len(x) for x in sim.comms]),
        rank_comm_bytes=sim.per_rank([sum(c.info["bytes"] for c, _ in x) for x in sim.comms]),
        timeline=timeline, wall_time=_time.perf_counter() - t_wall,
        engine=chosen, engine_reason=reason)
