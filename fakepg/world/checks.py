"""The checks a world runs on its collectives: one interface, many implementations.

Whatever makes the fake world refuse, warn about or hold back what a real backend would — a
backend's refusals (:class:`fakepg.fidelity.backends.Refusals`), NCCL's hazards
(:class:`fakepg.fidelity.nccl_hazards.NcclHazards`), gloo's
(:class:`fakepg.fidelity.gloo_hazards.GlooHazards`) — is a :class:`Checker`. A world holds its
checkers in one list, :class:`Checkers`, which calls each of them at every point of a
collective's life, as pytest calls every plugin's implementation of a hook. A new check is a
new checker in the list :func:`fakepg.spawn` builds, never a new call site in the world.

This module also knows which work's future callback the calling thread runs
(:class:`running_callback_of`): real backends run callbacks on their own threads, which is
what gloo's hazard is about.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from ..ops.matching import Call, PendingCollective


class Checker:
    """One check of a world's collectives. Every hook is optional (the base does nothing);
    a hook raises to fail the rank that made the call, or warns."""

    def calling(self, pg: Any, method: str, args: tuple, kwargs: dict) -> None:
        """A ProcessGroup ``method`` (``allreduce``, ``broadcast``, ...) of ``pg`` called with
        the program's own arguments, before any call is made of them: raise to refuse them,
        as c10d's dispatcher and a backend check a call's arguments first."""

    def issuing(self, call: "Call") -> None:
        """Before ``call`` reaches the world, as torch checks devices and arguments before a
        backend sees a call: raise to refuse it."""

    def issued(self, call: "Call") -> None:
        """After ``call`` took its place in its group's sequence."""

    def holds(self, call: "Call") -> bool:
        """A point-to-point ``call`` about to match: True keeps it back until
        :meth:`released` gives it back."""
        return False

    def released(self, coll: "PendingCollective") -> Iterable["Call"]:
        """After a point-to-point pair matched: the held calls that may match now."""
        return ()

    def future_made(self, future: Any, call: "Call") -> None:
        """``future`` (the work's, or one chained on it) completes ``call``'s work."""

    def call_of(self, future: Any, rank: int) -> "Call | None":
        """The call whose work ``future`` completes, if this checker follows it."""
        return None

    def waited(self, call: "Call") -> None:
        """The program waited for ``call``'s work (the wait returned or is about to raise)."""

    def hang_notes(self) -> list[str]:
        """Lines for the hang report: what this checker held back, and why."""
        return []


class Checkers:
    """A world's checkers, each hook called on every one of them in order."""

    def __init__(self, checkers: Iterable[Checker] = ()) -> None:
        self.all: tuple[Checker, ...] = tuple(checkers)
        for c in self.all:
            if not isinstance(c, Checker):
                raise TypeError(f"a world's checks must be fakepg.world.checks.Checker instances, "
                                f"got {type(c).__name__}")
        # Every collective passes several hooks: each asks only the checkers that override it
        # (the base's hooks do nothing), in the list's order.
        def overriding(hook: str) -> tuple[Checker, ...]:
            base = getattr(Checker, hook)
            return tuple(c for c in self.all
                         if getattr(getattr(c, hook), "__func__", getattr(c, hook)) is not base)

        self.calls_checked = overriding("calling")
        self._issuing, self._issued = overriding("issuing"), overriding("issued")
        self._holds, self._released = overriding("holds"), overriding("released")
        self._future_made, self._call_of = overriding("future_made"), overriding("call_of")
        self._waited = overriding("waited")

    def calling(self, pg: Any, method: str, args: tuple, kwargs: dict) -> None:
        for c in self.calls_checked:
            c.calling(pg, method, args, kwargs)

    def issuing(self, call: "Call") -> None:
        for c in self._issuing:
            c.issuing(call)

    def issued(self, call: "Call") -> None:
        for c in self._issued:
            c.issued(call)

    def holds(self, call: "Call") -> bool:
        held = False
        for c in self._holds:  # every one sees the call (they track what they may hold later)
            held = c.holds(call) or held
        return held

    def released(self, coll: "PendingCollective") -> Iterator["Call"]:
        for c in self._released:
            yield from c.released(coll)

    def future_made(self, future: Any, call: "Call") -> None:
        for c in self._future_made:
            c.future_made(future, call)

    def call_of(self, future: Any, rank: int) -> "Call | None":
        for c in self._call_of:
            call = c.call_of(future, rank)
            if call is not None:
                return call
        return None

    def waited(self, call: "Call") -> None:
        for c in self._waited:
            c.waited(call)

    def hang_notes(self) -> list[str]:
        return [line for c in self.all for line in c.hang_notes()]


_CALLBACK = threading.local()  # .call: the call whose work's callback this thread runs, if any


class running_callback_of:
    """Marks the current thread as running a future callback of ``call``'s work."""

    __slots__ = ("call", "saved")

    def __init__(self, call: "Call | None") -> None:
        self.call = call

    def __enter__(self) -> None:
        self.saved = getattr(_CALLBACK, "call", None)
        _CALLBACK.call = self.call

    def __exit__(self, *exc: Any) -> None:
        _CALLBACK.call = self.saved


def callback_running() -> "Call | None":
    """The call whose work's future callback the calling thread runs, or None."""
    return getattr(_CALLBACK, "call", None)


__all__ = ["Checker", "Checkers", "running_callback_of", "callback_running"]
