"""Replay's vectorised engine: every rank of an SPMD replay advanced as numpy arrays.

All ranks replay the same plan; only their times differ (their profile, speed and noise
draws). So instead of a simpy process per rank (:class:`~simddp.replay.simpy_engine._Replay`), this
engine walks the plan once — forward compute with the forward collectives at their offsets,
backward with every bucket issued at its ready time after ``plan.pre``, comm hook callbacks
and PowerSGD's stages on the side stream, the end-of-backward wait, post-backward and
optimizer compute, LocalSGD/SlowMo averaging — and each step updates an array over ranks
(one pass, phase by phase: :class:`~simddp.replay.vector_pass.PlanPass`).
Each collective is one scalar per communicator (a DDP group's, or a node subgroup's):
``start = max(latest arrival of its members, end of the communicator's previous
collective)``, ``end = start + duration``, the duration being the network model's time times
the same noise factor the simpy engine draws (:mod:`simddp.models.noise`: one factor per
collective, in the order the collectives are created — see :meth:`VectorReplay.run` for how
that order is found when several communicators interleave). Every float is computed with the
same operations in the same order as in :class:`_Replay`, so iteration boundaries are the
simpy engine's bit for bit; the per-iteration compute, wait, comm and exposed-comm figures are
sums of the same intervals in another order (equal to float rounding).

Results keep no per-rank spans: per rank and iteration arrays of boundaries, compute per
phase, waits, comm and exposed comm (:class:`~simddp.analysis.arrays.ArrayTimeline`). A rank's
spans and collectives are materialised on demand by re-running the plan for that rank alone
against the recorded collectives (:meth:`VectorReplay.lanes`).

Not vectorised (:func:`unsupported` names why; :func:`~simddp.replay.replay` then runs the
simpy engine): uneven inputs (Join's shadow iterations make ranks run different plans),
shared NICs that several DDP groups contend for (``shared_nic``: links couple communicators
in time), captured ranks whose forward collectives differ in order, PowerSGD with sparse
buckets (a mix of chained and single-stage buckets shares the side stream in time order),
and any replay option this engine does not know.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..analysis.arrays import ArrayTimeline
from ..models import NetworkModel, noise
from ..program.captured import BucketPlan, CapturedIteration, Costs
from .vector_pass import PlanPass
from .vector_records import Record, ResultRecords, Scope, Step, comm_figures

__all__ = ["VectorReplay", "unsupported", "KNOWN_OPTIONS", "DrawOrderUnsettled"]

# The replay options this engine implements. An option outside this set (a later knob such as
# a contention model) makes unsupported() refuse, and replay() falls back to the simpy engine.
KNOWN_OPTIONS = frozenset({"network", "bucket_cap_mb", "first_bucket_mb", "comm_hook",
                           "powersgd_rank", "rank_speed", "jitter", "seed", "localsgd_period",
                           "slowmo_period", "uneven", "iterations", "groups", "shared_nic",
                           "per_rank", "progress", "engine"})

_MAX_PASSES = 64  # passes to settle the draw order of interleaved communicators


class DrawOrderUnsettled(RuntimeError):
    """The noise draw order of interleaved communicators did not settle (replay() then runs
    the simpy engine)."""


def unsupported(cap: CapturedIteration, world: int, net: NetworkModel, plans: list[BucketPlan],
                options: Mapping[str, Any]) -> str | None:
    """Why this engine cannot replay with these options (None: it can). The one predicate
    that decides the fallback to the simpy engine; extend it with every new option."""
    unknown = sorted(k for k, v in options.items() if k not in KNOWN_OPTIONS and v)
    if unknown:
        return f"option(s) {', '.join(unknown)} not implemented by the vectorised engine"
    if options.get("uneven"):
        return "uneven inputs (Join's shadow iterations)"
    contention = getattr(net, "contention", None)
    if contention is not None and contention.active:
        return "the network's Contention (compute slowed while communicating)"
    groups = options.get("groups") or 1
    if options.get("shared_nic") and groups > 1 and world > (net.gpus_per_node or world):
        return "shared NICs contended by several DDP groups"
    shapes = {tuple((what, k) for _, what, k in _forward_events(p)) for p in cap.profiles}
    if len(shapes) > 1:
        return "captured ranks issue their forward collectives in different orders"
    if len({len(p.stages) > 1 for p in plans}) > 1:
        return "a mix of chained (PowerSGD) and single-stage buckets"
    return None


def _forward_events(prof: Any) -> list[tuple[float, int, int]]:
    ev = []
    for k, fc in enumerate(prof.forward_collectives):
        ev.append((float(fc["offset"]), 0, k))
        if fc.get("wait_at") is not None:
            ev.append((float(fc["wait_at"]), 1, k))
    return sorted(ev)


class VectorReplay(ResultRecords):
    """One vectorised replay (see the module docstring). Same arguments as ``_Replay``."""

    def __init__(self, cap: CapturedIteration, world: int, net: NetworkModel, *,
                 plans: list[BucketPlan], speeds: Mapping[int, float], jitter: float, seed: int,
                 period: int | None, slowmo: bool, iterations: int, groups: int,
                 costs: Costs) -> None:
        self.cap, self.world, self.net = cap, world, net
        self.plans, self.period, self.slowmo = plans, period, slowmo
        self.iterations, self.groups, self.costs = iterations, groups, costs
        self.jitter, self.seed = jitter, seed
        profs = cap.profiles
        self.nprof = len(profs)
        self.gpn = gpn = net.gpus_per_node or 1
        ranks = np.arange(world, dtype=np.int64)
        self.slow = np.ones(world)
        for r, v in speeds.items():
            self.slow[r] = 1.0 / v
        col = lambda f: np.array([float(f(p)) for p in profs])  # noqa: E731
        self.p_forward, self.p_backward = col(lambda p: p.forward), col(lambda p: p.backward)
        self.p_post, self.p_before = col(lambda p: p.post_backward), col(lambda p: p.before_step)
        self.p_opt = col(lambda p: p.optimizer)
        events = [_forward_events(p) for p in profs]
        self.fwd_events = [(what, k) for _, what, k in events[0]]
        self.fwd_offsets = np.array([[o for o, _, _ in ev] for ev in events]).reshape(
            self.nprof, len(self.fwd_events))
        ready = []
        for p in profs:
            rd = [0.0 if t is None else float(t) for t in p.ready]
            ready.append([max((rd[i] for i in b.params), default=0.0) for b in plans])
        self.p_ready = np.array(ready).reshape(self.nprof, len(plans))
        self.noise = None
        if jitter > 0:  # the simpy engine's draws: same generator, same shape
            self.noise = noise.lognormal(noise.generator(seed, 0), jitter,
                                         (world, iterations, 4))
        g = ranks % groups
        self.scopes = {"dp": Scope("dp", g, groups)}
        nnodes = -(-world // gpn)
        self.nnodes = nnodes
        if period:
            self.scopes["node"] = Scope("node", g * nnodes + ranks // gpn, groups * nnodes)
        self.multi = sum(len(s.present) for s in self.scopes.values()) > 1
        self.steps: dict[tuple, Step] = {}
        self.order: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 2
        # ^ (step index, communicator code) of every collective, in creation order
        self._lane_cache: dict[int, Any] = {}
        self.passes = 0

    # -- collective durations ----------------------------------------------------------------
    def _factors(self, n: int) -> np.ndarray:
        """The first n network noise factors, exactly as :class:`noise.Stream` yields them."""
        rng = noise.generator(self.seed, 1)
        blocks = [noise.lognormal(rng, self.jitter, noise.BLOCK)
                  for _ in range(max(1, -(-n // noise.BLOCK)))]
        return np.concatenate(blocks)[:n]

    def _draws(self) -> int:
        """How many noise factors the run draws: one per collective of more than one rank."""
        per = {k: int((sc.size > 1).sum()) for k, sc in self.scopes.items()}
        scope = "node" if self.period else "dp"
        fwd = len(self.cap.profiles[0].forward_collectives)
        bwd = sum(len(p.stages) for p in self.plans) + len(self.cap.backward_collectives)
        avg = sum(1 for it in range(self.iterations) if self.period and it % self.period == 0)
        return self.iterations * (fwd * per["dp"] + bwd * per[scope]) + avg * per["dp"]

    # -- one pass over the plan -------------------------------------------------------------
    def _pass(self, ranks: np.ndarray, rec: Record, full: bool, factors: np.ndarray | None,
              progress: Any = None) -> None:
        """One pass over the plan for ``ranks``, phase by phase (:class:`PlanPass`)."""
        PlanPass(self, ranks, rec, full, factors).run(progress)

    # -- the run -----------------------------------------------------------------------------
    def run(self, progress: Any = None) -> ArrayTimeline:
        """Replay every rank; returns the timeline. ``progress(done, total, description)``.

        With one communicator (one DDP group, no node subgroups) collectives are created in
        plan order, which is the simpy engine's noise draw order. With several, the simpy
        engine creates them in virtual-time order (a communicator's collective when its first
        member issues it; ties by the lowest rank, as simpy runs rank processes started at
        one time in rank order), interleaving communicators. That order depends on the draws
        themselves, so the pass is repeated with the order the previous pass produced until
        it reproduces itself (a causal fixed point: the earliest collectives are right after
        the first pass, and each pass fixes at least the next; in practice a few passes).
        After :data:`_MAX_PASSES` it raises :class:`DrawOrderUnsettled` and replay() uses simpy.

        Ties at a later instant (collectives on two communicators created at one time, after
        a wait released their ranks together) are broken the same way, where simpy wakes
        ranks in the order they began to wait. Ranks' compute carries their own noise, so
        that only happens with no jitter (no draws: only the order of the ``collectives``
        list can differ) or a vanishing one (~1e-16, the factors' last bits)."""
        what = f"replay: {self.world:,} ranks, vectorised"
        ranks = np.arange(self.world, dtype=np.int64)
        factors = None
        if self.noise is not None:
            factors = self._factors(self._draws())
        total = self.iterations * (len(self.plans) + 2)

        def tick(done: int, tot: int) -> None:
            if progress is not None:
                progress(done, total + 1, what if self.passes == 0 else
                         f"{what} (pass {self.passes + 1})")

        if progress is not None:
            progress(0, total + 1, what)
        while True:
            rec = Record(self.world, self.iterations, rows=False)
            self._pass(ranks, rec, True, factors, tick)
            self.passes += 1
            steps = list(self.steps.values())
            if not self.multi:
                order = (np.arange(len(steps)), np.zeros(len(steps), dtype=np.int64))
                break
            order = self._creation_order(steps)
            if factors is None or not self._redraw(steps, *order):
                break
            if self.passes >= _MAX_PASSES:
                raise DrawOrderUnsettled(f"the draw order of {self.world} ranks' collectives "
                                         f"did not settle in {_MAX_PASSES} passes")
        self.order = order
        if progress is not None:
            progress(total, total + 1, f"{what}: statistics")
        comm, exposed = comm_figures(list(self.steps.values()), self.scopes, rec)
        tl = ArrayTimeline(self.world, self.iterations, bounds=rec.bounds,
                           forward=rec.forward, backward=rec.backward, optimizer=rec.optimizer,
                           wait=rec.wait, comm=comm, exposed=exposed, lanes=self.lanes)
        if progress is not None:
            progress(total + 1, total + 1, f"{what}: done")
        return tl

    def _creation_order(self, steps: list[Step]) -> tuple[np.ndarray, np.ndarray]:
        """Every (step index, communicator code), in the order the simpy engine creates them."""
        keys_t, keys_r, keys_p, who_s, who_c = [], [], [], [], []
        for i, st in enumerate(steps):
            pres = self.scopes[st.scope].present
            keys_t.append(st.ctime[pres])
            keys_r.append(st.crank[pres])
            keys_p.append(np.full(len(pres), st.pos))
            who_s.append(np.full(len(pres), i))
            who_c.append(pres)
        t, r, p = np.concatenate(keys_t), np.concatenate(keys_r), np.concatenate(keys_p)
        o = np.lexsort((p, r, t))
        return np.concatenate(who_s)[o], np.concatenate(who_c)[o]

    def _redraw(self, steps: list[Step], step_of: np.ndarray, code_of: np.ndarray) -> bool:
        """Give every collective of more than one rank the noise factor of its place in
        creation order; whether any changed."""
        sizes = np.empty(len(step_of), dtype=np.int64)
        for i, st in enumerate(steps):
            m = step_of == i
            sizes[m] = self.scopes[st.scope].size[code_of[m]]
        drawn = sizes > 1
        index = np.cumsum(drawn) - 1
        changed = False
        for i, st in enumerate(steps):
            m = (step_of == i) & drawn
            new = index[m]
            if not np.array_equal(st.draw[code_of[m]], new):
                st.draw[code_of[m]] = new
                changed = True
        return changed
