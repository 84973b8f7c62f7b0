"""One pass of the vectorised replay over a step program (see
:mod:`simddp.replay.vector_engine`): each instruction (:mod:`simddp.program.steps`) updates
arrays over the pass's ranks, with the same floating-point operations in the same order as the
simpy engine's interpreter (:meth:`~simddp.replay.simpy_engine._Replay.run_instructions`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..models import collective_time
from ..program.steps import Compute, Issue, Memory, Pace, Segment, Wait, WaitAll
from .vector_records import Record, Step

if TYPE_CHECKING:
    from .vector_engine import VectorReplay

__all__ = ["PlanPass"]


class _RowsDraw:
    """Every pass rank's :class:`~simddp.program.steps.Draw` at once (arrays over the ranks):
    their profiles' values, slowness, and this iteration's noise factors ``f``."""

    __slots__ = ("eng", "prof", "slow", "f")

    def __init__(self, eng: VectorReplay, prof: np.ndarray, slow: np.ndarray) -> None:
        self.eng, self.prof, self.slow = eng, prof, slow
        self.f: np.ndarray | None = None

    def pick(self, per_profile: tuple[float, ...]) -> np.ndarray:
        return self.eng.per_profile(per_profile)[self.prof]

    def factor(self, slot: int) -> np.ndarray:
        return self.f[:, slot]


class PlanPass:
    """One pass over the program for ``ranks`` of ``eng``: a full pass creates the
    collectives (``eng.steps``: their creation keys, draw indices, start and end, with the
    noise ``factors``); a rows pass looks them up. Both record into ``rec``. Per rank:
    ``now``, its time; ``side``, its side stream's; ``target``, when what is pending ends."""

    def __init__(self, eng: VectorReplay, ranks: np.ndarray, rec: Record, full: bool,
                 factors: np.ndarray | None) -> None:
        self.eng, self.ranks, self.rec, self.full, self.factors = eng, ranks, rec, full, factors
        self.n = n = len(ranks)
        self.prof = ranks % eng.nprof
        self.s = eng.slow[ranks]
        self.draw = _RowsDraw(eng, self.prof, self.s)
        self.codes = {k: sc.code[ranks] for k, sc in eng.scopes.items()}
        self.free = {k: np.full(sc.ncode, -np.inf) for k, sc in eng.scopes.items()}
        self.seqs = {k: 0 for k in eng.scopes}
        self.side = np.zeros(n)
        self.now = np.zeros(n)
        self.target = np.full(n, -np.inf)
        self.pos = 0  # collectives met so far, in program order
        self.draws = 0  # noise factors handed out (first pass)

    def run(self, progress: Any = None) -> None:
        """Every iteration; ``progress(done, total)`` after each."""
        eng, rec, n = self.eng, self.rec, self.n
        total = sum(eng.units(it) for it in range(eng.iterations))
        ticks = 0
        for it in range(eng.iterations):
            rec.it = it
            f = (eng.noise[self.ranks, it] if eng.noise is not None else np.ones((n, 4)))
            self.run_instructions(it, eng.program.iteration(0, it), f)
            rec.bounds[:, it] = self.now
            ticks += eng.units(it)
            if progress is not None:
                progress(ticks, total)

    def run_instructions(self, it: int, instructions, f: np.ndarray) -> None:
        s, d = self.s, self.draw
        d.f = f
        issued: dict[tuple, Step] = {}
        began = self.now
        for ins in instructions:
            kind = type(ins)
            if kind is Compute:
                self.compute(ins.kind, ins.duration(d), ins.label)
            elif kind is Segment:
                scale = ins.scale(d)
                if ins.anchored:
                    self.anchored(it, ins, scale, issued)
                else:
                    self.sequential(it, ins, scale, issued)
            elif kind is Issue:
                if ins.pre > 0:
                    self.compute(ins.kind, ins.pre_time(s), "comm hook")
                self.issue(it, ins, s, issued)
            elif kind is Wait:
                st = issued[ins.tag]
                self.wait(st, st.scope, ins.label)
            elif kind is WaitAll:
                e = np.maximum(self.now, self.target)
                self.rec.waited(self.now, e, ins.label)
                self.now = e
                self.target = np.full(self.n, -np.inf)
            elif kind is Pace:  # as the simpy engine: the clock jumps to the target exactly
                new = np.maximum(self.now, ins.until(began))
                self.rec.compute("host", self.now, new, ins.label)
                self.now = new
            elif kind is not Memory:  # pragma: no cover - a planner's bug
                raise TypeError(f"not an instruction: {ins!r}")

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
        for size, per_node, m in sc.shapes:  # the simpy engine's call, per size and placement
            t = collective_time(self.eng.net, op, nbytes, size, per_node)
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

    # -- instructions ------------------------------------------------------------------------
    def sequential(self, it: int, seg: Segment, scale: np.ndarray, issued: dict) -> None:
        """A segment whose marks sit at compute offsets (waits excluded)."""
        rec, d = self.rec, self.draw
        done = np.zeros(self.n)
        for mk in seg.marks:
            if mk.at is not None:
                dt = mk.offset(d, scale) - done
                m = dt > 0
                new = np.where(m, self.now + dt, self.now)
                rec.compute(seg.kind, self.now, new)
                self.now = new
                done = np.where(m, done + dt, done)
            do = mk.do
            if type(do) is Issue:
                if do.pre > 0:
                    self.compute(seg.kind, do.pre_time(scale), "comm hook")
                self.issue(it, do, scale, issued)
            elif type(do) is Wait:
                st = issued[do.tag]
                self.wait(st, st.scope, do.label)
        self.compute(seg.kind, seg.length(d, scale) - done)

    def anchored(self, it: int, seg: Segment, scale: np.ndarray, issued: dict) -> None:
        """A segment whose marks sit at times since its start, shifted by the work issued
        before them."""
        d = self.draw
        t_b = self.now
        shift = np.zeros(self.n)
        for mk in seg.marks:
            if mk.at is not None:
                t = t_b + mk.offset(d, scale) + shift
                self.now = np.maximum(self.now, t)
            do = mk.do
            if type(do) is Issue:
                if do.pre > 0:
                    pre = do.pre_time(scale)
                    self.now = self.now + pre
                    shift = shift + pre
                self.issue(it, do, scale, issued)
            elif type(do) is Wait:
                st = issued[do.tag]
                self.wait(st, st.scope, do.label)
        end = t_b + seg.length(d, scale) + shift
        self.now = np.maximum(self.now, end)
        self.rec.compute(seg.kind, t_b, self.now)

    def issue(self, it: int, issue: Issue, scale: np.ndarray, issued: dict) -> None:
        """Collectives issued now: pending ones raise ``target``; others are waited for by
        tag."""
        if len(issue.stages) > 1:
            val = self.chained(it, issue, scale)
        else:
            st, val = self.single(it, issue, scale)
            if not issue.pending:
                issued[issue.first.tag] = st
                return
        self.target = np.maximum(self.target, val)

    def chained(self, it: int, issue: Issue, scale: np.ndarray) -> np.ndarray:
        """A chained (PowerSGD) issue: each stage after the last's callback on the side
        stream. Returns when its last callback ends."""
        arrive = issue_t = self.now
        for j, (c, _) in enumerate(issue.stages):
            st = self.coll((c.tag[0], it, *c.tag[1:]), c.scope, c.op, c.nbytes, issue_t,
                           arrive, c.in_backward)
            s0 = np.maximum(self.end_of(st, c.scope), self.side)
            self.side = s0 + issue.callback_time(j, scale)
            self.rec.callback(s0, self.side)
            arrive = self.side
        return self.side

    def single(self, it: int, issue: Issue, scale: np.ndarray) -> tuple[Step, np.ndarray]:
        """A single-stage issue, and its callback on the side stream (in issue order).
        Returns the collective and when its value is ready."""
        c = issue.first
        now = self.now
        st = self.coll((c.tag[0], it, *c.tag[1:]), c.scope, c.op, c.nbytes, now, now,
                       c.in_backward)
        val = self.end_of(st, c.scope)
        cbs = issue.callback_time(0, scale)
        m = cbs > 0
        if m.any():
            s0 = np.maximum(self.side, val)
            e0 = s0 + cbs
            if self.rec.rows:
                self.rec.callback(np.where(m, s0, 0.0), np.where(m, e0, 0.0))
            self.side = np.where(m, e0, self.side)
            val = np.where(m, e0, val)
        return st, val
