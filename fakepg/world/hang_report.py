"""The hang report: what each rank of a world that cannot progress waits on, in words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ops.matching import SPELL_OUT, rank_list, rank_runs
from .scheduler import BLOCKED, DONE, NEW

MAX_ALSO_PENDING = 8  # per rank, in a hang report

if TYPE_CHECKING:
    from .cluster import Cluster
    from ..ops.matching import Call, PendingCollective


def waiting_text(call: "Call") -> str:
    """What ``call``'s rank waits for, in words (where it was issued, who has not joined)."""
    coll: "PendingCollective" = call.collective
    if coll.p2p:
        peer = "any source" if call.peer is None else f"rank {coll.group.ranks[call.peer]}"
        return (f"{call.op} with {peer} (tag {call.tag}) on group {coll.group.label}, "
                f"issued at {call.site}; the peer never posted the matching "
                f"{'recv' if call.op == 'send' else 'send'}")
    return (f"{call.record.describe()} #{coll.seq} on group {coll.group.label}, issued at "
            f"{call.site}; waits for ranks {rank_list(coll.missing_ranks())}")


def hang_report(cluster: "Cluster") -> str:
    """Why no rank can make progress: each rank's state and pending calls, and per group
    the last completed collective and the pending ones with the ranks they wait for."""
    sched = cluster.scheduler
    lines = [f"fakepg: hang detected: no rank can make progress "
             f"({cluster.nprocs} ranks, seed {cluster.seed}). Per rank:"]
    states = []
    for slot in sched.slots:
        extra = cluster.hooks.describe_rank(slot.rank)
        extra = f" [{extra}]" if extra else ""
        if slot.state == BLOCKED:
            text = f"blocked waiting on {slot.waiting_for()}{extra}"
        elif slot.state == DONE:
            text = f"finished ({slot.outcome}){extra}"
        elif slot.state == NEW:
            text = f"never started{extra}"
        elif slot.waiting_for is not None:  # running, but the watchdog found it blocked
            text = f"blocked {slot.waiting_for()}{extra}"
        else:
            text = f"running{extra}"
        unmatched = [c for c in cluster.outstanding[slot.rank] if not c.collective.settled]
        also = [c for c in unmatched if slot.state != BLOCKED or c is not unmatched[-1]]
        for c in also[:MAX_ALSO_PENDING]:
            text += f"\n      also pending: {waiting_text(c)}"
        if len(also) > MAX_ALSO_PENDING:
            # torch's stress tests leave 1,000s in flight: listing each made a report of
            # megabytes, copied into every failed work's error (gigabytes in process mode)
            text += (f"\n      ... and {len(also) - MAX_ALSO_PENDING} more pending "
                     f"(the oldest {MAX_ALSO_PENDING} are listed)")
        states.append(text)
    for ranks, text in rank_runs(range(cluster.nprocs), states, cluster.nprocs > SPELL_OUT):
        lines.append(f"  {ranks}: {text}")
    lines.append("Last completed collective per group (sequence numbers start at 0):")
    for g in cluster.groups.values():
        last = [f"#{s}" if s >= 0 else "none completed yet" for s in g.last_done]
        done = ", ".join(f"{ranks}: {text}" for ranks, text in
                         rank_runs(g.ranks, last, len(g.ranks) > SPELL_OUT))
        lines.append(f"  group {g.label}: {done}")
        pending = sorted(g.pending.values(), key=lambda c: c.seq)
        for coll in pending[:MAX_ALSO_PENDING]:
            members = coll.members()
            issued = ", ".join(f"{ranks} at {site}" for ranks, site in
                               rank_runs([c.rank for c in members], [c.site for c in members],
                                         len(members) > SPELL_OUT))
            lines.append(f"    pending #{coll.seq} {coll.op}: issued by {issued}; "
                         f"still waits for ranks {rank_list(coll.missing_ranks())}")
        if len(pending) > MAX_ALSO_PENDING:
            lines.append(f"    ... and {len(pending) - MAX_ALSO_PENDING} more pending on this "
                         f"group (the oldest {MAX_ALSO_PENDING} are listed)")
    lines.extend(cluster.checkers.hang_notes())
    python = [s.rank for s in sched.slots if s.state == BLOCKED and s.python_wait]
    if python:
        lines.append(
            f"Ranks {rank_list(python)} wait in Python's own synchronisation (a queue, event, "
            f"lock, condition or future): after {sched.inactivity:g} s in which no rank could "
            f"run and no other thread of the process did anything, nothing can release them. "
            f"Between processes ranks share no Python objects, so a wait on another rank "
            f"through one never ends either; if the object is a module global the ranks share "
            f"only in thread mode (one per process under torchrun), run the ranks as processes "
            f"(fakerun --isolation process, or fakepg.spawn(..., isolation='process')).")
        if sched.native_waiters:
            lines.append(
                f"Threads the program started were still inside a native call after "
                f"{sched.native_grace:g} s (a C++ or Rust client waiting on a server may release "
                f"such a wait, so the verdict waited that long): "
                + "; ".join(sched.native_waiters[:8]) + ".")
    lines.append("Typical causes: ranks with different numbers of batches (use "
                 "torch.distributed.algorithms.Join), a rank that skipped backward or "
                 "returned early, or collectives issued in different orders.")
    return "\n".join(lines)
