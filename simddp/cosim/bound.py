"""Which rank's clock the calling thread runs under: :func:`~simddp.cosim.simulate.simulate` binds
each rank thread to its :class:`~simddp.cosim.clock.RankClock`; the dispatch mode, the tape and
the checks read it. Its own module so that the tape (below the clock) can ask without importing
the clock."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .clock import RankClock

__all__ = ["current", "bind"]

_tls = threading.local()  # .clock: the calling rank thread's RankClock while simulating


def current() -> "RankClock | None":
    """The calling rank thread's clock (None outside a simulated rank)."""
    return getattr(_tls, "clock", None)


def bind(clock: "RankClock | None") -> None:
    """Make ``clock`` the calling thread's clock (None: unbind)."""
    _tls.clock = clock
