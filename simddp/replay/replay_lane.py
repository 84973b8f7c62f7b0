"""A lane of the simpy replay engine (:mod:`~simddp.replay.simpy_engine`): one replayed rank's (or one
class representative's) record, its collectives kept as the engine's processes."""

from __future__ import annotations

from ..analysis import CommSpan, Lane

__all__ = ["ReplayLane"]


class ReplayLane(Lane):
    """A replayed rank's lane: its collectives are the engine's processes (shared by every
    member) with this rank's issue time, turned into CommSpans only when asked."""

    __slots__ = ()

    def comm_intervals(self) -> list[tuple[float, float]]:
        return [(c.start, c.end) for c, _ in self.comms
                if c.start is not None and c.end is not None]

    def comm_intervals_by_scope(self) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for c, _ in self.comms:
            if c.start is not None and c.end is not None:
                out.setdefault(c.info["scope"], []).append((c.start, c.end))
        return out

    def comm_spans(self, rank: int) -> list[CommSpan]:
        out = []
        for c, issue in self.comms:
            info = c.info
            members = info["members"]
            out.append(CommSpan(
                rank=rank, op=info["op"], group=info["group"],
                group_ranks=tuple(members) if len(members) <= 64 else (),  # no 4096-tuples
                seq=info["seq"], bytes=info["bytes"], issue=issue, start=c.start, end=c.end,
                site=info["name"], in_backward=info["in_backward"], scope=info["scope"]))
        return out
