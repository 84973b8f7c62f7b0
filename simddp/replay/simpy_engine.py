"""Replay's simpy engine: a step program (:mod:`simddp.program`) run on one simpy environment.

:class:`SimpyReplay`: every rank (or one representative per class of identical ranks,
:mod:`~simddp.replay.classes`) a simpy process that interprets its instructions, every
collective a process on its communicator, on one :class:`~simddp.core.Fabric`.
:func:`~simddp.replay.replaying.replay` plans the program and picks this engine or the
vectorised one (:mod:`~simddp.replay.vector_engine`). The result's figures come from its
:class:`~simddp.Timeline`. Its parts: :mod:`~simddp.replay.communicators` (collectives on
communicators), :mod:`~simddp.replay.contention_clock` (compute slowed while communicating),
:mod:`~simddp.replay.replay_lane` (a lane's record).
"""

from __future__ import annotations

import gc
from typing import Any, Sequence

import simpy

from ..analysis import PerRank, Timeline
from ..core import CollectiveProcess, Fabric, at
from ..models import noise
from ..program.knobs import CheckedKnobs
from ..program.steps import Compute, Instruction, Issue, Memory, Pace, Segment, Wait, WaitAll
from .classes import classes as _classes
from .communicators import Communicators
from .contention_clock import ContentionClock
from .replay_lane import ReplayLane

__all__ = ["SimpyReplay"]

_NO_NOISE = (1.0, 1.0, 1.0, 1.0)


class _LaneDraw:
    """One lane's :class:`~simddp.program.steps.Draw` in one iteration: its profile ``p``,
    slowness and noise factors."""

    __slots__ = ("p", "slow", "f")

    def __init__(self, p: int, slow: float, f: Sequence[float]) -> None:
        self.p, self.slow, self.f = p, slow, f

    def pick(self, per_profile: Sequence[float]) -> float:
        return per_profile[self.p]

    def factor(self, slot: int) -> float:
        return self.f[slot]


def tagged(tag: tuple, it: int | None) -> tuple:
    """A program collective's tag in iteration ``it``: the iteration after its first word."""
    return tag if it is None else (tag[0], it, *tag[1:])


