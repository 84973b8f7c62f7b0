"""Co-simulation: the fake cluster (fakepg) run under virtual time (``simddp.cosim``).

:func:`simulate` is :func:`fakepg.spawn` plus a virtual clock per rank. The rules:

* **Compute.** A per-rank ``TorchDispatchMode`` (pushed on the rank's thread before the user's
  function runs) sees every aten op the rank executes, forward and backward, and advances the
  rank's clock by ``compute.op_time(func, args, kwargs, out) / speed(rank) × noise``. The
  noise of an op is a function of the jitter seed, the rank, the op itself (its function and
  its cost) and how many such ops the rank ran before — not of its position among the rank's
  other ops, which torch may permute from run to run (with find_unused_parameters, DDP's
  Reducer zeroes unused parameters' grads in the order of a hash map keyed by pointers); and
  the clock sums op costs exactly (in integer ticks), so such permutations change no time.
* **Collectives.** A member's issue time is its clock at the call. The collective starts at
  ``max(issue times of all members, end of the group's previous collective)`` (a communicator
  runs its collectives in order; point-to-point transfers are ordered per (group, src, dst))
  — decided by the simpy engine (:mod:`simddp.core`): each communicator and each
  point-to-point channel is a :class:`~simddp.core.Channel` (a simpy environment of its own
  with a capacity-1 resource) on which the collective runs as a process — and lasts
  ``network.collective_time(op, bytes, group size) × noise`` on the fabric as the group's
  placement sees it (how many members share a node: :meth:`simddp.Network.placed`; send/recv:
  the "send" cost of the sent bytes). These times land in the trace records (``issue``,
  ``start``, ``end``).
* **Waits.** ``Work.wait()``, ``Future.wait()`` and synchronous calls move the waiting rank's
  clock to ``max(clock, end)``. fakepg settling a collective inside backward (before the C++
  Reducer waits where Python cannot see) is *not* a wait in virtual time.
* **Stream semantics.** Collectives whose caller waits where Python cannot see it (fakepg's
  ``hidden_wait``: the DDP Reducer's buckets in backward, Join's shadow of them) are timed
  like a stream: at the end of each backward pass (an autograd-engine callback queued at the
  pass's first op, so it runs before the Reducer's finalize callback) the rank waits for every
  such collective — the Reducer's internal wait on its bucket futures; and an op that reads or
  writes a tensor such a collective is still writing, outside backward, moves the clock to
  that collective's end. Inside backward such an op can only be a comm hook's future callback
  (fakepg completed the bucket's future before the hook attached it, so it runs inline): it
  runs on the rank's side stream, after the collective, as NCCL runs it.
* **Future callbacks** (``fut.then(cb)`` on a collective's future) run on that side stream:
  from ``max(collective end, end of the rank's previous callback)``; their ops do not advance
  the rank's main clock, and a wait on the work (or on a future chained from it) ends when
  its callbacks end.
* **Races.** Reading or writing a tensor that an asynchronous collective issued from Python
  (outside backward) is still writing — not yet issued by every member, or ending later than
  the rank's clock — with no ``wait()`` on that work first raises :class:`CollectiveRaceError`
  on that rank. View and metadata ops are not accesses. Decided from program order and
  virtual time only.
* **Timeouts.** A wait (explicit, end of backward, or stream) on a collective that ends more
  than the timeout after this rank issued it raises :class:`CollectiveTimeoutError` on the
  waiting rank at virtual time ``issue + timeout`` (NCCL's watchdog wording).
* **Faults** (:mod:`simddp.faults`, in ``Timing.faults``). ``slow_rank(r, factor, at=,
  until=)`` multiplies the cost of each op rank ``r`` starts while its clock is in
  ``[at, until)`` (checked before each op, only on ranks that have such faults: an op that
  straddles ``at`` keeps its cost); ``slow_link(a, b, factor, at=, until=)`` multiplies the
  duration of each collective of a group holding both ``a`` and ``b`` (``b=None``: holding
  ``a``) that starts in ``[at, until)`` — its start computed as above. Overlapping faults
  multiply. ``Timing.network_jitter`` sets the collectives' jitter apart from the ops'.
* **Phases and iterations.** Ops are attributed to "backward" when autograd's engine runs
  them (``torch._C._current_graph_task_id() != -1``), to "optimizer" inside
  ``Optimizer.step`` (global step pre/post hooks, installed only while simulating), else to
  "forward"; consecutive ops of one phase form one span. An iteration ends when an
  (outermost) optimizer step ends, or where the rank calls :func:`mark_iteration`.

* **Observers.** ``simulate(observer=...)`` takes a :class:`Observer`, told of events of the
  virtual-time model that fakepg's trace does not hold (the end-of-backward wait); trace-driven
  capture (:mod:`simddp.cosim.capture`) subscribes to it.

The pieces: :mod:`~simddp.cosim.clock` (a rank's clock, waits, stream semantics),
:mod:`~simddp.cosim.dispatch` (the per-op path), :mod:`~simddp.cosim.tape` with
:mod:`~simddp.cosim.modules` and :mod:`~simddp.cosim.optim_steps` (the coarse path: backward
passes, torch.nn layers' forwards and torch.optim steps the rank repeats, charged from tapes
with the dispatch mode off — the same times; ``simulate(coarse=False)`` turns it off),
:mod:`~simddp.cosim.checks` (races and timeouts, worded), this module (the world hooks, the
optimizer hooks, :func:`simulate`).

Everything is a function of the program, the seed and the :class:`Timing`: reruns give
identical traces and timelines. Not modelled: contention between groups that share links
(each communicator is its own channel, see :mod:`simddp.core`; replay models it),
host/device asynchrony beyond the side stream of callbacks, and the cost of record_function
bookkeeping ops (free).
"""

