"""Replay's simpy engine: a captured DDP iteration replayed on one simpy environment.

:class:`_Replay`: every rank (or one representative per class of identical ranks,
:mod:`~simddp.replay.classes`) a simpy process on one :class:`~simddp.core.Fabric`,
every collective a process on its communicator. :func:`~simddp.replay.replaying.replay`
checks the knobs and picks this engine or the vectorised one
(:mod:`~simddp.replay.vector_engine`). The model and every knob are described in
:mod:`simddp.replay`. The result's figures come from its :class:`~simddp.Timeline`.
Its parts: :mod:`~simddp.replay.communicators` (collectives on communicators),
:mod:`~simddp.replay.contention_clock` (compute slowed while communicating),
:mod:`~simddp.replay.replay_lane` (a lane's record).
"""

from __future__ import annotations

import gc
from typing import Any

import simpy

from ..analysis import PerRank, Timeline
from ..models import NetworkModel, noise
from .classes import classes as _classes
from .communicators import _Communicators
from .contention_clock import _ContentionClock
from ..core import CollectiveProcess, Fabric, at
from ..program.captured import BucketPlan, CapturedIteration, Costs
from .replay_lane import _ReplayLane

__all__ = ["_Replay"]


def _forward_events(cap: CapturedIteration) -> list[list[tuple[float, int, int]]]:
    """Per profile: its forward collectives' issues (0) and waits (1) by compute offset."""
    out = []
    for prof in cap.profiles:
        ev = []
        for k, fc in enumerate(prof.forward_collectives):
            ev.append((float(fc["offset"]), 0, k))
            if fc.get("wait_at") is not None:
                ev.append((float(fc["wait_at"]), 1, k))
        out.append(sorted(ev))
    return out


def _ready_times(cap: CapturedIteration, plans: list[BucketPlan]) -> list[list[float]]:
    """Per profile: when each bucket is ready, relative to backward start (speed 1)."""
    out = []
    for prof in cap.profiles:
        rd = [0.0 if t is None else float(t) for t in prof.ready]
        out.append([max((rd[i] for i in p.params), default=0.0) for p in plans])
    return out


