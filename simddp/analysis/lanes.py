"""What a timeline is made of: spans, collectives, iteration statistics and per-rank lanes.

A :class:`Lane` is one rank's record (spans, collectives, iteration ends) and computes that
rank's figures; :class:`~simddp.analysis.Timeline` holds one per rank (a :class:`LaneView`
when replay simulated classes of identical ranks) and aggregates them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .intervals import clip, intersection, measure, union
from .perrank import PerRank

__all__ = ["Lane", "Span", "CommSpan", "IterationStats", "COMPUTE_KINDS", "SpanRow"]

SpanRow = tuple[str, float, float, str]  # (kind, start, end, name) of one rank's span

COMPUTE_KINDS = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Span:
    """A stretch of one rank's time: kind is forward/backward/optimizer/wait/callback."""

    rank: int
    kind: str
    start: float
    end: float
    name: str

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CommSpan:
    """One rank's part of one collective (start/end are None if it never matched)."""

    rank: int
    op: str
    group: str
    group_ranks: tuple[int, ...]
    seq: int
    bytes: int
    issue: float
    start: float | None
    end: float | None
    site: str
    in_backward: bool
    p2p: bool = False
    peer: int | None = None
    scope: str | None = None  # the mesh dimension it ran on ("shard", "tp"; None: its group)

    @property
    def duration(self) -> float:
        return 0.0 if self.start is None or self.end is None else self.end - self.start

    @property
    def name(self) -> str:
        if self.p2p:
            arrow = "→" if self.op == "send" else "←"
            return f"{self.op} {arrow}{self.peer} #{self.seq}"
        return f"{self.op} #{self.seq}"


@dataclass(frozen=True)
class IterationStats:
    """One rank's iteration, in seconds."""

    iteration: int
    rank: int
    start: float
    end: float
    forward: float
    backward: float
    optimizer: float
    wait: float
    comm: float
    overlap: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.optimizer

    @property
    def exposed_comm(self) -> float:
        return max(0.0, self.comm - self.overlap)


class Lane:
    """One rank's part of a timeline: ``spans`` as ``(kind, start, end, name)`` rows in time
    order per kind, its collectives, its iteration ends (``boundaries``) and its final clock.

    ``comms`` holds :class:`CommSpan` objects here; an engine with a cheaper record of its
    collectives subclasses Lane and overrides :meth:`comm_intervals` and :meth:`comm_spans`.
    """

    __slots__ = ("spans", "comms", "boundaries", "end_time", "_unions")

    def __init__(self, spans: list[SpanRow], comms: Sequence[Any], boundaries: list[float],
                 end_time: float) -> None:
        self.spans = spans
        self.comms = comms
        self.boundaries = boundaries
        self.end_time = end_time
        self._unions: dict[Any, list[tuple[float, float]]] = {}

    def comm_intervals(self) -> Iterable[tuple[float, float]]:
        """``(start, end)`` of every collective that ran."""
        return [(c.start, c.end) for c in self.comms if c.start is not None and c.end is not None]

    def comm_spans(self, rank: int) -> list[CommSpan]:
        """The collectives as :class:`CommSpan` objects of rank ``rank``."""
        return [c if c.rank == rank else dataclasses.replace(c, rank=rank) for c in self.comms]

    def comm_intervals_by_scope(self) -> dict[str, list[tuple[float, float]]]:
        """``(start, end)`` of every collective that ran, per scope (mesh dimension; a
        collective without one counts under its group's name)."""
        out: dict[str, list[tuple[float, float]]] = {}
        for c in self.comms:
            if c.start is not None and c.end is not None:
                out.setdefault(c.scope or c.group, []).append((c.start, c.end))
        return out

    def union(self, what: str | tuple[str, ...]) -> list[tuple[float, float]]:
        """The union of the spans of kind(s) ``what`` ("comm": the collectives); cached."""
        got = self._unions.get(what)
        if got is None:
            if what == "comm":
                got = union(self.comm_intervals())
            elif isinstance(what, str):
                got = union([(s, e) for k, s, e, _ in self.spans if k == what])
            else:
                got = union([(s, e) for k, s, e, _ in self.spans if k in what])
            self._unions[what] = got
        return got

    def windows(self) -> list[tuple[float, float]]:
        b = self.boundaries
        return [(b[i - 1] if i else 0.0, b[i]) for i in range(len(b))]

    def clipped(self, what: str | tuple[str, ...], lo: float, hi: float
                ) -> list[tuple[float, float]]:
        return clip(self.union(what), lo, hi)

    def exposed(self) -> list[float]:
        """Per iteration: communication not overlapped by compute."""
        comm = self.union("comm")
        if not comm:
            return [0.0] * len(self.boundaries)
        compute = self.union(COMPUTE_KINDS)
        out = []
        for lo, hi in self.windows():
            cw = clip(comm, lo, hi)
            x = measure(cw) - intersection(cw, clip(compute, lo, hi)) if cw else 0.0
            out.append(x if x > 0.0 else 0.0)
        return out

    def exposed_by_scope(self) -> dict[str, list[float]]:
        """Per scope (mesh dimension), per iteration: the time a collective of that scope
        runs while the rank computes nothing. Scopes whose collectives run at the same time
        each count that time, so the figures may add up to more than :meth:`exposed`."""
        compute = self.union(COMPUTE_KINDS)
        out = {}
        for scope, spans in sorted(self.comm_intervals_by_scope().items()):
            comm = union(spans)
            per = []
            for lo, hi in self.windows():
                cw = clip(comm, lo, hi)
                x = measure(cw) - intersection(cw, clip(compute, lo, hi)) if cw else 0.0
                per.append(x if x > 0.0 else 0.0)
            out[scope] = per
        return out

    def durations(self) -> list[float]:
        b = self.boundaries
        return [b[i] - (b[i - 1] if i else 0.0) for i in range(len(b))]

    def waits(self) -> list[float]:
        return [measure(self.clipped("wait", lo, hi)) for lo, hi in self.windows()]



class LaneView(_SequenceABC):
    """Per rank, its class's lane (:meth:`Timeline.from_classes`), without a list per rank."""

    __slots__ = ("class_lanes", "rank_class")

    def __init__(self, class_lanes: list[Lane], rank_class: Any) -> None:
        self.class_lanes = class_lanes
        self.rank_class = rank_class

    def __len__(self) -> int:
        return len(self.rank_class)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.class_lanes[c] for c in self.rank_class[i].tolist()]
        return self.class_lanes[int(self.rank_class[i])]

    def __iter__(self):
        return iter(PerRank(self.class_lanes, self.rank_class))
