"""What a fake world leaves behind: :class:`SpawnResult`, or the error ``spawn`` raises."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..ops import trace as _trace
from ..errors import (CollectiveHangError, CollectiveMismatchError, RankExited, RankFailedError,
                      RankOsExit, WorldAbortedError)
from ..sites import traceback_site
from ..ops.trace import CollectiveRecord

if TYPE_CHECKING:
    from .cluster import Cluster
    from .scheduler import Scheduler


@dataclass
class SpawnResult:
    """What a fake world leaves behind."""

    returns: list[Any]
    trace: list[list[CollectiveRecord]]
    nprocs: int
    seed: int
    wall_time: float = 0.0
    crashed: list[int] = field(default_factory=list)  # ranks an injected crash ended
    # The hang report of a verdict every rank handled itself (caught the error it raised and
    # returned, as a torchrun worker that catches its timeout exits 0); None when none was.
    hang_report: str | None = None

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The collective trace as JSON (bitwise identical for identical runs)."""
        return _trace.to_json(self.trace, path)

    def dump_flight_recorder(self, directory: str | os.PathLike, prefix: str = "rank") -> list[str]:
        """Write torch Flight Recorder dumps, one per rank, readable by ``fr_trace``."""
        return _trace.dump_flight_recorder(self.trace, directory, prefix)

    def summary(self) -> str:
        """A per-rank table of collectives issued: op -> count, bytes."""
        lines = []
        for rank, recs in enumerate(self.trace):
            counts: dict[str, list[int]] = {}
            for r in recs:
                c = counts.setdefault(r.op, [0, 0])
                c[0] += 1
                c[1] += r.bytes
            parts = ", ".join(f"{op}×{n} ({b / 1e6:.2f} MB)" for op, (n, b) in sorted(counts.items()))
            lines.append(f"rank {rank}: {len(recs)} collectives: {parts}")
        return "\n".join(lines)


def raise_outcome(sched: "Scheduler", cluster: "Cluster", failures: dict[int, BaseException]) -> None:
    """Raise what the world's end means for the caller: nothing when every rank returned, also
    after a hang verdict that every rank handled (``torch.multiprocessing.spawn`` and torchrun
    succeed when every worker exits 0)."""
    __tracebackhide__ = True  # pytest: show the user's frames, not the harness's
    codes = {r: exit_code(e) for r, e in sorted(failures.items())}
    refusal = getattr(cluster, "native_refusal", None)
    if refusal is not None and failures:
        # the root cause, whatever the ranks then raised (the program caught the refusal)
        r = getattr(refusal, "rank", None)
        r = r if r in failures else min(failures)
        raise RankFailedError(r, f"rank {r} failed: {_name(refusal)}: {refusal}\n(raised at "
                                 f"{exception_site(refusal)}, in a thread the program started; "
                                 f"the ranks' own errors followed from it)", codes) from refusal
    if cluster.failed_rank is not None:
        r = cluster.failed_rank
        e = failures[r]
        raise RankFailedError(r, f"rank {r} failed: {_name(e)}: {e}\n"
                                 f"(raised at {exception_site(e)})", codes) from e
    own = {r: e for r, e in failures.items() if not _consequence(e)}
    if sched.hang is not None and own:
        # A rank's own error (an invalid peer, say) left the others waiting on it: that error
        # is the cause, as torchrun reports the first worker that failed; the hang follows.
        r = min(own)
        e = own[r]
        raise RankFailedError(r, f"rank {r} failed: {_name(e)}: {e}\n(raised at "
                                 f"{exception_site(e)}); then the other ranks waited on it:\n"
                                 f"{sched.hang.report}", codes) from e
    if sched.hang is not None and failures:
        raise CollectiveHangError(sched.hang.report)
    for e in failures.values():
        if isinstance(e, CollectiveMismatchError):
            raise CollectiveMismatchError(*e.args)
    for r, e in failures.items():
        raise RankFailedError(r, f"rank {r} failed: {_name(e)}: {e}", codes) from e


def _name(e: BaseException) -> str:
    return type(e).__name__


def exit_code(e: BaseException) -> int:
    """The exit code torchrun would report for a worker that ended with ``e``: ``n`` for
    ``sys.exit(n)``/``os._exit(n)``, minus the signal of a rank process killed by one, 1 for an
    uncaught exception (Python's own exit status then)."""
    for attr in ("exit_code", "exitcode"):  # RankExited; a rank process's RankProcessDiedError
        code = getattr(e, attr, None)
        if isinstance(code, int):
            return code
    if isinstance(e, RankOsExit):
        return e.code
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 1


def ended_how(e: BaseException) -> str:
    """How a rank that failed with ``e`` ended, for the collectives that needed it."""
    code = exit_code(e)
    if code < 0 and isinstance(getattr(e, "exitcode", None), int):  # a rank process's signal
        return f"was killed by signal {-code}"
    if isinstance(e, (RankOsExit, SystemExit, RankExited)) or hasattr(e, "exitcode"):
        return f"exited with code {code}"
    return f"failed with {_name(e)} (exit code {exit_code(e)})"


def _consequence(e: BaseException) -> bool:
    """Whether ``e`` is what another rank's state did to this one (a hang verdict, a world
    ended elsewhere, a mismatch every member sees, an error raised while unwinding from the
    hang verdict) rather than the rank's own failure."""
    return isinstance(e, (CollectiveHangError, WorldAbortedError, CollectiveMismatchError)) \
        or during_hang(e)


def during_hang(e: BaseException) -> bool:
    """Whether ``e`` was raised while a hang verdict unwound (a ``with lock:`` whose lock the
    verdict released fails on its release): a consequence of the hang, the reported cause."""
    seen = e.__context__
    while seen is not None:
        if isinstance(seen, CollectiveHangError):
            return True
        seen = seen.__context__
    return False


def exception_site(e: BaseException) -> str:
    """The user's line that raised ``e`` (``file:line``); for an error fakepg raised on the
    rank's behalf (a script's ``sys.exit``), the user's line of its cause."""
    remote = getattr(e, "_fakepg_site", None)  # raised in a rank's process (isolation="process")
    if remote is not None:
        return remote
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            break
        site = traceback_site(seen.__traceback__)
        if site is not None:
            return site
        seen = seen.__cause__
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "<unknown>"
