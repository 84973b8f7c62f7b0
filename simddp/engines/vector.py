"""Replay's vectorised engine: every rank of an SPMD replay advanced as numpy arrays.

All ranks replay the same plan; only their times differ (their profile, speed and noise
draws). So instead of a simpy process per rank (:class:`~simddp.engines.run._Replay`), this
engine walks the plan once — forward compute with the forward collectives at their offsets,
backward with every bucket issued at its ready time after ``plan.pre``, comm hook callbacks
and PowerSGD's stages on the side stream, the end-of-backward wait, post-backward and
optimizer compute, LocalSGD/SlowMo averaging — and each step updates an array over ranks.
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
from ..models import NetworkModel, collective_time, noise
from .plan import BucketPlan, CapturedIteration, Costs
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
        n = len(ranks)
        it_n = self.iterations
        prof = ranks % self.nprof
        s = self.slow[ranks]
        codes = {k: sc.code[ranks] for k, sc in self.scopes.items()}
        free = {k: np.full(sc.ncode, -np.inf) for k, sc in self.scopes.items()}
        seqs = {k: 0 for k in self.scopes}
        side = np.zeros(n)
        now = np.zeros(n)
        pos = [0]
        draws = [0]
        costs, pb = self.costs, self.cap.param_bytes
        total = it_n * (len(self.plans) + 2)
        ticks = 0

        def coll(tag: tuple, scope: str, op: str, nbytes: int, enq: np.ndarray,
                 arrive: np.ndarray, in_backward: bool = False) -> Step:
            """The collective ``tag``: created (full pass) or looked up (rows)."""
            p = pos[0]
            pos[0] += 1
            st = self.steps.get(tag)
            if st is None:
                st = self.steps[tag] = Step(tag, scope, op, nbytes, in_backward, seqs[scope], p)
            seqs[scope] += 1
            if full:
                sc = self.scopes[scope]
                if self.multi:  # creation key: earliest enqueue, then the lowest rank there
                    st.ctime = sc.reduce(np.minimum, enq, np.inf)
                    hit = enq == st.ctime[sc.code]
                    st.crank = sc.reduce(np.minimum, np.where(hit, ranks, self.world),
                                         self.world).astype(np.int64)
                if st.draw is None:  # first pass: plan order, communicators in step
                    st.draw = np.full(sc.ncode, -1, dtype=np.int64)
                    drawn = sc.present[sc.size[sc.present] > 1]
                    st.draw[drawn] = draws[0] + np.arange(len(drawn))
                    draws[0] += len(drawn)
                last = sc.reduce(np.maximum, arrive, -np.inf)
                start = np.maximum(free[scope], last)
                dur = np.zeros(sc.ncode)
                base: dict[int, float] = {}
                for size in np.unique(sc.size[sc.present]).tolist():
                    if size > 1:
                        base[size] = collective_time(self.net, op, nbytes, size)
                for size, t in base.items():
                    m = sc.size == size
                    dur[m] = t if factors is None else t * factors[st.draw[m]]
                st.start, st.end = start, start + dur
                st.end[sc.size == 0] = np.nan
                free[scope] = np.where(sc.size > 0, st.end, free[scope])
            if rec.rows:
                code = codes[scope]
                for i, c in enumerate(code.tolist()):
                    rec.comms[i].append((st, c, float(arrive[i])))
            return st

        def end_of(st: Step, scope: str) -> np.ndarray:
            return st.end[codes[scope]]

        def compute(kind: str, seconds: np.ndarray, label: str | None = None) -> None:
            nonlocal now
            m = seconds > 0
            new = np.where(m, now + seconds, now)
            rec.compute(kind, now, new, label)
            now = new

        def wait(st: Step, scope: str, label: str) -> None:
            nonlocal now
            e = np.maximum(now, end_of(st, scope))
            rec.waited(now, e, label)
            now = e

        for it in range(it_n):
            rec.it = it
            f = (self.noise[ranks, it] if self.noise is not None else np.ones((n, 4)))
            # forward, with the captured forward collectives at their offsets
            scale = s * f[:, 0]
            done = np.zeros(n)
            fwd: dict[int, Step] = {}
            fcs = self.cap.profiles[0].forward_collectives
            for j, (what, k) in enumerate(self.fwd_events):
                dt = self.fwd_offsets[prof, j] * scale - done
                m = dt > 0
                new = np.where(m, now + dt, now)
                rec.compute("forward", now, new)
                now = new
                done = np.where(m, done + dt, done)
                fc = fcs[k]
                if what == 0:
                    fwd[k] = coll(("fwd", it, k), "dp", fc["op"], int(fc["bytes"]), now, now)
                else:
                    wait(fwd[k], "dp", f"wait: {fc['op']}")
            compute("forward", self.p_forward[prof] * scale - done)
            ticks += 1
            # backward: buckets issued in order, each when its last parameter is ready
            scope = "node" if self.period else "dp"
            t_b = now
            scale = s * f[:, 1]
            shift = np.zeros(n)
            target = np.full(n, -np.inf)
            for k, plan in enumerate(self.plans):
                t = t_b + self.p_ready[prof, k] * scale + shift
                now = np.maximum(now, t)
                if plan.pre > 0:
                    pre = plan.pre * scale
                    now = now + pre
                    shift = shift + pre
                issue = now
                if len(plan.stages) > 1:  # the chain: each stage after the last's callback
                    arrive = issue
                    for j, (op, nbytes, cb) in enumerate(plan.stages):
                        st = coll(("b", it, k, j), scope, op, nbytes, issue, arrive, True)
                        s0 = np.maximum(end_of(st, scope), side)
                        side = s0 + cb * scale
                        rec.callback(s0, side)
                        arrive = side
                    val = side
                else:
                    op, nbytes, cb = plan.stages[0]
                    st = coll(("b", it, k, 0), scope, op, nbytes, issue, issue, True)
                    val = end_of(st, scope)
                    cbs = cb * scale
                    m = cbs > 0
                    if m.any():  # the hook's callback on the side stream, in bucket order
                        s0 = np.maximum(side, val)
                        e0 = s0 + cbs
                        if rec.rows:
                            rec.callback(np.where(m, s0, 0.0), np.where(m, e0, 0.0))
                        side = np.where(m, e0, side)
                        val = np.where(m, e0, val)
                target = np.maximum(target, val)
                ticks += 1
            for k, bc in enumerate(self.cap.backward_collectives):
                st = coll(("bwd", it, k), scope, bc["op"], int(bc["bytes"]), now, now)
                target = np.maximum(target, end_of(st, scope))
            end = t_b + self.p_backward[prof] * scale + shift
            now = np.maximum(now, end)
            rec.compute("backward", t_b, now)
            e = np.maximum(now, target)
            rec.waited(now, e, "wait: collectives of backward")
            now = e
            compute("backward", self.p_post[prof] * s * f[:, 2])
            compute("forward", self.p_before[prof] * s * f[:, 2])
            compute("optimizer", self.p_opt[prof] * s * f[:, 3])
            if self.period and it % self.period == 0:
                compute("optimizer", costs.op(2 * pb) * s, "flatten")
                st = coll(("avg", it), "dp", "all_reduce", pb, now, now)
                wait(st, "dp", "wait: model averaging")
                post = costs.op(2 * pb) + costs.op(2 * pb)
                if self.slowmo:
                    post += 4 * costs.op(3 * pb)
                compute("optimizer", post * s, "model averaging")
            rec.bounds[:, it] = now
            ticks += 1
            if progress is not None:
                progress(ticks, total)

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
