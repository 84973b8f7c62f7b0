"""Barriers: collectives that move no data."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Op, c10d_method, register

if TYPE_CHECKING:
    from .matching import Call


class Barrier(Op):
    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        return []

    def execute(self, calls: list["Call"]) -> None:
        for c in calls:
            c.result = []


BARRIER = register(Barrier.named("barrier"))
MONITORED_BARRIER = register(Barrier.named("monitored_barrier"))


@c10d_method("barrier")
def _barrier(pg, opts=None):
    return pg.issue(BARRIER, [])


@c10d_method("monitored_barrier")
def _monitored_barrier(pg, timeout=None, wait_all_ranks=False):
    # a barrier whose wait has the call's own timeout: the group times it (its world keeps the
    # clocks and words the backend's timeout), so the registry needs nothing above it
    pg.wait_timed(pg.issue(MONITORED_BARRIER, []), timeout, wait_all_ranks)
    return None  # as gloo's
