"""Extension points for layers built on the fake cluster (a timing model's virtual clocks).

A :class:`WorldHooks` instance passed to :func:`fakepg.spawn` is told about each rank's
start and end, every collective issued and matched, and every completed wait. All
calls happen on the rank thread that holds the baton, so hooks need no locking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..ops.matching import Call, PendingCollective


class WorldHooks:
    """No-op base class; override what you need."""

    def rank_started(self, rank: int) -> None:
        """On the rank's thread, before the user's function runs."""

    def rank_finished(self, rank: int) -> None:
        """On the rank's thread, after the user's function returned or raised."""

    def collective_issued(self, call: "Call") -> None:
        """A rank issued its part of a collective (``call.record`` is in the trace)."""

    def collective_matched(self, coll: "PendingCollective") -> None:
        """Every member issued; results are written. Runs on the last issuer's thread."""

    def completion_started(self, call: "Call") -> None:
        """Callbacks of ``call``'s future (``then``, done callbacks) run from here, on the
        rank's thread, until the matching ``completion_finished`` (pairs may nest)."""

    def completion_finished(self, call: "Call") -> None:
        """The callbacks that ``completion_started`` announced have run."""

    def wait_finished(self, rank: int, coll: "PendingCollective") -> None:
        """``rank`` finished waiting on ``coll`` (Work.wait, Future.wait, a sync call)."""

    def describe_rank(self, rank: int) -> str:
        """Extra words for the hang report (e.g. the rank's virtual clock)."""
        return ""
