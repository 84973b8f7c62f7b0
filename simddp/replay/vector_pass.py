"""One pass of the vectorised replay over the plan (see :mod:`simddp.replay.vector_engine`), phase by
phase: forward with the forward collectives at their offsets; backward with every bucket issued
at its ready time after ``plan.pre`` and the hooks' callbacks (or PowerSGD's chained stages) on
the side stream, then the end-of-backward wait; post-backward and optimizer compute with the
LocalSGD/SlowMo averaging. Each phase updates arrays over the pass's ranks, with the same
floating-point operations in the same order as the simpy engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..models import collective_time
from ..program.captured import BucketPlan
from .vector_records import Record, Step

if TYPE_CHECKING:
    from .vector_engine import VectorReplay

__all__ = ["PlanPass"]


class PlanPass:
    """One pass over the plan for ``ranks`` of ``eng``: a full pass creates the collectives
    (``eng.steps``: their creation keys, draw indices, start and end, with the noise
    ``factors``); a rows pass looks them up. Both record into ``rec``. Per rank: ``now``, its
    time; ``side``, its side stream's."""

    def __init__(self, eng: VectorReplay, ranks: np.ndarray, rec: Record, full: bool,
                 factors: np.ndarray | None) -> None:
        self.eng, self.ranks, self.rec, self.full, self.factors = eng, ranks, rec, full, factors
        self.n = n = len(ranks)
        self.prof = ranks % eng.nprof
        self.s = eng.slow[ranks]
        self.codes = {k: sc.code[ranks] for k, sc in eng.scopes.items()}
        self.free = {k: np.full(sc.ncode, -np.inf) for k, sc in eng.scopes.items()}
        self.seqs = {k: 0 for k in eng.scopes}
        self.side = np.zeros(n)
        self.now = np.zeros(n)
        self.pos = 0  # collectives met so far, in plan order
        self.draws = 0  # noise factors handed out (first pass)

    def run(self, progress: Any = None) -> None:
        """Every iteration; ``progress(done, total)`` after each."""
        eng, rec, n = self.eng, self.rec, self.n
        total = eng.iterations * (len(eng.plans) + 2)
        ticks = 0
        for it in range(eng.iterations):
            rec.it = it
            f = (eng.noise[self.ranks, it] if eng.noise is not None else np.ones((n, 4)))
            self.forward(it, self.s * f[:, 0])
            ticks += 1
            self.backward(it, self.s * f[:, 1])
            ticks += len(eng.plans)
            self.tail(it, f)
            rec.bounds[:, it] = self.now
            ticks += 1
            if progress is not None:
                progress(ticks, total)

    # -- collectives ---------------------------------------------------------------------------
    def coll(self, tag: tuple, scope: str, op: str, nbytes: int, enq: np.ndarray,
             arrive: np.ndarray, in_backward: bool = False) -> Step:
        """The collective ``tag``: created (full pass) or looked up (rows)."""
        eng = self.eng
        p = self.pos
        self.pos += 1
        st = eng.steps.get(tag)
        if st is None:
            st = eng.steps[tag] = Step(tag, scope, op, nbytes, in_backward, self.seqs[scope], p)
        self.seqs[scope] += 1
        if self.full:
            self._create(st, scope, enq)
            self._time(st, scope, op, nbytes, arrive)
        if self.rec.rows:
            code = self.codes[scope]
            for i, c in enumerate(code.tolist()):
                self.rec.comms[i].append((st, c, float(arrive[i])))
        return st

    def _create(self, st: Step, scope: str, enq: np.ndarray) -> None:
        """The collective's creation key per communicator, and (first pass) its draw indices."""
        sc = self.eng.scopes[scope]
        if self.eng.multi:  # creation key: earliest enqueue, then the lowest rank there
            world = self.eng.world
            st.ctime = sc.reduce(np.minimum, enq, np.inf)
            hit = enq == st.ctime[sc.code]
            st.crank = sc.reduce(np.minimum, np.where(hit, self.ranks, world),
                                 world).astype(np.int64)
        if st.draw is None:  # first pass: plan order, communicators in step
            st.draw = np.full(sc.ncode, -1, dtype=np.int64)
            drawn = sc.present[sc.size[sc.present] > 1]
            st.draw[drawn] = self.draws + np.arange(len(drawn))
            self.draws += len(drawn)

    def _time(self, st: Step, scope: str, op: str, nbytes: int, arrive: np.ndarray) -> None:
        """The collective's start and end per communicator: after its last member arrives and
        the communicator's previous collective ends, for the network's time times its noise."""
        sc = self.eng.scopes[scope]
        factors = self.factors
        last = sc.reduce(np.maximum, arrive, -np.inf)
        start = np.maximum(self.free[scope], last)
        dur = np.zeros(sc.ncode)
        base: dict[int, float] = {}
        for size in np.unique(sc.size[sc.present]).tolist():
            if size > 1:
                base[size] = collective_time(self.eng.net, op, nbytes, size)
        for size, t in base.items():
            m = sc.size == size
            dur[m] = t if factors is None else t * factors[st.draw[m]]
        st.start, st.end = start, start + dur
        st.end[sc.size == 0] = np.nan
        self.free[scope] = np.where(sc.size > 0, st.end, self.free[scope])

    def end_of(self, st: Step, scope: str) -> np.ndarray:
        return st.end[self.codes[scope]]

    # -- a rank's time -------------------------------------------------------------------------
    def compute(self, kind: str, seconds: np.ndarray, label: str | None = None) -> None:
        m = seconds > 0
        new = np.where(m, self.now + seconds, self.now)
        self.rec.compute(kind, self.now, new, label)
        self.now = new

    def wait(self, st: Step, scope: str, label: str) -> None:
        e = np.maximum(self.now, self.end_of(st, scope))
        self.rec.waited(self.now, e, label)
        self.now = e

    # -- the phases of an iteration ------------------------------------------------------------
    def forward(self, it: int, scale: np.ndarray) -> None:
        """Forward, with the captured forward collectives at their offsets."""
        eng, rec, prof = self.eng, self.rec, self.prof
        done = np.zeros(self.n)
        fwd: dict[int, Step] = {}
        fcs = eng.cap.profiles[0].forward_collectives
        for j, (what, k) in enumerate(eng.fwd_events):
            dt = eng.fwd_offsets[prof, j] * scale - done
            m = dt > 0
            new = np.where(m, self.now + dt, self.now)
            rec.compute("forward", self.now, new)
            self.now = new
            done = np.where(m, done + dt, done)
            fc = fcs[k]
            if what == 0:
                fwd[k] = self.coll(("fwd", it, k), "dp", fc["op"], int(fc["bytes"]), self.now,
                                   self.now)
            else:
                self.wait(fwd[k], "dp", f"wait: {fc['op']}")
        self.compute("forward", eng.p_forward[prof] * scale - done)

    def backward(self, it: int, scale: np.ndarray) -> None:
        """Backward: buckets issued in order, each when its last parameter is ready (after
        ``plan.pre``); the collectives after backward; the wait for all of them."""
        eng, rec, prof = self.eng, self.rec, self.prof
        scope = "node" if eng.period else "dp"
        t_b = self.now
        shift = np.zeros(self.n)
        target = np.full(self.n, -np.inf)
        for k, plan in enumerate(eng.plans):
            t = t_b + eng.p_ready[prof, k] * scale + shift
            self.now = np.maximum(self.now, t)
            if plan.pre > 0:
                pre = plan.pre * scale
                self.now = self.now + pre
                shift = shift + pre
            if len(plan.stages) > 1:
                val = self.chained(it, k, plan, scope, scale)
            else:
                val = self.bucket(it, k, plan, scope, scale)
            target = np.maximum(target, val)
        for k, bc in enumerate(eng.cap.backward_collectives):
            st = self.coll(("bwd", it, k), scope, bc["op"], int(bc["bytes"]), self.now,
                           self.now)
            target = np.maximum(target, self.end_of(st, scope))
        end = t_b + eng.p_backward[prof] * scale + shift
        self.now = np.maximum(self.now, end)
        rec.compute("backward", t_b, self.now)
        e = np.maximum(self.now, target)
        rec.waited(self.now, e, "wait: collectives of backward")
        self.now = e

    def chained(self, it: int, k: int, plan: BucketPlan, scope: str, scale: np.ndarray
                ) -> np.ndarray:
        """A chained (PowerSGD) bucket issued now: each stage after the last's callback on the
        side stream. Returns when its last callback ends."""
        issue = arrive = self.now
        for j, (op, nbytes, cb) in enumerate(plan.stages):
            st = self.coll(("b", it, k, j), scope, op, nbytes, issue, arrive, True)
            s0 = np.maximum(self.end_of(st, scope), self.side)
            self.side = s0 + cb * scale
            self.rec.callback(s0, self.side)
            arrive = self.side
        return self.side

    def bucket(self, it: int, k: int, plan: BucketPlan, scope: str, scale: np.ndarray
               ) -> np.ndarray:
        """A single-stage bucket issued now, and the hook's callback on the side stream (in
        bucket order). Returns when the bucket's value is ready."""
        issue = self.now
        op, nbytes, cb = plan.stages[0]
        st = self.coll(("b", it, k, 0), scope, op, nbytes, issue, issue, True)
        val = self.end_of(st, scope)
        cbs = cb * scale
        m = cbs > 0
        if m.any():
            s0 = np.maximum(self.side, val)
            e0 = s0 + cbs
            if self.rec.rows:
                self.rec.callback(np.where(m, s0, 0.0), np.where(m, e0, 0.0))
            self.side = np.where(m, e0, self.side)
            val = np.where(m, e0, val)
        return val

    def tail(self, it: int, f: np.ndarray) -> None:
        """Post-backward, before-step and optimizer compute; LocalSGD/SlowMo averaging."""
        eng, s, prof = self.eng, self.s, self.prof
        self.compute("backward", eng.p_post[prof] * s * f[:, 2])
        self.compute("forward", eng.p_before[prof] * s * f[:, 2])
        self.compute("optimizer", eng.p_opt[prof] * s * f[:, 3])
        if eng.period and it % eng.period == 0:
            self.average(it)

    def average(self, it: int) -> None:
        """LocalSGD/SlowMo's model averaging: flatten, all_reduce, unflatten (and SlowMo)."""
        costs, pb, s = self.eng.costs, self.eng.cap.param_bytes, self.s
        self.compute("optimizer", costs.op(2 * pb) * s, "flatten")
        st = self.coll(("avg", it), "dp", "all_reduce", pb, self.now, self.now)
        self.wait(st, "dp", "wait: model averaging")
        post = costs.op(2 * pb) + costs.op(2 * pb)
        if self.eng.slowmo:
            post += 4 * costs.op(3 * pb)
        self.compute("optimizer", post * s, "model averaging")