from __future__ import annotations

import dataclasses
import warnings
import time as _time
from typing import Any, Callable, Sequence

import torch.optim.optimizer as _optim

import fakepg
from fakepg.arguments import integer
from fakepg.errors import RankFailedError
from fakepg.world.hooks import WorldHooks

from ..analysis import CommSpan, Lane, SimResult, Timeline
from ..errors import CollectiveRaceError, CollectiveTimeoutError
from ..faults import SlowLink, link_slowdown
from ..faults import check as check_faults
from ..models import collective_time, noise
from ..models.placement import placement_of
from ..timing import Timing
from .clock import CB, KIND_NAMES, OPT, Flight, RankClock, bind, current, ptr
from . import modules, optim_steps, tape
from ..core import Channel
from .dispatch import ClockMode, FaultClockMode

__all__ = ["simulate", "SimResult", "Observer", "now", "mark_iteration"]


class Observer:
    """Told of co-simulation events that fakepg's trace does not record; pass one as
    ``simulate(observer=...)``. Methods run on the rank's thread, in the rank's program order;
    override the ones you need (these do nothing)."""

    def backward_waited(self, rank: int, start: float, end: float) -> None:
        """``rank``'s end-of-backward wait (the DDP Reducer's hidden wait on its buckets) ran
        from virtual time ``start`` to ``end``."""


