"""The shared state of one fake world: groups, pending collectives, per-rank traces."""

from __future__ import annotations

import dataclasses
from typing import Any


from ..torch_private import (current_graph_task_id, disable_current_modes, len_pre_dispatch_stack,
                             len_torch_dispatch_stack, queue_callback)
from ..ops.matching import Call, GroupState, PendingCollective, check_match, mismatch_message
from ..ops.base import below_autograd
from ..ops.p2p import SEND
from ..errors import (CollectiveMismatchError, FakePGError, InvalidCollectiveError, PeerCrashedError,
                     copy_to_raise)
from .hang_report import hang_report, waiting_text
from .checks import Checkers
from .hooks import WorldHooks
from .liveness import TimedWait, collective_wait
from .events import unrecorded
from .scheduler import Scheduler
from ..ops.trace import CollectiveRecord

class Cluster:
    """Everything the ranks of one spawn share."""

    def __init__(self, nprocs: int, seed: int, hooks: WorldHooks | None = None):
        self.nprocs = nprocs
        self.seed = seed
        self.hooks = hooks or WorldHooks()
        self.plain = type(self.hooks) is WorldHooks  # no timing model watches this world
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # set by spawn
        self.groups: dict[tuple[str, tuple[int, ...]], GroupState] = {}
        self.trace: list[list[CollectiveRecord]] = [[] for _ in range(nprocs)]
        self.outstanding: list[list[Any]] = [[] for _ in range(nprocs)]
        self._completing = [False] * nprocs
        self._settled = [0] * nprocs  # per rank: outstanding calls whose collective settled
        self._deferred: list[list[Call]] = [[] for _ in range(nprocs)]  # see settle_before_backward_ends
        self._deferred_task = [-1] * nprocs
        self.failed_rank: int | None = None
        self.native_refusal: BaseException | None = None  # see refused_natively
        self.backend = "fakepg"  # the personality the world shows (fakepg.fidelity.backends)
        self.faults: tuple[Any, ...] = ()  # fakepg.faults, set by spawn
        self.dead: set[int] = set()  # ranks an injected crash ended
        self.failed: dict[int, str] = {}  # ranks that failed on their own -> how they ended
        self._issued = [0] * nprocs  # collectives each rank issued (where faults fire)
        self.checkers = Checkers()  # refusals and hazards of the backends it emulates (spawn's)
        self.personalities: dict[str, Any] = {}  # name -> fidelity.backends.Personality (spawn's)
        # per rank: the default group the program itself initialised (spawn's own does not
        # count), so a second init_process_group is refused as torch refuses it
        self.initialised_by_program: dict[int, Any] = {}
        self.direct_groups: dict[int, int] = {}  # per rank: ProcessGroupGloo(...) built directly
        # absent rank -> the live rank whose calls stand for its own: the absent rank runs
        # nothing; once a group's live members issued a collective, copies of a live member's
        # call fill the absent members' parts (simddp's representative capture: symmetric
        # ranks do the same work, so one of them stands for the rest; meta tensors only)
        self.stand_ins: dict[int, int] = {}

    # -- groups -----------------------------------------------------------------
    def group(self, name: str, ranks: tuple[int, ...], timeout: float = 1800.0) -> GroupState:
        key = (name, ranks)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = GroupState(name, ranks, timeout)
        return g

    # -- issuing ------------------------------------------------------------------
    def issue(self, group: GroupState, call: Call, *, block: bool) -> PendingCollective:
        """Register ``call`` (made by the baton holder); match and execute if it is the last."""
        sched = self.scheduler
        if sched.abort_error is not None:
            raise copy_to_raise(sched.abort_error)
        if self.faults:
            self._inject(call)
        why = call.spec.validate(call, group.size)
        if why:
            raise InvalidCollectiveError(
                f"rank {call.rank}: invalid {call.op} on group {group.label} at {call.site}: {why}")
        rec = call.record
        trace = self.trace[call.rank]
        rec.record_id = len(trace)
        trace.append(rec)
        coll = self._issue_p2p(group, call) if call.spec.p2p else self._issue_collective(group, call)
        call.collective = coll
        self.outstanding[call.rank].append(call)
        if (self.dead or self.failed or group.aborted) and not coll.settled:
            self._fail_if_orphaned(coll)
        if coll.error is not None:
            self.complete_ready(call.rank)
            raise copy_to_raise(coll.error)
        if block and not coll.settled:
            # Not a wait the program made: the caller (C++ inside backward) is about to
            # wait where Python cannot see it, so settle the collective first.
            sched.block(call.rank, lambda: coll.settled, lambda: waiting_text(call),
                        collective_wait(self, call))
        self.complete_ready(call.rank)
        if coll.error is not None:
            raise copy_to_raise(coll.error)
        return coll

    def _issue_collective(self, group: GroupState, call: Call) -> PendingCollective:
        seq = group.next_seq[call.grank]
        group.next_seq[call.grank] = seq + 1
        call.record.seq = seq
        coll = group.pending.get(seq)
        if coll is None:
            coll = group.pending[seq] = PendingCollective(group, seq, call.op, call.spec,
                                                          [None] * group.size)
        coll.calls[call.grank] = call
        coll.arrived += 1
        if not self.plain:
            self.hooks.collective_issued(call)
        if self.stand_ins:
            self._stand_in(group, coll)
        if coll.arrived == group.size:
            del group.pending[seq]
            differing = check_match(coll)
            if differing:
                self._fail(coll, CollectiveMismatchError(mismatch_message(coll, differing)))
            else:
                self._run(coll)
        return coll

    def _stand_in(self, group: GroupState, coll: PendingCollective) -> None:
        """Once every live member issued ``coll``, each absent member's part is a copy of its
        stand-in's call (of the first live member's where the stand-in is not in the group)."""
        absent = [g for g, r in enumerate(group.ranks) if r in self.stand_ins]
        if not absent or coll.arrived + len(absent) != group.size:
            return
        live = {c.rank: c for c in coll.members()}
        for g in absent:
            rank = group.ranks[g]
            src = live.get(self.stand_ins[rank]) or next(iter(live.values()))
            coll.calls[g] = dataclasses.replace(
                src, rank=rank, grank=g, work=None, result=None,
                record=dataclasses.replace(src.record, rank=rank))
        coll.arrived = group.size

    def _issue_p2p(self, group: GroupState, call: Call) -> PendingCollective:
        me = call.grank
        if self.stand_ins and call.peer is not None and group.ranks[call.peer] in self.stand_ins:
            raise InvalidCollectiveError(
                f"rank {call.rank}: {call.op} with rank {group.ranks[call.peer]}, which does not "
                f"run in this world (a stand-in answers its collectives, not its sends and "
                f"receives): run both ends of point-to-point traffic")
        call.record.seq = group.next_p2p[me]
        group.next_p2p[me] += 1
        if not self.plain:
            self.hooks.collective_issued(call)
        if self.checkers.holds(call):  # NCCL: behind an unmatched op of its pair's stream
            return self._p2p_coll(group, *((call, None) if call.op == "send" else (None, call)))
        return self._match_p2p(group, call)

    def _match_p2p(self, group: GroupState, call: Call) -> PendingCollective:
        me = call.grank
        if call.op == "send":
            key = (me, call.peer, call.tag)
            partner = group.recvs[key].popleft() if group.recvs[key] else None
            if partner is None:
                anykey = (-1, call.peer, call.tag)
                partner = group.recvs[anykey].popleft() if group.recvs[anykey] else None
            if partner is None:
                group.sends[key].append(call)
                return call.collective or self._p2p_coll(group, call, None)
            return self._pair(partner.collective, call)
        # recv: take the earliest matching send (any source when peer is None)
        if call.peer is not None:
            key = (call.peer, me, call.tag)
            partner = group.sends[key].popleft() if group.sends[key] else None
        else:
            queues = [q for (s, d, t), q in group.sends.items() if d == me and t == call.tag and q]
            heads = sorted((q[0] for q in queues), key=lambda c: c.p2p_order)
            # earliest send first; under a schedule, any pending sender may win the match
            partner = heads[self.scheduler.schedule.choose("any_source", len(heads))] if heads else None
            if partner is not None:
                group.sends[(partner.grank, me, call.tag)].popleft()
        if partner is None:
            group.recvs[(call.peer if call.peer is not None else -1, me, call.tag)].append(call)
            return call.collective or self._p2p_coll(group, None, call)
        return self._pair(partner.collective, call)

    def _p2p_coll(self, group: GroupState, send: Call | None, recv: Call | None) -> PendingCollective:
        c = send or recv
        c.p2p_order = next(group.p2p_order)
        coll = PendingCollective(group, c.record.seq, "p2p", SEND, [send, recv], p2p=True)
        coll.arrived = 1
        c.collective = coll
        return coll

    def _pair(self, coll: PendingCollective, call: Call) -> PendingCollective:
        coll.calls[0 if call.op == "send" else 1] = call
        coll.arrived = 2
        if coll.spec.check_members(coll.calls):
            send, recv = coll.calls
            self._fail(coll, CollectiveMismatchError(
                f"point-to-point on group {coll.group.label} does not match:\n"
                f"  rank {send.rank}: {send.describe()}\n  rank {recv.rank}: {recv.describe()}"))
        else:
            self._run(coll)
        return coll

    def _run(self, coll: PendingCollective) -> None:
        calls = coll.members()
        if len_torch_dispatch_stack() or len_pre_dispatch_stack():
            # The data movement is the network's work, not the issuing rank's: keep it out
            # of any per-rank dispatch mode (a timing layer charges compute through one).
            with disable_current_modes(), unrecorded(), below_autograd():
                coll.spec.execute(calls)
        else:
            with unrecorded(), below_autograd():  # nor in the rank's profile
                coll.spec.execute(calls)
        coll.matched = True
        g = coll.group
        settled, stand_ins, seq = self._settled, self.stand_ins, coll.seq
        last_done = None if coll.p2p else g.last_done
        for c in calls:
            c.record.state = "started"
            if stand_ins and c.rank in stand_ins:  # an absent member's stand-in has no Work
                continue
            settled[c.rank] += 1
            if last_done is not None and last_done[c.grank] < seq:
                last_done[c.grank] = seq
        if not self.plain:
            self.hooks.collective_matched(coll)
        if coll.p2p:
            for held in list(self.checkers.released(coll)):
                self._release_p2p(g, held)

    def _release_p2p(self, group: GroupState, call: Call) -> None:
        """Match a p2p call the NCCL stream order held back; its placeholder settles with it."""
        placeholder = call.collective
        coll = self._match_p2p(group, call)
        if coll is not placeholder:
            call.collective = coll
            placeholder.matched, placeholder.error = coll.matched, coll.error

    # -- injected faults (fakepg.faults) --------------------------------------------
    def _inject(self, call: Call) -> None:
        from ..choices import faults
        k = self._issued[call.rank]
        self._issued[call.rank] = k + 1
        fault = faults.due(self.faults, call.rank, k)
        if isinstance(fault, faults.RaiseIn):
            raise fault.exc
        if isinstance(fault, faults.Crash):
            self.dead.add(call.rank)
            self._orphan_collectives_of(call.rank)
            raise faults.RankCrashed(call.rank)

    def refused_natively(self, error: BaseException) -> None:
        """A thread the program started hit fakepg's refusal of a native wait (torchft's quorum
        thread building a TCPStore client): the program may catch it and fail later in its
        own words, so the world ends now and its verdict names this refusal."""
        if self.native_refusal is None:
            self.native_refusal = error
        self.scheduler.abort(error)

    def rank_failed(self, rank: int, how: str) -> None:
        """``rank`` ended with an uncaught failure (``how``: "exited with code 3"): its process
        would be gone, so as under gloo the collectives waiting for it fail now, every later
        one with it fails at issue (a closed connection), and the other ranks run on until
        they need it or finish."""
        self.failed.setdefault(rank, how)
        self._orphan_collectives_of(rank)

    def _orphan_collectives_of(self, rank: int) -> None:
        for group in self.groups.values():
            if rank in group.ranks:
                for coll in list(group.pending.values()) + self._pending_p2p(group):
                    self._fail_if_orphaned(coll)

    def _pending_p2p(self, group: GroupState) -> list[PendingCollective]:
        queued = [c for q in (*group.sends.values(), *group.recvs.values()) for c in q]
        return [c.collective for c in queued if c.collective is not None]

    def abort_group(self, group: GroupState, rank: int) -> None:
        """``pg.abort()`` on ``rank``: its pending works on ``group`` fail, and so do the
        collectives there that wait for it (it will never join them)."""
        group.aborted.add(rank)
        for coll in list(group.pending.values()) + self._pending_p2p(group):
            self._fail_if_orphaned(coll)

    def _fail_if_orphaned(self, coll: PendingCollective) -> None:
        """Fail a collective that a dead rank, or one that aborted the group, will never join."""
        from ..choices.faults import CONNECTION_CLOSED
        if coll.settled:
            return
        if coll.p2p:
            c = coll.members()[0]
            involved = [c.rank] + ([coll.group.ranks[c.peer]] if c.peer is not None else [])
        else:
            involved = [c.rank for c in coll.members()] + coll.missing_ranks()
        # the earliest to fail first: later ones may have failed of this very error
        gone = [r for r in involved if r in self.dead] + [r for r in self.failed if r in involved]
        culprits = (gone  # a death explains the most
                    + [r for r in involved if r in coll.group.aborted and r not in gone])
        if not culprits:
            return
        r = culprits[0]
        why = ("crashed (fakepg.faults.crash)" if r in self.dead else
               f"{self.failed[r]}" if r in self.failed else
               f"aborted group {coll.group.label} (ProcessGroup.abort)")
        coll.error = PeerCrashedError(
            (CONNECTION_CLOSED.format(port=29500 + r) if r in gone else
             f"ProcessGroup aborted: rank {r} aborted the communicator")
            + f"\nfakepg: rank {r} {why}; {coll.op} #{coll.seq} on group {coll.group.label} "
              f"can never complete")
        for c in coll.members():
            c.record.state = "failed"
            self._settled[c.rank] += 1
        if not coll.p2p:
            coll.group.pending.pop(coll.seq, None)

    def _fail(self, coll: PendingCollective, error: FakePGError) -> None:
        coll.error = error
        for c in coll.members():
            c.record.state = "failed"
            self._settled[c.rank] += 1
        self.scheduler.abort(error)

    # -- waiting and completion ----------------------------------------------------
    def wait(self, call: Call, timed: TimedWait | None = None) -> None:
        """Block until ``call``'s collective settled; past the group's timeout (or ``timed``'s)
        raise the backend's timeout error."""
        coll: PendingCollective = call.collective
        if not coll.settled:
            self.scheduler.block(call.rank, lambda: coll.settled, lambda: waiting_text(call),
                                 timed or collective_wait(self, call))
        self.complete_ready(call.rank)
        self.checkers.waited(call)
        if coll.error is not None:
            raise copy_to_raise(coll.error)
        self.hooks.wait_finished(call.rank, coll)

    def settle_before_backward_ends(self, call: Call) -> None:
        """``call`` was issued inside backward by the Reducer, which waits on it from C++ in
        its end-of-backward callback, where the scheduler cannot see the wait. Rather than
        settling it at issue (a hand-over per bucket), settle every such call of this rank in
        an autograd callback queued before the Reducer's: the rank runs its whole backward,
        then hands over once."""
        pending = self._deferred[call.rank]
        task = current_graph_task_id()
        if not pending or self._deferred_task[call.rank] != task:
            # (a backward that raised before its callbacks ran leaves calls here: settled now)
            self._deferred_task[call.rank] = task
            queue_callback(
                lambda rank=call.rank: self._settle_deferred(rank))
        pending.append(call)

    def _settle_deferred(self, rank: int) -> None:
        pending, self._deferred[rank] = self._deferred[rank], []
        for call in pending:
            coll = call.collective
            if not coll.settled:
                self.scheduler.block(rank, lambda: coll.settled,
                                     lambda: waiting_text(call), collective_wait(self, call))
        self.complete_ready(rank)
        for call in pending:
            if call.collective.error is not None:
                raise copy_to_raise(call.collective.error)

    def complete_ready(self, rank: int) -> None:
        """Complete, on this rank's thread and in issue order, every settled Work it owns."""
        if not self._settled[rank] or self._completing[rank]:
            return
        self._completing[rank] = True
        try:
            pending = self.outstanding[rank]
            settled, plain = self._settled, self.plain
            while settled[rank]:
                # the earliest settled one (under a schedule, any of them: the order in which
                # different works' callbacks run); callbacks may issue more, so look again
                schedule = self.scheduler.schedule
                if schedule.active:
                    ready = [i for i, c in enumerate(pending) if c.collective.settled]
                    i = ready[schedule.choose("callback_order", len(ready))] if ready else -1
                elif pending and pending[0].collective.settled:  # the usual case: issue order
                    i = 0
                else:
                    i = next((i for i, c in enumerate(pending) if c.collective.settled), -1)
                if i < 0:  # counted but not yet listed (cannot happen; be safe, not stuck)
                    break
                call = pending.pop(i)
                settled[rank] -= 1
                error = call.collective.error
                if call.work is not None:
                    if plain:
                        call.work._complete(error)
                    else:
                        self.hooks.completion_started(call)
                        try:
                            call.work._complete(error)
                        finally:
                            self.hooks.completion_finished(call)
                if call.collective.error is None:
                    call.record.state = "completed"
        finally:
            self._completing[rank] = False

    # -- reports ------------------------------------------------------------------
    def hang_report(self) -> str:
        """What every rank waits on, per group what completed and what is pending."""
        return hang_report(self)