class SimpyReplay(Communicators, ContentionClock):
    """One replay: every rank a simpy process on one :class:`Fabric`."""

    def __init__(self, program: Any, checked: CheckedKnobs, *, classes: bool = True) -> None:
        self.program = program
        self.world, self.net = world, net = checked.world, checked.network
        self.mesh = program.mesh
        self.fabric = Fabric()
        self.env = self.fabric.env
        self.iterations = iterations = program.iterations
        self.nprof = program.nprofiles
        jitter = checked.knobs.jitter
        speeds = checked.speeds
        # Equivalence classes: ranks that nothing distinguishes (profile, speed, instructions,
        # communicators where they matter, noise) follow identical trajectories, so one
        # representative lane per class is simulated (see _classes).
        code, width = self.mesh.class_code(self.nprof)
        place, kinds = self.mesh.placement_code(net)  # costed differently
        rank_class, reps = _classes(world, (code + width * place, width * kinds), speeds,
                                    program.rank_kinds(), jitter > 0, classes)
        self.rank_class = rank_class  # numpy int array per rank, or None: lane r is rank r
        self.rep: list[int] | range = reps  # per lane: its representative (lowest) rank
        nl = self.nlanes = len(reps)
        self.slow = [1.0 / speeds.get(r, 1.0) for r in reps]
        # per rank and iteration, one factor per noise slot; one per collective
        self.noise = None
        self.net_noise: noise.Stream | None = None
        if jitter > 0:  # every rank draws its own factors: lanes are ranks (see _classes)
            self.noise = noise.lognormal(noise.generator(checked.knobs.seed, 0), jitter,
                                         (world, iterations, 4))
            self.net_noise = noise.Stream(noise.generator(checked.knobs.seed, 1), jitter)
        self._init_communicators(reps)
        self.side = [0.0] * nl
        self.spans: list[list[tuple[str, float, float, str]]] = [[] for _ in range(nl)]
        self.comms: list[list[tuple[CollectiveProcess, float]]] = [[] for _ in range(nl)]
        self.bounds: list[list[float]] = [[] for _ in range(nl)]
        self.ticks = 0  # progress: segments ended, collectives issued, iterations ended
        self._init_contention(net, nl)  # compute slowed while communicating

    # -- time on a lane ----------------------------------------------------------------------
    def compute(self, r: int, kind: str, seconds: float, label: str | None = None):
        if seconds > 0:
            start = self.env.now
            if self.slowed:
                yield from self._work(r, seconds)
            else:
                yield self.env.timeout(seconds)  # lands on start + seconds exactly
            self._span(r, kind, start, self.env.now, label or kind)

    def _span(self, r: int, kind: str, s: float, e: float, label: str) -> None:
        if e > s:
            self.spans[r].append((kind, s, e, label))

    def wait(self, r: int, c: CollectiveProcess, label: str):
        if c.end is None:
            start = self.env.now
            yield c.done
            self._span(r, "wait", start, self.env.now, label)

    def wait_all(self, r: int, pending: list, label: str):
        env = self.env
        start = env.now
        target = start
        for item in pending:
            if isinstance(item, tuple):
                c, cb = item
                if c.end is None:
                    yield c.done
                end = c.end
                if cb > 0:
                    s = max(self.side[r], end)
                    self.side[r] = end = s + cb
                    self._span(r, "callback", s, end, "callback (side stream)")
            else:
                if item.callbacks is not None:  # a chain process still running
                    yield item
                end = item.value
            if end > target:
                target = end
        if target > env.now:
            yield at(env, target)
        self._span(r, "wait", start, env.now, label)

    def chain(self, r: int, issue: Issue, colls: list[CollectiveProcess], scale: float):
        """A multi-stage issue's future chain (PowerSGD) on rank r's side stream: each
        stage's callback runs after its collective, and issues (arrives at) the next stage's
        collective, which :meth:`issue` already enqueued in program order."""
        env = self.env
        for j, c in enumerate(colls):
            if j:
                self.arrive(r, c)
            if c.end is None:
                yield c.done
            s = max(env.now, self.side[r])
            e = self.side[r] = s + issue.callback_time(j, scale)
            self._span(r, "callback", s, e, "callback (side stream)")
            if e > env.now:
                yield at(env, e)
        return env.now

    def issue(self, r: int, it: int | None, issue: Issue, scale: float, pending: list,
              issued: dict) -> None:
        # A comm hook runs when the Reducer issues its bucket, and with NCCL the hook's futures
        # complete as soon as their collectives are enqueued, so the whole then-chain
        # (PowerSGD: the P and Q all_reduces) is enqueued on the communicator right away,
        # before the next bucket's all_reduce; on the device each stage still waits for the
        # previous stage's callback (stream dependency). So every stage takes its sequence
        # number now, and arrives when its callback has run: the next bucket's collectives can
        # never overtake this one's P/Q all_reduces on the communicator (co-simulation, where
        # fakepg runs the callbacks inline, gives the same order).
        colls = [self.enqueue(r, tagged(c.tag, it), c.scope, c.op, c.nbytes, c.in_backward)
                 for c, _ in issue.stages]
        first = self.arrive(r, colls[0])
        self.ticks += 1
        if not issue.pending:
            issued[issue.first.tag] = first
        elif len(issue.stages) > 1:
            pending.append(self.env.process(self.chain(r, issue, colls, scale)))
        else:
            pending.append((first, issue.callback_time(0, scale)))

    # -- the interpreter -------------------------------------------------------------------
    def run_instructions(self, r: int, it: int | None, instructions: Sequence[Instruction]):
        """Lane r runs ``instructions`` (iteration ``it``; None: the epilogue)."""
        s = self.slow[r]
        d = _LaneDraw(self.rep[r] % self.nprof, s,
                      self.noise[r, it].tolist() if self.noise is not None and it is not None
                      else _NO_NOISE)
        pending: list = []
        issued: dict[tuple, CollectiveProcess] = {}
        began = self.env.now
        for ins in instructions:
            kind = type(ins)
            if kind is Compute:
                yield from self.compute(r, ins.kind, ins.duration(d), ins.label)
            elif kind is Segment:
                scale = ins.scale(d)
                if not ins.anchored:
                    yield from self.sequential(r, it, d, ins, scale, pending, issued)
                elif self.slowed:
                    yield from self.anchored_as_work(r, it, d, ins, scale, pending, issued)
                else:
                    yield from self.anchored(r, it, d, ins, scale, pending, issued)
            elif kind is Issue:
                if ins.pre > 0:
                    yield from self.compute(r, ins.kind, ins.pre_time(s), "comm hook")
                if ins.costed:
                    yield from self.issue_cost(r, ins.kind, ins.label or "issue")
                self.issue(r, it, ins, s, pending, issued)
            elif kind is Wait:
                yield from self.wait(r, issued[ins.tag], ins.label)
            elif kind is WaitAll:
                yield from self.wait_all(r, pending, ins.label)
                pending = []
            elif kind is Pace:
                start, target = self.env.now, ins.until(began)
                if target > start:
                    yield at(self.env, target)
                    self._span(r, "host", start, self.env.now, ins.label)
            elif kind is not Memory:  # pragma: no cover - a planner's bug
                raise TypeError(f"not an instruction: {ins!r}")

    def sequential(self, r: int, it: int | None, d: _LaneDraw, seg: Segment, scale: float,
                   pending: list, issued: dict):
        """A segment whose marks sit at compute offsets (waits excluded)."""
        done = 0.0
        for mk in seg.marks:
            if mk.at is not None:
                dt = mk.offset(d, scale) - done
                if dt > 0:
                    yield from self.compute(r, seg.kind, dt)
                    done += dt
            do = mk.do
            if type(do) is Issue:
                if do.pre > 0:
                    yield from self.compute(r, seg.kind, do.pre_time(scale), "comm hook")
                if do.costed:
                    yield from self.issue_cost(r, seg.kind, do.label or "issue")
                self.issue(r, it, do, scale, pending, issued)
            elif type(do) is Wait:
                yield from self.wait(r, issued[do.tag], do.label)
        yield from self.compute(r, seg.kind, seg.length(d, scale) - done)
        self.ticks += 1

    def anchored(self, r: int, it: int | None, d: _LaneDraw, seg: Segment, scale: float,
                 pending: list, issued: dict):
        """A segment whose marks sit at times since its start (grad-ready times), shifted
        by the work issued before them (comm hooks, issue costs)."""
        env = self.env
        ic = self.issue_s  # the contention's cost of issuing a collective (0: none)
        t_b = env.now
        shift = 0.0
        for mk in seg.marks:
            if mk.at is not None:
                t = t_b + mk.offset(d, scale) + shift
                if t > env.now:
                    yield at(env, t)
            do = mk.do
            if type(do) is Issue:
                c = ic if do.costed else 0.0
                if do.pre > 0 or c > 0:
                    pre = do.pre_time(scale) + c
                    yield env.timeout(pre)
                    shift += pre
                self.issue(r, it, do, scale, pending, issued)
            elif type(do) is Wait:
                yield from self.wait(r, issued[do.tag], do.label)
        end = t_b + seg.length(d, scale) + shift
        if end > env.now:
            yield at(env, end)
        self._span(r, seg.kind, t_b, env.now, seg.kind)

    def anchored_as_work(self, r: int, it: int | None, d: _LaneDraw, seg: Segment,
                         scale: float, pending: list, issued: dict):
        """An anchored segment as work, slowed while the lane's collectives run (contention)."""
        env = self.env
        ic = self.issue_s
        t_b = env.now
        work = 0.0
        for mk in seg.marks:
            if mk.at is not None:
                target = mk.offset(d, scale)
                if target > work:
                    yield from self._work(r, target - work)
                    work = target
            do = mk.do
            if type(do) is Issue:
                if do.pre > 0:
                    yield from self._work(r, do.pre_time(scale))
                if ic > 0 and do.costed:
                    yield env.timeout(ic)
                self.issue(r, it, do, scale, pending, issued)
            elif type(do) is Wait:
                yield from self.wait(r, issued[do.tag], do.label)
        total = seg.length(d, scale)
        if total > work:
            yield from self._work(r, total - work)
        self._span(r, seg.kind, t_b, env.now, seg.kind)

    def rank(self, r: int):
        rank = self.rep[r]
        program = self.program
        for it in range(self.iterations):
            yield from self.run_instructions(r, it, program.iteration(rank, it))
            self.bounds[r].append(self.env.now)
            self.ticks += 1
        epilogue = program.epilogue(rank)
        if epilogue:
            yield from self.run_instructions(r, None, epilogue)
            if self.bounds[r]:
                self.bounds[r][-1] = self.env.now

    def _total_ticks(self) -> int:
        """Progress units of the whole run (what :attr:`ticks` counts)."""
        def units(ins: Sequence[Instruction]) -> int:
            n = 0
            for x in ins:
                if type(x) is Issue:
                    n += 1
                elif type(x) is Segment:
                    n += sum(type(m.do) is Issue for m in x.marks) + (not x.anchored)
            return n
        cache: dict[int, int] = {}
        total = 0
        for r in self.rep:
            for it in range(self.iterations):
                ins = self.program.iteration(r, it)
                if id(ins) not in cache:
                    cache[id(ins)] = units(ins) + 1
                total += cache[id(ins)]
            total += units(self.program.epilogue(r))
        return total

    def run(self, progress: Any = None) -> Timeline:
        """Run every lane to its end; returns the timeline, its figures computed.
        ``progress(done, total, description)``, if given, hears how far it got."""
        # The cyclic garbage collector would rescan the many live events and generators of a
        # large world again and again (2-3x the run time at 4096 ranks); it is paused while the
        # simulation runs and the timeline computes its figures, and restored after.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            nl = self.nlanes
            what = (f"replay: {self.world:,} ranks" if nl == self.world else
                    f"replay: {self.world:,} ranks as {nl:,} classes")
            for r in range(nl):
                self.env.process(self.rank(r))
            if progress is None:
                self.env.run()
            else:
                # per lane and iteration: forward end, each bucket issued, iteration end
                total = self._total_ticks() + nl
                progress(0, total, what)
                step, every = self.env.step, max(1024, total // 200)
                try:
                    while True:
                        for _ in range(every):
                            step()
                        progress(self.ticks, total, what)
                except simpy.core.EmptySchedule:
                    pass
            unfinished = [r for r in range(nl) if len(self.bounds[r]) < self.iterations]
            if unfinished:  # pragma: no cover - a bug in the model, not a user error
                raise RuntimeError(f"replay deadlocked: ranks {[self.rep[r] for r in unfinished[:8]]} "
                                   f"did not finish")
            timeline = self.timeline()
            if progress is not None:  # the figures, lane by lane
                done = total - nl
                timeline.compute_figures(
                    lambda k: progress(done + k, total, f"{what}: statistics"))
            timeline.iteration_times(), timeline.exposed_comm()  # (cached)
            if progress is not None:
                progress(total, total, f"{what}: done")
        finally:
            if was_enabled:
                gc.enable()
        return timeline

    def timeline(self) -> Timeline:
        lanes = [ReplayLane(self.spans[r], self.comms[r], self.bounds[r],
                             self.bounds[r][-1] if self.bounds[r] else 0.0)
                 for r in range(self.nlanes)]
        if self.rank_class is None:
            return Timeline.from_lanes(lanes)
        return Timeline.from_classes(lanes, self.rank_class, list(self.rep))

    def per_rank(self, values: list) -> list | PerRank:
        """Per-lane values as per-rank values (a compact :class:`PerRank` for classes)."""
        return values if self.rank_class is None else PerRank(values, self.rank_class)
