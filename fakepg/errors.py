"""The exceptions fakepg raises. All derive from :class:`FakePGError`."""

from __future__ import annotations

from torch.distributed import DistBackendError, DistStoreError


class FakePGError(RuntimeError):
    """Base class of every error the fake cluster raises."""


class RealProcessesWarning(UserWarning):
    """A rank thread started real processes (``torch.multiprocessing.spawn``): they run on the
    real backend, outside the fake cluster. ``isolation="process"`` keeps them on it."""


class CollectiveMismatchError(FakePGError):
    """The ranks of a group issued calls that cannot form one collective.

    Raised in every participant and by :func:`fakepg.spawn`; the message lists each
    rank's call (op, shapes, dtypes, reduce op, root) and the source line that issued it.
    """


class InvalidCollectiveError(FakePGError, ValueError):
    """One rank's call is invalid on its own (a root or peer outside the group, a shape the op
    cannot take). Raised on that rank only, before anything is matched, so the program can
    catch it as it catches the backend's error: a ``RuntimeError`` as gloo raises it, and a
    ``ValueError`` as fakepg raised it before."""


class PeerCrashedError(FakePGError):
    """A collective that can never complete because a member rank died (an injected
    :func:`fakepg.faults.crash`) or failed (its own uncaught exception, ``sys.exit(n)``,
    ``os._exit(n)``); worded as the backend words a closed connection. Uncaught, it fails its
    rank like any other exception."""

    ends_world = True


class SharedStateError(FakePGError):
    """A rank used an object another rank created, reached through state that all rank
    threads share (a library's module global): thread mode cannot isolate it. The message
    names the global and says to declare it with ``fakepg.per_rank_globals`` or to run the
    ranks as processes (``isolation="process"``). It fails its rank and ends the world."""

    ends_world = True


class NativeWaitError(FakePGError):
    """A rank was about to wait inside native code (C++, Rust) on something only the fake
    world could provide -- which native code cannot reach, in thread or process mode -- such
    as a native ``TCPStore`` client of the world's own store address. Raised at once instead
    of the native timeout; it fails its rank and ends the world."""

    ends_world = True


class CollectiveHangError(FakePGError):
    """No rank can make progress: every unfinished rank waits on something that
    cannot complete. ``.report`` holds the per-rank report as text."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


class RankFailedError(FakePGError):
    """A rank raised an exception; ``.rank`` names it (the first to fail: torchrun's root
    cause) and ``__cause__`` is the original. ``.exit_codes`` gives every failed rank's exit
    code as torchrun would report its worker's: ``n`` for ``sys.exit(n)``/``os._exit(n)``, 1 for
    an uncaught exception, minus the signal number for a rank process killed by a signal."""

    def __init__(self, rank: int, message: str, exit_codes: dict[int, int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.exit_codes: dict[int, int] = dict(exit_codes or {})


class RankExited(FakePGError):
    """A rank's program ended with a non-zero exit status (``sys.exit(n)`` in a script under
    ``fakerun``, ``os._exit(n)`` on a rank thread): ``.exit_code``; ``__cause__`` says how."""

    ends_world = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RankOsExit(BaseException):
    """``os._exit(n)`` called on a rank thread: the rank ends (its process would), the other
    ranks and the caller go on. Derives from BaseException, like SystemExit, so that the
    program's ``except Exception`` does not swallow it."""

    def __init__(self, code: int):
        super().__init__(f"the rank called os._exit({code})")
        self.code = code


class WorldAbortedError(FakePGError):
    """Raised in the surviving ranks when the world ends because of another rank."""


class CollectiveTimeoutError(FakePGError):
    """A wait outlived the group's timeout (raised by simulators that keep time)."""


class TimedOutError(CollectiveHangError):
    """A wait with a timeout that failed: its message starts with the real backend's (or
    store's) wording, then fakepg's report. ``expired`` is True when the deadline passed
    while another rank was still running (the world goes on; the rank may handle it),
    False when the hang verdict decided no rank could ever satisfy the wait (at once)."""

    def __init__(self, message: str, report: str = "", expired: bool = False):
        RuntimeError.__init__(self, f"{message}\n{report}" if report else message)
        self.report = report or message
        self.expired = expired

    @property
    def ends_world(self) -> bool:
        # Unhandled, an expired timeout is the rank's own failure; a verdict already ended it.
        return self.expired


class BackendTimeoutError(TimedOutError, DistBackendError):
    """A collective's wait outlived its timeout (the group's, or monitored_barrier's).

    Both a :class:`CollectiveHangError` and torch's ``DistBackendError`` (a RuntimeError,
    which is what gloo raises), so programs' own timeout handlers and fakepg's both see it."""


class StoreTimeoutError(TimedOutError, DistStoreError):
    """A store ``get``/``wait`` outlived the store's timeout; also torch's ``DistStoreError``."""


class SpawnTimeoutError(FakePGError):
    """The world ran past ``spawn(timeout=...)``. ``.report`` gives each rank's state and
    Python stack at that moment; every rank thread was ended before spawn returned."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


def copy_to_raise(error: FakePGError) -> FakePGError:
    """A copy of ``error`` to raise in another thread (tracebacks are per raise); a rank that
    failed is, to the others, a world that was aborted."""
    if isinstance(error, CollectiveHangError):
        new: FakePGError = CollectiveHangError(error.report)
    elif isinstance(error, RankFailedError):
        new = WorldAbortedError(str(error))
    else:
        new = type(error)(*error.args)
    return new
