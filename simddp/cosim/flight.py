"""One rank's part of one collective, as co-simulation's virtual time sees it."""

from __future__ import annotations

from typing import Any

__all__ = ["Flight"]


class Flight:
    """One rank's part of one collective, as virtual time sees it."""

    __slots__ = ("call", "rank", "issue", "start", "end", "cb_end", "python_async",
                 "in_backward", "stream", "ptrs", "retired")

    def __init__(self, call: Any, issue: float) -> None:
        self.call = call
        self.rank: int = call.rank
        self.issue = issue
        self.start: float | None = None
        self.end: float | None = None
        self.cb_end: float | None = None
        self.in_backward: bool = bool(call.in_backward)
        # fakepg marks calls whose caller waits from C++ (the Reducer in backward, Join's
        # shadow of it): those follow stream semantics; the rest were issued from Python.
        hidden = call.hidden_wait
        self.stream = bool(hidden) or self.in_backward
        self.python_async: bool = bool(call.record.async_op) and not self.stream
        self.ptrs: list[int] = []
        self.retired = False

    def eff_end(self) -> float | None:
        """When the work is done, future callbacks included (None before it is matched)."""
        if self.end is None:
            return None
        return self.end if self.cb_end is None or self.cb_end < self.end else self.cb_end

    def describe(self) -> str:
        rec = self.call.record
        return f"{rec.op} #{rec.seq} on group '{rec.group}' (ranks {list(rec.group_ranks)})"