class Simulator(WorldHooks):
    """fakepg's world hooks under virtual time: one :class:`RankClock` per rank, one engine
    :class:`~simddp.core.Channel` per communicator."""

    def __init__(self, timing: Timing, nprocs: int, seed: int,
                 observer: Observer | None = None, coarse: bool = False) -> None:
        self.timing = timing
        self.coarse = coarse  # replay repeated backward passes from tapes (engines.tape)
        self.diverged = False  # a replay diverged: the run is redone per-op
        self.nprocs = nprocs
        self.observer = observer
        jseed = seed if timing.seed is None else timing.seed
        self.ranks = [RankClock(self, r, jseed) for r in range(nprocs)]
        self.network = timing.network
        # One engine Channel per communicator and per point-to-point (group, src, dst):
        # see simddp.core for why co-simulation uses a simpy environment per channel.
        self.channels: dict[Any, Channel] = {}
        self.net_noise: noise.Stream | None = None  # one factor per collective, in match order
        if timing.net_jitter > 0:
            self.net_noise = noise.Stream(noise.generator(jseed, 1, 0), timing.net_jitter)
        self.fixed_timeout = timing.timeout_seconds
        self.link_faults = [f for f in timing.faults if isinstance(f, SlowLink)]

    # -- rank lifetime ------------------------------------------------------------------
    def rank_started(self, rank: int) -> None:
        r = self.ranks[rank]
        bind(r)
        r.mode = FaultClockMode(r) if r.rank_faults else ClockMode(r)
        r.mode.__enter__()

    def rank_finished(self, rank: int) -> None:
        r = self.ranks[rank]
        optim_steps.abandon(r)
        r.close_span()
        r.finished_at = r.clock
        try:
            if r.mode is not None:
                r.mode.__exit__(None, None, None)
        finally:
            r.mode = None
            bind(None)

    def describe_rank(self, rank: int) -> str:
        return f"virtual clock {self.ranks[rank].clock:.6f} s"

    # -- collectives --------------------------------------------------------------------
    def collective_issued(self, call: Any) -> None:
        r = self.ranks[call.rank]
        rec = call.record
        tape.event(r, ("issue", rec.op, rec.bytes, rec.group))
        f = Flight(call, r.clock)
        call.record.issue = r.clock
        call.ext = f
        r.prune()
        ptrs = set()
        for t in call.written():
            p = ptr(t)
            if p:
                ptrs.add(p)
        f.ptrs = sorted(ptrs)
        for p in f.ptrs:
            r.watched.setdefault(p, []).append(f)
        r.flights.append(f)
        r.history.append(f)

    def collective_matched(self, coll: Any) -> None:
        members = coll.members()
        flights = [c.ext for c in members]
        if coll.p2p:
            send, recv = coll.calls
            key: Any = (id(coll.group), send.rank, recv.rank)
            op, nbytes, n = "send", send.record.bytes, 2
        else:
            key = id(coll.group)
            op, n = coll.op, coll.group.size
            nbytes = max(c.record.bytes for c in members)
        # placement: as replay, from the members' ranks (simddp.models.placement)
        dur = collective_time(self.network, op, nbytes, n,
                              placement_of((c.rank for c in members), self.network))
        if self.net_noise is not None:
            dur *= self.net_noise.next()
        channel = self.channels.get(key)
        if channel is None:
            channel = self.channels[key] = Channel()
        if self.link_faults:  # slow_link: decided by when the collective starts
            begin = max(max(f.issue for f in flights), channel.env.now)
            dur *= link_slowdown(self.link_faults, {c.rank for c in members}, begin)
        # The collective is a simpy process on its communicator's channel: it starts at
        # max(latest issue, the channel's previous end) and holds it for dur.
        start, end = channel.submit([f.issue for f in flights], dur)
        for c, f in zip(members, flights):
            f.start, f.end = start, end
            c.record.start, c.record.end = start, end

    def completion_started(self, call: Any) -> None:
        f: Flight | None = call.ext
        r = self.ranks[call.rank]
        tape.event(r, ("complete", call.record.op, call.record.group))
        r.close_span()
        start = r.clock
        if f is not None and f.end is not None:
            start = f.end
        if r.cb_clock > start:
            start = r.cb_clock
        r.cb_saved.append((r.clock, r.override, start))
        r.clock = start
        r.override = CB

    def completion_finished(self, call: Any) -> None:
        f: Flight | None = call.ext
        r = self.ranks[call.rank]
        tape.event(r, ("completed",), empty=True)  # ops in a callback: not on a tape
        r.close_span()
        clock, override, start = r.cb_saved.pop()
        # only callbacks that ran ops occupy the side stream: a bare completion (a receive
        # landing, a collective with no callback) holds back nothing issued after it — on a
        # GPU, collectives on different communicators finish independently
        if r.clock > start:
            if r.clock > r.cb_clock:
                r.cb_clock = r.clock
            if f is not None and f.end is not None and r.clock > f.end \
                    and (f.cb_end is None or r.clock > f.cb_end):
                f.cb_end = r.clock
        r.clock, r.override = clock, override

    def wait_finished(self, rank: int, coll: Any) -> None:
        for c in coll.calls:
            if c is not None and c.rank == rank:
                f = c.ext
                if f is not None:
                    rec = c.record
                    tape.event(self.ranks[rank], ("wait", rec.op, rec.group))
                    self.ranks[rank].wait_for(f, f"wait: {rec.op} #{rec.seq}")
                return

    # -- timeouts and races -----------------------------------------------------------------
    def timeout_for(self, f: Flight) -> float | None:
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        coll = f.call.collective
        return None if coll is None else coll.group.timeout

    # -- results ----------------------------------------------------------------------------
    def timeline(self) -> Timeline:
        return Timeline.from_lanes([_lane(r) for r in self.ranks])

