"""The shared state of one fake world: groups, pending collectives, per-rank traces."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .collectives import (Call, Collective, GroupState, _flatten, check_match, execute,
                          mismatch_message, validate_local)
from .errors import (CollectiveHangError, CollectiveMismatchError, FakePGError, RankFailedError,
                     WorldAbortedError)
from .hooks import WorldHooks
from .liveness import TimedWait, collective_wait
from .scheduler import BLOCKED, DONE, NEW, Scheduler
from .trace import CollectiveRecord

_local = threading.local()


def current_cluster() -> tuple["Cluster", int] | None:
    """(cluster, global rank) of the calling rank thread, or None outside a fake world."""
    return getattr(_local, "binding", None)


def bind_thread(cluster: "Cluster | None", rank: int = -1) -> None:
    _local.binding = None if cluster is None else (cluster, rank)


def _nbytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    if t.is_sparse:
        return t._values().numel() * t.element_size()
    return t.numel() * t.element_size()


def _collective_bytes(call: Call, size: int) -> int:
    """Size as nccl-tests counts it: all_gather/reduce_scatter count the full buffer."""
    op = call.op
    ins = sum(_nbytes(t) for t in _flatten(call.inputs))
    if op in ("all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "gather"):
        return ins * size
    if op == "scatter":
        return sum(_nbytes(t) for t in _flatten(call.outputs)) * size
    if op == "reduce_scatter":
        return sum(_nbytes(t) for t in _flatten(call.outputs)) * size
    return ins


class Cluster:
    """Everything the ranks of one spawn share."""

    def __init__(self, nprocs: int, seed: int, hooks: WorldHooks | None = None):
        self.nprocs = nprocs
        self.seed = seed
        self.hooks = hooks or WorldHooks()
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # set by spawn
        self.groups: dict[tuple[str, tuple[int, ...]], GroupState] = {}
        self.trace: list[list[CollectiveRecord]] = [[] for _ in range(nprocs)]
        self.outstanding: list[list[Any]] = [[] for _ in range(nprocs)]
        self._completing = [False] * nprocs
        self.failed_rank: int | None = None

    # -- groups -----------------------------------------------------------------
    def group(self, name: str, ranks: tuple[int, ...], timeout: float = 1800.0) -> GroupState:
        key = (name, ranks)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = GroupState(name, ranks, timeout)
        return g

    # -- issuing ------------------------------------------------------------------
    def issue(self, group: GroupState, call: Call, *, block: bool) -> Collective:
        """Register ``call`` (made by the baton holder); match and execute if it is the last."""
        sched = self.scheduler
        if sched.abort_error is not None:
            raise _fresh(sched.abort_error)
        why = validate_local(call, group.size)
        if why:
            raise ValueError(f"rank {call.rank}: invalid {call.op} on group {group.label} at {call.site}: {why}")
        rec = call.record
        rec.record_id = len(self.trace[call.rank])
        self.trace[call.rank].append(rec)
        if call.op in ("send", "recv"):
            coll = self._issue_p2p(group, call)
        else:
            seq = group.next_seq[call.grank]
            group.next_seq[call.grank] += 1
            rec.seq = seq
            coll = group.pending.get(seq)
            if coll is None:
                coll = group.pending[seq] = Collective(group, seq, call.op, [None] * group.size)
            coll.calls[call.grank] = call
            coll.arrived += 1
            self.hooks.collective_issued(call)
            if coll.arrived == group.size:
                del group.pending[seq]
                differing = check_match(coll)
                if differing:
                    self._fail(coll, CollectiveMismatchError(mismatch_message(coll, differing)))
                else:
                    self._run(coll)
        call.collective = coll
        self.outstanding[call.rank].append(call)
        if coll.error is not None:
            self.complete_ready(call.rank)
            raise _fresh(coll.error)
        if block and not coll.settled:
            # Not a wait the program made: the caller (C++ inside backward) is about to
            # wait where Python cannot see it, so settle the collective first.
            self.scheduler.block(call.rank, lambda: coll.settled, lambda: self._waiting_text(call),
                                 collective_wait(self, call))
        self.complete_ready(call.rank)
        if coll.error is not None:
            raise _fresh(coll.error)
        return coll

    def _issue_p2p(self, group: GroupState, call: Call) -> Collective:
        me = call.grank
        call.record.seq = group.next_p2p[me]
        group.next_p2p[me] += 1
        self.hooks.collective_issued(call)
        if call.op == "send":
            key = (me, call.peer, call.tag)
            partner = group.recvs[key].popleft() if group.recvs[key] else None
            if partner is None:
                anykey = (-1, call.peer, call.tag)
                partner = group.recvs[anykey].popleft() if group.recvs[anykey] else None
            if partner is None:
                group.sends[key].append(call)
                return self._p2p_coll(group, call, None)
            return self._pair(partner.collective, call)
        # recv: take the earliest matching send (any source when peer is None)
        if call.peer is not None:
            key = (call.peer, me, call.tag)
            partner = group.sends[key].popleft() if group.sends[key] else None
        else:
            queues = [q for (s, d, t), q in group.sends.items() if d == me and t == call.tag and q]
            partner = min((q[0] for q in queues), key=lambda c: c.p2p_order, default=None)
            if partner is not None:
                group.sends[(partner.grank, me, call.tag)].popleft()
        if partner is None:
            group.recvs[(call.peer if call.peer is not None else -1, me, call.tag)].append(call)
            return self._p2p_coll(group, None, call)
        return self._pair(partner.collective, call)

    def _p2p_coll(self, group: GroupState, send: Call | None, recv: Call | None) -> Collective:
        c = send or recv
        c.p2p_order = next(group.p2p_order)
        coll = Collective(group, c.record.seq, "p2p", [send, recv], p2p=True)
        coll.arrived = 1
        c.collective = coll
        return coll

    def _pair(self, coll: Collective, call: Call) -> Collective:
        slot = 0 if call.op == "send" else 1
        coll.calls[slot] = call
        coll.arrived = 2
        send, recv = coll.calls
        s, r = send.inputs[0], recv.inputs[0]
        if s.numel() != r.numel() or s.dtype != r.dtype:
            self._fail(coll, CollectiveMismatchError(
                f"point-to-point on group {coll.group.label} does not match:\n"
                f"  rank {send.rank}: {send.describe()}\n  rank {recv.rank}: {recv.describe()}"))
        else:
            self._run(coll)
        return coll

    def _run(self, coll: Collective) -> None:
        # The data movement is the network's work, not the issuing rank's: keep it out of
        # any per-rank dispatch mode (simddp charges compute time through one).
        with _disable_current_modes():
            execute(coll)
        coll.matched = True
        for c in coll.members():
            c.record.state = "started"
            if not coll.p2p:
                g = coll.group
                g.last_done[c.grank] = max(g.last_done[c.grank], coll.seq)
        self.hooks.collective_matched(coll)

    def _fail(self, coll: Collective, error: FakePGError) -> None:
        coll.error = error
        for c in coll.members():
            c.record.state = "failed"
        self.scheduler.abort(error)

    # -- waiting and completion ----------------------------------------------------
    def wait(self, call: Call, timed: TimedWait | None = None) -> None:
        """Block until ``call``'s collective settled; past the group's timeout (or ``timed``'s)
        raise the backend's timeout error."""
        coll: Collective = call.collective
        if not coll.settled:
            self.scheduler.block(call.rank, lambda: coll.settled, lambda: self._waiting_text(call),
                                 timed or collective_wait(self, call))
        self.complete_ready(call.rank)
        if coll.error is not None:
            raise _fresh(coll.error)
        self.hooks.wait_finished(call.rank, coll)

    def complete_ready(self, rank: int) -> None:
        """Complete, on this rank's thread and in issue order, every settled Work it owns."""
        if self._completing[rank]:
            return
        self._completing[rank] = True
        try:
            pending = self.outstanding[rank]
            i = 0
            while i < len(pending):
                call = pending[i]
                coll = call.collective
                if coll.settled:
                    del pending[i]
                    if call.work is not None:
                        self.hooks.completion_started(call)
                        try:
                            call.work._complete(coll.error)
                        finally:
                            self.hooks.completion_finished(call)
                    if coll.error is None:
                        call.record.state = "completed"
                    i = 0  # callbacks may have issued more; rescan from the front
                else:
                    i += 1
        finally:
            self._completing[rank] = False

    def _waiting_text(self, call: Call) -> str:
        coll: Collective = call.collective
        if coll.p2p:
            peer = "any source" if call.peer is None else f"rank {coll.group.ranks[call.peer]}"
            return (f"{call.op} with {peer} (tag {call.tag}) on group {coll.group.label}, "
                    f"issued at {call.site}; the peer never posted the matching "
                    f"{'recv' if call.op == 'send' else 'send'}")
        return (f"{call.record.describe()} #{coll.seq} on group {coll.group.label}, issued at "
                f"{call.site}; waits for ranks {coll.missing_ranks()}")

    # -- reports ------------------------------------------------------------------
    def hang_report(self) -> str:
        sched = self.scheduler
        lines = [f"fakepg: hang detected: no rank can make progress "
                 f"({self.nprocs} ranks, seed {self.seed}). Per rank:"]
        for slot in sched.slots:
            extra = self.hooks.describe_rank(slot.rank)
            extra = f" [{extra}]" if extra else ""
            if slot.state == BLOCKED:
                lines.append(f"  rank {slot.rank}: blocked waiting on {slot.waiting_for()}{extra}")
            elif slot.state == DONE:
                lines.append(f"  rank {slot.rank}: finished ({slot.outcome}){extra}")
            elif slot.state == NEW:
                lines.append(f"  rank {slot.rank}: never started{extra}")
            else:
                lines.append(f"  rank {slot.rank}: running{extra}")
            unmatched = [c for c in self.outstanding[slot.rank] if not c.collective.settled]
            for c in unmatched:
                if slot.state != BLOCKED or c is not unmatched[-1]:
                    lines.append(f"      also pending: {self._waiting_text(c)}")
        lines.append("Last completed collective per group (sequence numbers start at 0):")
        for g in self.groups.values():
            done = ", ".join(f"rank {r}: #{s}" for r, s in zip(g.ranks, g.last_done))
            lines.append(f"  group {g.label}: {done}")
            for coll in sorted(g.pending.values(), key=lambda c: c.seq):
                issued = ", ".join(f"rank {c.rank} at {c.site}" for c in coll.members())
                lines.append(f"    pending #{coll.seq} {coll.op}: issued by {issued}; "
                             f"still waits for ranks {coll.missing_ranks()}")
        lines.append("Typical causes: ranks with different numbers of batches (use "
                     "torch.distributed.algorithms.Join), a rank that skipped backward or "
                     "returned early, or collectives issued in different orders.")
        return "\n".join(lines)


def _fresh(error: FakePGError) -> FakePGError:
    """A copy of ``error`` to raise in another thread (tracebacks are per raise)."""
    if isinstance(error, CollectiveHangError):
        new: FakePGError = CollectiveHangError(error.report)
    elif isinstance(error, RankFailedError):
        new = WorldAbortedError(str(error))
    else:
        new = type(error)(*error.args)
    return new
