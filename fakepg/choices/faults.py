"""Injected faults: a rank that dies, or raises, at a chosen collective.

Fault-tolerance code (retry, abort-and-reconfigure, checkpoint/restart) can only be tested
if something fails. ``fakepg.spawn(..., faults=[...])`` makes it happen at an exact point of
the program, deterministically::

    from fakepg import faults
    fakepg.spawn(train, nprocs=4, faults=[faults.crash(2, at=5)])

* :func:`crash` -- the rank dies when it issues its ``at``-th collective (counting from 0),
  as a process would: it issues nothing more, its thread ends, and the world goes on. Every
  collective of a group holding it that cannot complete any more (pending, or issued later)
  fails in its peers with the backend's error (gloo: ``Connection closed by peer``), a
  ``RuntimeError`` the program can catch. The survivors may abort the broken group
  (``ProcessGroup.abort()`` / ``_abort_process_group``) and go on in a new group without it.
  ``spawn`` returns normally if they do; ``result.crashed`` lists the dead ranks.
* :func:`raise_in` -- the rank raises ``exc`` there instead (an ordinary rank failure unless
  the program catches it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..arguments import integer

CONNECTION_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                     "Connection closed by peer [127.0.0.1]:{port}")


class RankCrashed(BaseException):
    """Ends a crashed rank's thread (a BaseException: the program's ``except Exception``
    must not catch a death)."""


@dataclass(frozen=True, repr=False)
class Crash:
    rank: int
    at: int

    def __repr__(self) -> str:  # as the call that makes it (replay lines print it)
        return f"faults.crash({self.rank}, at={self.at})"


@dataclass(frozen=True, repr=False)
class RaiseIn:
    rank: int
    at: int
    exc: BaseException

    def __repr__(self) -> str:
        return f"faults.raise_in({self.rank}, at={self.at}, exc={self.exc!r})"


def crash(rank: int, at: int = 0) -> Crash:
    """``rank`` dies when it issues its ``at``-th collective (0 = its first)."""
    return Crash(integer("faults.crash: rank", rank, minimum=0),
                 integer("faults.crash: at", at, minimum=0))


def raise_in(rank: int, at: int = 0, exc: BaseException | type[BaseException] = RuntimeError) -> RaiseIn:
    """``rank`` raises ``exc`` (an exception or class) when it issues its ``at``-th collective."""
    if isinstance(exc, type) and issubclass(exc, BaseException):
        exc = exc(f"fault injected by fakepg.faults.raise_in at collective #{at}")
    if not isinstance(exc, BaseException):
        raise TypeError(f"faults.raise_in: exc must be an exception or exception class, got {exc!r}")
    return RaiseIn(integer("faults.raise_in: rank", rank, minimum=0),
                   integer("faults.raise_in: at", at, minimum=0), exc)


def check(faults: Sequence[Any] | None, nprocs: int) -> tuple[Any, ...]:
    """spawn's ``faults=`` argument, checked against the world size."""
    if isinstance(faults, (Crash, RaiseIn)):
        raise TypeError(f"fakepg.spawn: faults must be a list of faults, got the single fault "
                        f"{faults!r}; write faults=[{faults!r}]")
    if faults is not None and not isinstance(faults, (list, tuple)):
        raise TypeError(f"fakepg.spawn: faults must be a list of faults from fakepg.faults "
                        f"(crash, raise_in), got {type(faults).__name__} {faults!r}")
    out = tuple(faults or ())
    for f in out:
        if not isinstance(f, (Crash, RaiseIn)):
            raise TypeError(f"fakepg.spawn: faults must come from fakepg.faults (crash, raise_in), "
                            f"got {f!r}")
        if f.rank >= nprocs:
            raise ValueError(f"fakepg.spawn: a fault names rank {f.rank}, but the world has "
                             f"ranks 0..{nprocs - 1}")
    return out


def due(faults: tuple[Any, ...], rank: int, issued: int) -> Any:
    """The fault that fires as ``rank`` issues its ``issued``-th collective, if any."""
    for f in faults:
        if f.rank == rank and f.at == issued:
            return f
    return None