class _Replay(_Communicators, _ContentionClock):
    """One replay: every rank a simpy process on one :class:`Fabric`."""

    def __init__(self, cap: CapturedIteration, world: int, net: NetworkModel, *, buckets, plans,
                 speeds, jitter, seed, period, slowmo, uneven, iterations, groups,
                 shared_nic, costs: Costs, classes: bool = True) -> None:
        self.cap, self.world, self.net = cap, world, net
        self.fabric = Fabric()
        self.env = self.fabric.env
        self.plans: list[BucketPlan] = plans
        self.period, self.slowmo = period, slowmo
        self.iterations = iterations
        self.costs = costs
        self.groups = groups
        self.nprof = len(cap.profiles)
        gpn = net.gpus_per_node or 1
        self.gpn = gpn
        self.group_size = world // groups
        # Equivalence classes: ranks that nothing distinguishes (profile, speed, iteration
        # count, DDP group, node where node subgroups are used, noise) follow identical
        # trajectories, so one representative lane per class is simulated (see _classes).
        rank_class, reps = _classes(world, self.nprof, speeds, uneven, groups,
                                    gpn if period else 0, jitter > 0, classes)
        self.rank_class = rank_class  # numpy int array per rank, or None: lane r is rank r
        self.rep: list[int] | range = reps  # per lane: its representative (lowest) rank
        nl = self.nlanes = len(reps)
        self.slow = [1.0 / speeds.get(r, 1.0) for r in reps]
        self.counts = [uneven.get(r, iterations) for r in reps] if uneven else None
        self.join = bool(uneven)
        # per rank and iteration, one factor per compute segment; one per collective
        self.noise = None
        self.net_noise: noise.Stream | None = None
        if jitter > 0:  # every rank draws its own factors: lanes are ranks (see _classes)
            self.noise = noise.lognormal(noise.generator(seed, 0), jitter,
                                         (world, iterations, 4))
            self.net_noise = noise.Stream(noise.generator(seed, 1), jitter)
        self.forward_events = _forward_events(cap)
        self.ready = _ready_times(cap, plans)
        self._init_communicators(reps, shared_nic)
        self.side = [0.0] * nl
        self.spans: list[list[tuple[str, float, float, str]]] = [[] for _ in range(nl)]
        self.comms: list[list[tuple[CollectiveProcess, float]]] = [[] for _ in range(nl)]
        self.bounds: list[list[float]] = [[] for _ in range(nl)]
        self.ticks = 0  # progress: forward ends, buckets issued, iteration ends
        self.param_bytes = cap.param_bytes
        self._init_contention(net, nl)  # compute slowed while communicating

    # -- rank processes ----------------------------------------------------------------------
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

    def chain(self, r: int, plan: BucketPlan, colls: list[CollectiveProcess], scale: float):
        """A multi-stage comm hook's future chain (PowerSGD) on rank r's side stream: each
        stage's callback runs after its collective, and issues (arrives at) the next stage's
        collective, which :meth:`issue_bucket` already enqueued in program order."""
        env = self.env
        for j, ((_, _, cb), c) in enumerate(zip(plan.stages, colls)):
            if j:
                self.arrive(r, c)
            if c.end is None:
                yield c.done
            s = max(env.now, self.side[r])
            e = self.side[r] = s + cb * scale
            self._span(r, "callback", s, e, "callback (side stream)")
            if e > env.now:
                yield at(env, e)
        return env.now

    def issue_bucket(self, r: int, it: int, k: int, plan: BucketPlan, scale: float, scope: str,
                     pending: list) -> None:
        # The Reducer runs bucket k's comm hook when it issues the bucket, and with NCCL the
        # hook's futures complete as soon as their collectives are enqueued, so the whole
        # then-chain (PowerSGD: the P and Q all_reduces) is enqueued on the communicator right
        # away, before bucket k + 1's all_reduce; on the device each stage still waits for the
        # previous stage's callback (stream dependency). So every stage takes its sequence
        # number now, and arrives when its callback has run: bucket k + 1's collectives can
        # never overtake bucket k's P/Q all_reduces on the communicator (co-simulation, where
        # fakepg runs the callbacks inline, gives the same order).
        colls = [self.enqueue(r, ("b", it, k, j), scope, op, nbytes, True)
                 for j, (op, nbytes, _) in enumerate(plan.stages)]
        first = self.arrive(r, colls[0])
        self.ticks += 1
        if len(plan.stages) > 1:
            pending.append(self.env.process(self.chain(r, plan, colls, scale)))
        else:
            pending.append((first, plan.stages[0][2] * scale))

    def train(self, r: int, it: int):
        p = self.rep[r] % self.nprof
        prof = self.cap.profiles[p]
        s = self.slow[r]
        f = self.noise[r, it].tolist() if self.noise is not None else (1.0, 1.0, 1.0, 1.0)
        pending: list = []
        if self.join:  # Join.notify_join_context and DDP's requires-grad-sync, async
            yield from self.issue_cost(r, "forward", "issue: join")
            pending.append((self.issue(r, ("join", it), "dp", "all_reduce", 4), 0.0))
            yield from self.issue_cost(r, "forward", "issue: join")
            pending.append((self.issue(r, ("sync", it), "dp", "all_reduce", 4), 0.0))
        yield from self.forward(r, it, p, s * f[0])
        yield from self.backward(r, it, p, s * f[1], pending)
        yield from self.wait_all(r, pending, "wait: collectives of backward")
        yield from self.compute(r, "backward", prof.post_backward * s * f[2])
        yield from self.compute(r, "forward", prof.before_step * s * f[2])
        yield from self.compute(r, "optimizer", prof.optimizer * s * f[3])
        if self.period and it % self.period == 0:
            yield from self.average(r, it, s)

    def forward(self, r: int, it: int, p: int, scale: float):
        """Lane r's forward (profile p), with the captured forward collectives at their
        offsets."""
        prof = self.cap.profiles[p]
        done = 0.0
        issued: dict[int, CollectiveProcess] = {}
        for offset, what, k in self.forward_events[p]:
            dt = offset * scale - done
            if dt > 0:
                yield from self.compute(r, "forward", dt)
                done += dt
            fc = prof.forward_collectives[k]
            if what == 0:
                yield from self.issue_cost(r, "forward", f"issue: {fc['op']}")
                issued[k] = self.issue(r, ("fwd", it, k), "dp", fc["op"], int(fc["bytes"]))
            else:
                yield from self.wait(r, issued[k], f"wait: {fc['op']}")
        yield from self.compute(r, "forward", prof.forward * scale - done)
        self.ticks += 1

    def backward(self, r: int, it: int, p: int, scale: float, pending: list):
        """Lane r's backward (profile p): buckets issued in order, each when its last parameter
        is ready, then the captured backward collectives; what to wait for goes to
        ``pending``."""
        scope = "node" if self.period else "dp"
        t_b = self.env.now
        if self.slowed:
            yield from self._backward_as_work(r, it, p, scale, scope, pending)
        else:
            yield from self._backward_on_schedule(r, it, p, scale, scope, pending)
        self._span(r, "backward", t_b, self.env.now, "backward")

    def _backward_as_work(self, r: int, it: int, p: int, scale: float, scope: str,
                          pending: list):
        """Backward as work, slowed while the lane's collectives run (contention)."""
        env = self.env
        ic = self.issue_s  # the contention's cost of issuing a collective (0: none)
        ready = self.ready[p]
        work = 0.0
        for k, plan in enumerate(self.plans):
            target = ready[k] * scale
            if target > work:
                yield from self._work(r, target - work)
                work = target
            if plan.pre > 0:
                yield from self._work(r, plan.pre * scale)
            if ic > 0:
                yield env.timeout(ic)
            self.issue_bucket(r, it, k, plan, scale, scope, pending)
        for k, bc in enumerate(self.cap.backward_collectives):
            if ic > 0:
                yield env.timeout(ic)
            pending.append((self.issue(r, ("bwd", it, k), scope, bc["op"],
                                       int(bc["bytes"])), 0.0))
        backward = self.cap.profiles[p].backward
        if backward * scale > work:
            yield from self._work(r, backward * scale - work)

    def _backward_on_schedule(self, r: int, it: int, p: int, scale: float, scope: str,
                              pending: list):
        """Backward at full rate: each bucket at its ready time, shifted by the comm hooks'
        work and the issue costs before it."""
        env = self.env
        ic = self.issue_s  # the contention's cost of issuing a collective (0: none)
        ready = self.ready[p]
        t_b = env.now
        shift = 0.0
        for k, plan in enumerate(self.plans):
            t = t_b + ready[k] * scale + shift
            if t > env.now:
                yield at(env, t)
            if plan.pre > 0 or ic > 0:
                pre = plan.pre * scale + ic
                yield env.timeout(pre)
                shift += pre
            self.issue_bucket(r, it, k, plan, scale, scope, pending)
        for k, bc in enumerate(self.cap.backward_collectives):
            if ic > 0:
                yield env.timeout(ic)
                shift += ic
            pending.append((self.issue(r, ("bwd", it, k), scope, bc["op"],
                                       int(bc["bytes"])), 0.0))
        end = t_b + self.cap.profiles[p].backward * scale + shift
        if end > env.now:
            yield at(env, end)

    def average(self, r: int, it: int, s: float):
        """PeriodicModelAverager (LocalSGD) / SlowMo: all_reduce of all parameters."""
        pb = self.param_bytes
        yield from self.compute(r, "optimizer", self.costs.op(2 * pb) * s, "flatten")
        yield from self.issue_cost(r, "optimizer", "issue: all_reduce")
        c = self.issue(r, ("avg", it), "dp", "all_reduce", pb)
        yield from self.wait(r, c, "wait: model averaging")
        post = self.costs.op(2 * pb) + self.costs.op(2 * pb)  # divide, unflatten
        if self.slowmo:
            post += 4 * self.costs.op(3 * pb)  # slow momentum: diff, momentum, update, copy
        yield from self.compute(r, "optimizer", post * s, "model averaging")

    def shadow(self, r: int, it: int):
        """A joined rank's shadow of iteration ``it`` (Join's DDP hook)."""
        yield from self.issue_cost(r, "forward", "issue: join")
        c = self.issue(r, ("join", it), "dp", "all_reduce", 4)
        yield from self.wait(r, c, "wait: join")
        yield from self.issue_cost(r, "forward", "issue: join")
        c = self.issue(r, ("sync", it), "dp", "all_reduce", 4)
        yield from self.wait(r, c, "wait: join")
        pending: list = []
        s = self.slow[r]
        for k, plan in enumerate(self.plans):
            if plan.pre > 0:
                yield from self.compute(r, "backward", plan.pre * s, "comm hook")
            yield from self.issue_cost(r, "backward", "issue: all_reduce")
            self.issue_bucket(r, it, k, plan, s, "dp", pending)
        yield from self.wait_all(r, pending, "wait: join shadow all_reduces")

    def rank(self, r: int):
        for it in range(self.iterations):
            if self.counts is None or it < self.counts[r]:
                yield from self.train(r, it)
            else:
                yield from self.shadow(r, it)
            self.bounds[r].append(self.env.now)
            self.ticks += 1
        if self.join:  # the last Join all_reduce (nobody left), DDP's final broadcast
            c = self.issue(r, ("join", "final"), "dp", "all_reduce", 4)
            yield from self.wait(r, c, "wait: join")
            c = self.issue(r, ("final",), "dp", "broadcast", self.param_bytes)
            yield from self.wait(r, c, "wait: final broadcast")
            if self.bounds[r]:
                self.bounds[r][-1] = self.env.now

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
                total = nl * self.iterations * (len(self.plans) + 2) + nl
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
        lanes = [_ReplayLane(self.spans[r], self.comms[r], self.bounds[r],
                             self.bounds[r][-1] if self.bounds[r] else 0.0)
                 for r in range(self.nlanes)]
        if self.rank_class is None:
            return Timeline.from_lanes(lanes)
        return Timeline.from_classes(lanes, self.rank_class, list(self.rep))

    def per_rank(self, values: list) -> list | PerRank:
        """Per-lane values as per-rank values (a compact :class:`PerRank` for classes)."""
        return values if self.rank_class is None else PerRank(values, self.rank_class)
