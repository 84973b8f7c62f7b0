"""The errors virtual time adds to the fake cluster.

Both end the world when they escape a rank's function (other ranks' pending and later
collectives fail, as after a real backend error), and :func:`simddp.simulate` re-raises
the original error rather than fakepg's ``RankFailedError`` wrapper. Caught inside the
rank, they are ordinary exceptions and the world goes on.
"""

from __future__ import annotations

from fakepg.errors import CollectiveTimeoutError as _FakePGTimeout
from fakepg.errors import FakePGError
from fakepg.launch.explore import ExplorationError as _FakeExplorationError

__all__ = ["CollectiveRaceError", "CollectiveTimeoutError", "ExplorationError"]


class CollectiveRaceError(FakePGError):
    """A rank read or wrote a tensor that an asynchronous collective it issued from Python was
    still writing (in virtual time), without a ``wait()`` on that work first.

    Attributes: ``rank`` (global rank that touched the tensor), ``op``, ``group``, ``seq``
    (the collective), ``issued_at`` and ``accessed_at`` (``file:line``), ``time`` (the
    rank's virtual clock at the access, seconds).
    """

    ends_world = True  # fakepg: an escaped race error ends the world like a user exception

    def __init__(self, message: str, *, rank: int | None = None, op: str | None = None,
                 group: str | None = None, seq: int | None = None, issued_at: str | None = None,
                 accessed_at: str | None = None, time: float | None = None) -> None:
        super().__init__(message)
        self.rank, self.op, self.group, self.seq = rank, op, group, seq
        self.issued_at, self.accessed_at, self.time = issued_at, accessed_at, time


class CollectiveTimeoutError(_FakePGTimeout):
    """A wait (explicit, or the stream wait of an op on a collective's output) on a collective
    that, in virtual time, ends more than the timeout after this rank issued it.

    Raised on the waiting rank, with NCCL's watchdog wording, at virtual time
    ``issue + timeout`` (``time``). Also a ``fakepg.CollectiveTimeoutError``.
    Attributes: ``rank``, ``op``, ``group``, ``seq``, ``timeout`` (seconds), ``time``.
    """

    ends_world = True

    def __init__(self, message: str, *, rank: int | None = None, op: str | None = None,
                 group: str | None = None, seq: int | None = None, timeout: float | None = None,
                 time: float | None = None) -> None:
        super().__init__(message)
        self.rank, self.op, self.group, self.seq = rank, op, group, seq
        self.timeout, self.time = timeout, time


class ExplorationError(_FakeExplorationError):
    """:func:`simddp.explore` found a timing under which the program fails (a
    :class:`fakepg.ExplorationError`, so one ``except`` catches both kinds of exploration).

    ``.schedule`` (also ``.token``) is the replay token (``"sd1:..."``) of the shrunk timing,
    ``.timing`` that :class:`~simddp.Timing`, ``.deviations`` how it differs from the base
    timing (one line each), ``.runs`` the runs explored and ``.shrink_runs`` the runs spent
    shrinking; ``__cause__`` is the failure itself. The message ends with a one-line replay.
    """

    def __init__(self, message: str, *, schedule: str, timing: object = None,
                 deviations: list[str] | None = None, runs: int = 0,
                 shrink_runs: int = 0) -> None:
        FakePGError.__init__(self, message)
        self.schedule = self.token = schedule
        self.timing = timing
        self.deviations = list(deviations or [])
        self.runs, self.shrink_runs = runs, shrink_runs
