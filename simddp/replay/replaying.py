"""replay(): a captured DDP iteration replayed at any world size, on the engine that fits.

It checks the knobs, plans each bucket (:mod:`~simddp.program.captured`) and runs one engine:

* the **simpy engine** (:class:`~simddp.replay.simpy_engine._Replay`), one simpy process per class of
  identical ranks (:mod:`~simddp.replay.classes`) — without jitter a million ranks are a few
  classes — or per rank (``per_rank=True``, and where nothing else applies);
* the **vectorised engine** (:class:`~simddp.replay.vector_engine.VectorReplay`), every rank a slot
  of numpy arrays, when ``jitter`` makes every rank distinct (or ``engine="vector"``), unless
  :func:`~simddp.replay.vector_engine.unsupported` names an option it does not implement (uneven
  inputs, NICs shared between groups, …): then the simpy engine runs instead.

Both give the same figures (iteration ends bit for bit; see :mod:`simddp.replay.vector_engine`).
"""

from __future__ import annotations

import gc
import time as _time
from typing import Any, Mapping

import numpy as np
from fakepg.arguments import integer

from ..analysis import PerRank, ReplayResult
from ..models import Network, NetworkModel
from ..program.captured import CapturedIteration, Costs, check_knobs, plans
from .progress import progress_display
from .simpy_engine import _Replay
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


def replay(captured: CapturedIteration, world_size: int | None = None, *,
           network: NetworkModel | str | None = None, bucket_cap_mb: float | None = None,
           first_bucket_mb: float | None = None, comm_hook: str | None = None,
           powersgd_rank: int = 1, rank_speed: Mapping[int, float] | None = None,
           jitter: float = 0.0, seed: int = 0, localsgd_period: int | None = None,
           slowmo_period: int | None = None, uneven: Mapping[int, int] | None = None,
           iterations: int | None = None, groups: int = 1,
           shared_nic: bool = False, per_rank: bool = False, engine: str | None = None,
           progress: Any = None) -> ReplayResult:
    """Replay ``captured`` on ``world_size`` ranks (default: the captured world size). See
    :mod:`simddp.replay` for the model and every knob.

    ``engine``: None or "auto" runs the vectorised engine when ``jitter`` > 0 (every rank
    distinct) and it implements every option given, else the simpy engine in classes of
    identical ranks; "simpy" forces the simpy engine; "vector" the vectorised one (a
    ``ValueError`` says why where it cannot). ``per_rank=True`` simulates every rank on the
    simpy engine, instead of one representative per class (same results, much slower at
    scale: for benchmarks and tests). ``progress``: None shows a rich progress bar on stderr
    when stderr is a terminal, True always, False never; a callable ``progress(done, total,
    description)`` hears it instead. None of these changes the result (the vectorised
    engine's per-iteration figures agree to float rounding, its iteration ends exactly)."""
    # every keyword as given: a knob the vectorised engine does not know (vector.KNOWN_OPTIONS)
    # makes it fall back to the simpy engine, so a new keyword is safe by default
    options = {k: v for k, v in locals().items() if k not in ("captured", "world_size")}
    t_wall = _time.perf_counter()
    cap = captured
    world = integer("world_size", cap.world_size if world_size is None else world_size,
                    minimum=1)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    net = _network(network, cap)
    period = localsgd_period if localsgd_period is not None else slowmo_period
    speeds, uneven, iterations = check_knobs(
        world, net, comm_hook=comm_hook, powersgd_rank=powersgd_rank, rank_speed=rank_speed,
        jitter=jitter, localsgd_period=localsgd_period, slowmo_period=slowmo_period,
        uneven=uneven, iterations=iterations, groups=groups, shared_nic=shared_nic)
    buckets = cap.buckets(bucket_cap_mb, first_bucket_mb)
    costs = Costs(cap.costs)
    bucket_plans = plans(cap, buckets, comm_hook, powersgd_rank, costs)
    knobs = {**net.describe(), "bucket_cap_mb": bucket_cap_mb,
             "first_bucket_mb": first_bucket_mb, "comm_hook": comm_hook,
             "powersgd_rank": powersgd_rank if comm_hook == "powersgd" else None,
             "rank_speed": {str(k): v for k, v in sorted(speeds.items())} or None,
             "jitter": float(jitter), "seed": seed, "localsgd_period": localsgd_period,
             "slowmo_period": slowmo_period,
             "uneven": {str(k): v for k, v in sorted(uneven.items())} or None,
             "groups": groups, "shared_nic": shared_nic}
    vector = engine == "vector" or (engine in (None, "auto") and jitter > 0 and not per_rank)
    if vector:
        why = unsupported(cap, world, net, bucket_plans, options)
        if why is not None:
            if engine == "vector":
                raise ValueError(f"replay(engine='vector'): not vectorised: {why}")
            vector = False
    result = dict(world_size=world, iterations=iterations, knobs=knobs, buckets=buckets,
                  bucket_bytes=[[b for _, b, _ in p.stages] for p in bucket_plans])
    if vector:
        vec = VectorReplay(cap, world, net, plans=bucket_plans, speeds=speeds, jitter=jitter,
                           seed=seed, period=period, slowmo=slowmo_period is not None,
                           iterations=iterations, groups=groups, costs=costs)
        was_enabled = gc.isenabled()
        gc.disable()  # no cyclic garbage here; the collectives' records are many dicts
        try:
            with progress_display(progress) as report:
                timeline = vec.run(report)
            colls = vec.collectives()
        except DrawOrderUnsettled:
            if engine == "vector":
                raise
            vector = False
        else:
            ncoll, nbytes = vec.rank_totals()
            one = np.zeros(world, dtype=np.int8)  # every rank alike: one class
            return ReplayResult(
                **result, collectives=colls,
                rank_collectives=PerRank([ncoll], one), rank_comm_bytes=PerRank([nbytes], one),
                timeline=timeline, wall_time=_time.perf_counter() - t_wall)
        finally:
            if was_enabled:
                gc.enable()
    sim = _Replay(cap, world, net, buckets=buckets, plans=bucket_plans, speeds=speeds,
                  jitter=jitter, seed=seed, period=period, slowmo=slowmo_period is not None,
                  uneven=uneven, iterations=iterations, groups=groups, shared_nic=shared_nic,
                  costs=costs, classes=not per_rank)
    with progress_display(progress) as report:
        timeline = sim.run(report)
    colls = [{"name": c.info["name"], "op": c.info["op"], "group": c.info["group"],
              "members": len(c.info["members"]), "seq": c.info["seq"],
              "bytes": c.info["bytes"], "start": c.start, "end": c.end} for c in sim.order]
    return ReplayResult(
        **result, collectives=colls,
        rank_collectives=sim.per_rank([len(x) for x in sim.comms]),
        rank_comm_bytes=sim.per_rank([sum(c.info["bytes"] for c, _ in x) for x in sim.comms]),
        timeline=timeline, wall_time=_time.perf_counter() - t_wall)
