"""Controlled choices: every point where a real multi-process run could go more than one way.

A fake world runs one interleaving: round robin at hand-offs, the earliest send for a
receive from any source, collectives visible as completed once they are. A
:class:`Schedule` turns each such point into a numbered choice whose option 0 is that
default, so a run is a pure function of (program, seed, schedule), and one alternative is a
short list of deviations, written as a token::

    fakepg.spawn(train, nprocs=2, schedule="fp2:AoDXAQE")  # replay one exact alternative

A token also carries the world size and a fingerprint of the choice points it passes (their
kinds and numbers of options), so a token replayed on another program, world size or seed
fails with an error that says so instead of silently running some other schedule.

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
import re
import zlib
from typing import Callable, Sequence

_PREFIX = "fp2:"
_BODY = re.compile(r"[A-Za-z0-9_-]*")
KINDS = ("run", "preempt", "any_source", "completed", "callback_order")


class Schedule:
    """The choices of one run: ``forced`` indices in order (beyond them, the defaults), or a
    ``chooser(kind, n) -> index`` that decides each one (exploration)."""

    def __init__(self, forced: Sequence[int] = (),
                 chooser: Callable[[str, int], int] | None = None, *,
                 token: str | None = None, made_on: tuple[int, int] | None = None) -> None:
        self.forced = list(forced)
        self.chooser = chooser
        self.made: list[tuple[str, int, int]] = []  # (kind, number of options, index)
        self.nprocs = 0  # the world it runs in (spawn sets it; tokens record it)
        # a token's: the text, and (world size, fingerprint) of the run it was made on
        self._token, self._made_on = token, made_on
        self._misfit: str | None = None  # the first choice point a token's option does not fit

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
            if not 0 <= idx < n and self._made_on is not None and self._misfit is None:
                self._misfit = (f"its choice #{i} takes option {idx}, but this run offers "
                                f"{n} options ({kind}) there")
        else:
            idx = 0
        # (an exploration's own trial on earlier changed choices: the default, silently)
        idx = idx if 0 <= idx < n else 0
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
        return encode([self.nprocs, _fingerprint(self.made[:len(idx)]), *idx])

    def check_world(self, nprocs: int) -> None:
        """Before a run: a token made on another world size is refused."""
        self.nprocs = nprocs
        if self._made_on is not None and self._made_on[0] != nprocs:
            raise ValueError(self._unfit(f"it was made on a world of {self._made_on[0]} ranks, "
                                         f"this one has nprocs={nprocs}"))

    def check_replayed(self) -> None:
        """After a run: raise if the token's choices did not fit the run's choice points
        (another program, a changed one, or another seed)."""
        if self._made_on is None:
            return
        why = self._misfit
        if why is None and len(self.made) < len(self.forced):
            why = (f"it takes {len(self.forced)} choices, this run made only {len(self.made)}")
        if why is None and _fingerprint(self.made[:len(self.forced)]) != self._made_on[1]:
            why = "the choice points this run passed are not those the token was made on"
        if why is not None:
            raise ValueError(self._unfit(why))

    def _unfit(self, why: str) -> str:
        return (f"fakepg schedule token {self._token!r} does not fit this run: {why}. A token "
                f"replays the program, nprocs and seed fakepg.explore ran it with; for another "
                f"one, run fakepg.explore on it for a token of its own")

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


def _fingerprint(made: Sequence[tuple[str, int, int]]) -> int:
    """16 bits that tell the choice points (kind, number of options) of a run's prefix."""
    return zlib.crc32(";".join(f"{kind}{n}" for kind, n, _ in made).encode()) & 0xFFFF


def decode(token: str) -> list[int]:
    """A token's varints: world size, fingerprint, then the choices."""
    if not isinstance(token, str) or not token.startswith(_PREFIX):
        older = isinstance(token, str) and token.startswith("fp1:")
        raise ValueError(f"not a fakepg schedule token: {token!r} (tokens start with {_PREFIX!r}"
                         + ("; this one comes from an older fakepg: run fakepg.explore again"
                            if older else "; fakepg.explore prints them") + ")")
    body = token[len(_PREFIX):]
    corrupt = ValueError(f"corrupt fakepg schedule token: {token!r} (copy it whole, as "
                         f"fakepg.explore printed it)")
    if not _BODY.fullmatch(body) or len(body) % 4 == 1:
        raise corrupt
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    out, v, shift = [], 0, 0
    for byte in raw:
        v |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(v)
            v, shift = 0, 0
    if shift or len(out) < 2 or out[0] < 1 or out[1] > 0xFFFF or out[-1] == 0 and len(out) > 2:
        raise corrupt  # a cut varint, no world size and fingerprint, or a cut choice list
    return out


def as_schedule(schedule: "Schedule | str | None") -> Schedule:
    """spawn's ``schedule=`` argument: None (default), a token, or a Schedule."""
    if schedule is None:
        return Schedule()
    if isinstance(schedule, Schedule):
        return schedule
    nprocs, fingerprint, *forced = decode(schedule)
    return Schedule(forced, token=schedule, made_on=(nprocs, fingerprint))