def _lane(r: RankClock) -> Lane:
    """A rank's record as a timeline lane."""
    spans = [(KIND_NAMES[kind], s, e, label or KIND_NAMES[kind]) for kind, s, e, label in r.spans]
    spans += [("callback", s, e, "callback (side stream)") for s, e in r._side_spans]
    comms = []
    for f in r.history:
        rec = f.call.record
        comms.append(CommSpan(
            rank=r.rank, op=rec.op, group=rec.group, group_ranks=tuple(rec.group_ranks),
            seq=rec.seq, bytes=rec.bytes, issue=f.issue, start=f.start, end=f.end,
            site=rec.site, in_backward=f.in_backward, p2p=rec.p2p, peer=rec.peer))
    end = r.finished_at if r.finished_at is not None else r.clock
    return Lane(spans, comms, list(r.boundaries), end)


# ---------------------------------------------------------------------------------------
# Optimizer hooks (global while simulating) and what a rank may ask
# ---------------------------------------------------------------------------------------

def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    r: RankClock | None = current()
    if r is None:
        return
    tape.interrupt(r, "an optimizer step")
    if r.opt_depth == 0 and r.override != CB:
        r.close_span()
        r.override = OPT
        r.opt_depth += 1
        optim_steps.begin(r, optimizer, args, kwargs)
        return
    r.opt_depth += 1


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    r: RankClock | None = current()
    if r is None or r.opt_depth == 0:
        return
    r.opt_depth -= 1
    if r.opt_depth == 0 and r.override == OPT:
        optim_steps.end(r)
        r.close_span()
        r.override = None
        r.boundaries.append(r.clock)


def _current() -> RankClock:
    r = current()
    if r is None:
        raise RuntimeError("simddp.now()/mark_iteration() work only inside a rank of "
                           "simddp.simulate(...)")
    tape.interrupt(r, "simddp.now()")
    return r


def now() -> float:
    """The calling rank's virtual clock, in seconds (only inside :func:`simulate`)."""
    return _current().clock


def issued() -> int:
    """How many collectives and point-to-point transfers the calling rank has issued so far:
    the index of its next one in the rank's trace (only inside :func:`simulate`). Tells what
    a call issued where virtual time cannot (a collective issued as a call ends and one
    issued as the next begins carry the same time)."""
    return len(_current().history)


def mark_iteration() -> None:
    """End an iteration of the calling rank here (for loops without an optimizer step)."""
    r = _current()
    r.close_span()
    r.boundaries.append(r.clock)


# ---------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------

