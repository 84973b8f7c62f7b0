"""Compute under the network's contention, for the simpy replay engine (:mod:`~simddp.replay.simpy_engine`).

:class:`ContentionClock`, a mixin of :class:`~simddp.replay.simpy_engine._Replay`: the network's
Contention (:mod:`simddp.models.contention`) slows a lane's compute while one of its
collectives is in flight, and costs a fixed compute-stream time per issued collective.
Inactive (None, or slowdown 1 and no cost): the code paths of no contention, so results are
bitwise those of a network without it.
"""

from __future__ import annotations

from ..models import NetworkModel
from ..core import CollectiveProcess, at

__all__ = ["ContentionClock"]


class ContentionClock:
    """Contention's state and its clock; the host provides ``env``, ``comms`` (per lane: its
    collectives and their issue times) and ``_span``."""

    def _init_contention(self, net: NetworkModel, nlanes: int) -> None:
        cont = getattr(net, "contention", None)
        cont = cont if cont is not None and cont.active else None
        self.slowdown = cont.slowdown if cont is not None else 1.0
        self.slowed = self.slowdown != 1.0
        self.issue_s = cont.per_collective_s if cont is not None else 0.0
        self._live: list[list[CollectiveProcess]] = [[] for _ in range(nlanes)]  # not ended yet
        self._seen = [0] * nlanes  # how many of comms[r] _live has taken in

    def issue_cost(self, r: int, kind: str, label: str):
        """The contention's fixed compute-stream cost of issuing one collective (none: no-op)."""
        if self.issue_s > 0:
            start = self.env.now
            yield self.env.timeout(self.issue_s)
            self._span(r, kind, start, self.env.now, label)

    def _work(self, r: int, work: float):
        """Lane r computes ``work`` seconds' worth, at ``1 / slowdown`` of its rate while one of
        its collectives is in flight. A collective's start is known only once it has started, so
        the lane waits until the finish the known intervals give, then looks again: a collective
        that started meanwhile pushes the finish later (once per such collective)."""
        env = self.env
        t0 = env.now
        end = self._finish(r, t0, work)
        while end > env.now:
            yield at(env, end)
            end = self._finish(r, t0, work)

    def _finish(self, r: int, t0: float, work: float) -> float:
        """When ``work`` seconds of compute begun at ``t0`` end, given the in-flight intervals
        of lane r's collectives known now."""
        live, comms = self._live[r], self.comms[r]
        if self._seen[r] < len(comms):
            live.extend(c for c, _ in comms[self._seen[r]:])
            self._seen[r] = len(comms)
        spans = []
        keep = []
        for c in live:
            if c.start is None:
                keep.append(c)
                continue
            e = c.start + c.duration
            if e > t0:  # ended before t0: irrelevant to this and every later segment
                keep.append(c)
                spans.append((max(c.start, t0), e))
        self._live[r] = keep
        sd = self.slowdown
        t, left = t0, work
        for a, b in sorted(spans):
            if b <= t:
                continue
            if a > t:  # full rate until the next collective starts
                if left <= a - t:
                    return t + left
                left -= a - t
                t = a
            if left * sd <= b - t:  # slowed until it (and those it overlaps) ends
                return t + left * sd
            left -= (b - t) / sd
            t = b
        return t + left
