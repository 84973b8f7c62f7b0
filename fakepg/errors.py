"""The exceptions fakepg raises. All derive from :class:`FakePGError`."""

from __future__ import annotations


class FakePGError(RuntimeError):
    """Base class of every error the fake cluster raises."""


class CollectiveMismatchError(FakePGError):
    """The ranks of a group issued calls that cannot form one collective.

    Raised in every participant and by :func:`fakepg.spawn`; the message lists each
    rank's call (op, shapes, dtypes, reduce op, root) and the source line that issued it.
    """


class CollectiveHangError(FakePGError):
    """No rank can make progress: every unfinished rank waits on something that
    cannot complete. ``.report`` holds the per-rank report as text."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


class RankFailedError(FakePGError):
    """A rank raised an exception; ``.rank`` names it and ``__cause__`` is the original."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class WorldAbortedError(FakePGError):
    """Raised in the surviving ranks when the world ends because of another rank."""


class CollectiveTimeoutError(FakePGError):
    """A wait outlived the group's timeout (raised by simulators that keep time)."""
