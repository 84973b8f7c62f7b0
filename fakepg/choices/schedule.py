"""Controlled choices: every point where a real multi-process run could go more than one way.

A fake world runs one interleaving: round robin at hand-offs, the earliest send for a
receive from any source, collectives visible as completed once they are. A
:class:`Schedule` turns each such point into a numbered choice whose option 0 is that
default, so a run is a pure function of (program, seed, schedule), and one alternative is a
short list of deviations, written as a token::

    fakepg.spawn(train, nprocs=2, schedule="fp1:AwE")     # replay one exact alternative

Choice points (``kind``):

* ``"run"``: which runnable rank takes the baton at a hand-off (options in round-robin order);
* ``"preempt"``: at a store operation, whether the rank first yields to another runnable
  rank (1) or goes on (0) -- a store counter taken in another order;
* ``"any_source"``: which pending send a ``recv(src=None)`` matches (earliest first);
* ``"completed"``: whether a finished collective is already visible as completed to
  ``work.is_completed()`` / ``future.done()`` (0: yes, 1: not yet);
* ``"callback_order"``: which of a rank's finished works completes first (their futures'
  callbacks run in that order; default: issue order).

:func:`fakepg.explore` draws the choices and shrinks failing runs to the fewest deviations.
"""

from __future__ import annotations

import base64
from typing import Callable, Sequence

_PREFIX = "fp1:"
KINDS = ("run", "preempt", "any_source", "completed", "callback_order")


class Schedule:
    """The choices of one run: ``forced`` indices in order (beyond them, the defaults), or a
    ``chooser(kind, n) -> index`` that decides each one (exploration)."""

    def __init__(self, forced: Sequence[int] = (),
                 chooser: Callable[[str, int], int] | None = None) -> None:
        self.forced = list(forced)
        self.chooser = chooser
        self.made: list[tuple[str, int, int]] = []  # (kind, number of options, index)

    @property
    def active(self) -> bool:
        """Whether any choice can differ from the default (else the fast default paths run,
        which take option 0 everywhere without counting choices)."""
        return self.chooser is not None or any(self.forced)

    def choose(self, kind: str, n: int) -> int:
        """The option (0..n-1) taken at this choice point; 0 is the default behaviour."""
        if n <= 1:
            return 0
        i = len(self.made)
        if self.chooser is not None:
            idx = self.chooser(kind, n)
        elif i < len(self.forced):
            idx = self.forced[i]
        else:
            idx = 0
        idx = idx if 0 <= idx < n else 0  # a replayed token on a changed program: default
        self.made.append((kind, n, idx))
        return idx

    @property
    def deviations(self) -> list[tuple[int, str, int]]:
        """(choice number, kind, option) of every non-default choice made."""
        return [(i, kind, idx) for i, (kind, _, idx) in enumerate(self.made) if idx]

    @property
    def token(self) -> str:
        """The choices made, as a replay token (trailing defaults dropped)."""
        idx = [i for _, _, i in self.made]
        while idx and idx[-1] == 0:
            idx.pop()
        return encode(idx)

    def describe(self) -> str:
        devs = self.deviations
        if not devs:
            return "the default schedule"
        return ", ".join(f"choice #{i} ({kind}) took option {opt}" for i, kind, opt in devs)


def encode(indices: Sequence[int]) -> str:
    """Indices as a compact token: unsigned LEB128 varints, base64url without padding."""
    out = bytearray()
    for v in indices:
        v = int(v)
        while True:
            byte = v & 0x7F
            v >>= 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                break
    return _PREFIX + base64.urlsafe_b64encode(bytes(out)).decode().rstrip("=")


def decode(token: str) -> list[int]:
    if not isinstance(token, str) or not token.startswith(_PREFIX):
        raise ValueError(f"not a fakepg schedule token: {token!r} (tokens start with {_PREFIX!r}; "
                         f"fakepg.explore prints them)")
    body = token[len(_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except ValueError:
        raise ValueError(f"corrupt fakepg schedule token: {token!r}") from None
    out, v, shift = [], 0, 0
    for byte in raw:
        v |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(v)
            v, shift = 0, 0
    return out


def as_schedule(schedule: "Schedule | str | None") -> Schedule:
    """spawn's ``schedule=`` argument: None (default), a token, or a Schedule."""
    if schedule is None:
        return Schedule()
    if isinstance(schedule, Schedule):
        return schedule
    return Schedule(decode(schedule))