def simulate(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, *,
             timing: Timing, seed: int = 0, hang_timeout: float = 1.0,
             observer: Observer | None = None, faults: Sequence[Any] = (),
             coarse: bool | None = None) -> SimResult:
    """Run ``fn(rank, *args)`` on ``nprocs`` fake ranks (like :func:`fakepg.spawn`) with
    virtual time; see the module docstring for the rules. ``observer``: an
    :class:`Observer` told of virtual-time events as they happen. ``faults``:
    :mod:`simddp.faults` added to ``timing.faults`` for this run. ``coarse``: charge backward
    passes the rank has seen before from their tapes (:mod:`simddp.cosim.tape`; the same
    times as per-op, faster); default on unless an ``observer`` is given; False: per-op.

    Raises what ``fakepg.spawn`` raises, except that a :class:`CollectiveRaceError` or
    :class:`CollectiveTimeoutError` that ends a rank is re-raised as itself (it carries
    ``.rank``) rather than wrapped in ``fakepg.RankFailedError``.
    """
    if not isinstance(timing, Timing):
        raise TypeError(f"simulate(timing=...) needs a simddp.Timing, got {type(timing).__name__}; "
                        f"e.g. Timing(network=Network.preset('100gbe'), "
                        f"compute=Compute.roofline('a100'))")
    nprocs = integer("simddp.simulate: nprocs", nprocs, minimum=1)
    unknown = sorted(r for r in timing.rank_speed if r >= nprocs)
    if unknown:
        raise ValueError(f"Timing.rank_speed names ranks {unknown}, but the world has ranks "
                         f"0..{nprocs - 1} (nprocs={nprocs})")
    if faults:
        timing = dataclasses.replace(timing, faults=(*timing.faults, *check_faults(faults)))
    check_faults(timing.faults, nprocs)
    if coarse is None:
        coarse = observer is None  # (a rerun after a divergence would tell it twice)
    t0 = _time.perf_counter()
    sim, res = _run(fn, args, nprocs, timing, seed, hang_timeout, observer, bool(coarse))
    if sim.diverged:  # a replayed backward met what its tape did not hold: redo per-op
        warnings.warn("simddp.simulate: a replayed segment met what its tape did not hold, or "
                      "raised, so the world ran again op by op (the same virtual times); the "
                      "program's side effects (files, prints) ran twice. "
                      "simulate(..., coarse=False) runs it once, op by op.",
                      RerunWarning, stacklevel=2)
        sim, res = _run(fn, args, nprocs, timing, seed, hang_timeout, observer, False)
    return SimResult(res.returns, res.trace, sim.timeline(), nprocs, seed, timing,
                     _time.perf_counter() - t0, res)


class RerunWarning(UserWarning):
    """:func:`simulate` ran the program a second time, op by op (see its ``coarse``)."""


def _run(fn: Callable[..., Any], args: Sequence[Any], nprocs: int, timing: Timing, seed: int,
         hang_timeout: float, observer: Observer | None, coarse: bool) -> tuple[Simulator, Any]:
    """One run of the world under virtual time: the simulator and fakepg's result (a
    divergence of the coarse path returns (sim, None) with ``sim.diverged`` set)."""
    sim = Simulator(timing, nprocs, seed, observer, coarse=coarse)
    opt = _optim
    handles = [opt.register_optimizer_step_pre_hook(_opt_pre),
               opt.register_optimizer_step_post_hook(_opt_post)]
    if coarse:
        tape.install()
        modules.install()
    try:
        return sim, fakepg.spawn(fn, args, nprocs, seed=seed, hooks=sim,
                                 hang_timeout=hang_timeout)
    except Exception as e:
        if sim.diverged:
            return sim, None
        cause = e.__cause__ if isinstance(e, RankFailedError) else None
        if isinstance(cause, (CollectiveRaceError, CollectiveTimeoutError)):
            raise cause from None
        raise
    finally:
        if coarse:
            modules.uninstall()
            tape.uninstall()
        for h in handles:
            h.remove()
