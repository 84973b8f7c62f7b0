"""gloo's hazard: a collective issued from a future callback races the program's own.

Real gloo completes a work on its worker thread and runs the work's future callbacks there, at
once. A callback that issues a collective (PowerSGD's P and Q all_reduces, a quantization hook's
second all_gather, any ``fut.then(lambda f: dist.all_reduce(..., async_op=True))``) therefore
takes its place in the group's sequence whenever the first work happens to finish — before or
after the collectives the program issues meanwhile on that group (the Reducer's next bucket).
Ranks can disagree on the order, and gloo then pairs different collectives: a size-mismatch
error ("Received data size doesn't match expected size") or a hang. Measured with real gloo
here: PowerSGD with several buckets hangs at 2 ranks. NCCL runs the callback when the work is
enqueued, in issue order, so the same program is fine there (hence torch's PowerSGD parity
test runs on NCCL only, pytorch/pytorch#58467).

fakepg runs callbacks in a fixed order, so without this check such a program passes. Under the
``"gloo"`` personality a collective on group G issued from a callback of work W, and one the
program issues on G after W and before it waits for W (or, inside backward, before backward
ends — where the Reducer waits for its comm hooks' futures), raise :class:`GlooHazardError`
naming both and their source lines. ``fakepg.spawn(..., gloo_hazards="warn")`` makes it a
:class:`GlooHazardWarning`, ``"off"`` silences it. Thread mode only (in process mode the
callbacks run in the rank processes).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any


from ..torch_private import current_autograd_node, queue_callback
from ..errors import FakePGError
from ..world.checks import Checker, callback_running

if TYPE_CHECKING:
    from ..ops.matching import Call

MODES = ("error", "warn", "off")
_MAX_UNWAITED = 64  # per rank: the program's unwaited collectives a callback's is compared with


class GlooHazardError(FakePGError):
    """Under gloo, a collective issued from a future callback and one issued by the program
    take their places on a group in an order that depends on timing."""


class GlooHazardWarning(UserWarning):
    """A gloo hazard seen with ``gloo_hazards="warn"``."""


def _site(call: "Call") -> str:
    rec = call.record
    return f"{rec.op} #{rec.seq} on group '{rec.group}' at {call.site}"


class _Rank:
    __slots__ = ("issued", "from_callbacks", "from_program", "roots", "futures", "in_backward",
                 "deferred")

    def __init__(self) -> None:
        self.issued = 0  # this rank's collectives so far, on any group
        self.from_callbacks: list[tuple[int, Call]] = []  # issued from a callback, not waited
        self.from_program: list[tuple[int, Call]] = []    # issued by the program, not waited
        self.roots: dict[int, tuple[int, Call]] = {}      # id(call) -> its chain's first work
        self.futures: dict[int, tuple[Any, Call]] = {}    # id(future) -> (future, its work's call)
        self.in_backward = False  # an end-of-backward callback is queued
        self.deferred: GlooHazardError | None = None  # raised in a callback: the program's too


class GlooHazards(Checker):
    """One world's gloo hazard checker (a :class:`~fakepg.world.checks.Checker`: the world
    calls it at issue and at wait, and for each future a fakepg work hands out)."""

    def __init__(self, mode: str = "error") -> None:
        if mode not in MODES:
            raise ValueError(f"gloo_hazards must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._ranks: dict[int, _Rank] = {}
        self._warned: set[Any] = set()

    def future_made(self, fut: Any, call: "Call") -> None:
        """``fut`` (or a future chained on it) completes ``call``'s work: its callbacks run
        as that work's."""
        if self.mode != "off" and call.personality == "gloo":
            self._rank(call.rank).futures[id(fut)] = (fut, call)

    def call_of(self, fut: Any, rank: int) -> "Call | None":
        me = self._ranks.get(rank)
        entry = me.futures.get(id(fut)) if me is not None else None
        return entry[1] if entry is not None and entry[0] is fut else None

    def _rank(self, rank: int) -> _Rank:
        me = self._ranks.get(rank)
        if me is None:
            me = self._ranks[rank] = _Rank()
        return me

    def issued(self, call: "Call") -> None:
        if self.mode == "off" or call.personality != "gloo" or call.spec.p2p:
            return
        me = self._rank(call.rank)
        me.issued += 1
        here = (me.issued, call)
        group = call.record.group
        parent = callback_running()
        if parent is not None and parent.rank == call.rank:  # issued from a callback
            root = me.roots.get(id(parent), (0, parent))
            me.roots[id(call)] = root
            for i, d in me.from_program:  # the program went on after the root, before this
                if d.record.group == group and i > root[0] and d is not root[1]:
                    try:
                        self._report(call, root[1], d)
                    except GlooHazardError as e:
                        # it fails the callback's future, which the program may never wait
                        # for: its next collective or wait raises it too
                        me.deferred = e
                        raise
            me.from_callbacks.append(here)
        else:
            self._raise_deferred(me)
            for _, c in me.from_callbacks:
                if c.record.group == group:
                    self._report(c, me.roots[id(c)][1], call)
            me.from_program.append(here)
            me.roots[id(call)] = here
            if len(me.from_program) > _MAX_UNWAITED:  # works never waited: bound the cost
                del me.from_program[0]
        if not me.in_backward and current_autograd_node() is not None:
            me.in_backward = True  # the Reducer waits for its hooks' futures as backward ends
            queue_callback(
                lambda: self._forget(call.rank))

    def waited(self, call: "Call") -> None:
        me = self._ranks.get(call.rank)
        if me is None:
            return
        self._raise_deferred(me)
        if id(call) not in me.roots:
            return
        root = me.roots[id(call)][1]
        me.from_callbacks = [(i, c) for i, c in me.from_callbacks if me.roots[id(c)][1] is not root]
        me.from_program = [(i, d) for i, d in me.from_program if d is not call]
        if not me.from_callbacks and not me.from_program:
            me.roots.clear()
            me.futures.clear()

    @staticmethod
    def _raise_deferred(me: _Rank) -> None:
        error, me.deferred = me.deferred, None
        if error is not None:
            raise error

    def _forget(self, rank: int) -> None:
        me = self._ranks[rank]
        me.in_backward = False
        me.from_callbacks.clear()
        me.from_program.clear()
        me.roots.clear()
        me.futures.clear()

    def _report(self, from_callback: "Call", root: "Call", from_program: "Call") -> None:
        text = "\n".join([
            f"fakepg: under gloo, rank {from_callback.rank} issues two collectives on group "
            f"'{from_callback.record.group}' in an order that depends on timing:",
            f"  from a future callback of {_site(root)}: {_site(from_callback)}",
            f"  from the program, before it waited for that work: {_site(from_program)}",
            "gloo runs a work's callbacks on its own thread when the work finishes, so the "
            "callback's collective can come before or after the program's, and ranks can "
            "disagree: gloo then pairs different collectives (a size mismatch, or a hang). "
            "Wait for the first work before issuing on that group again (one DDP bucket for a "
            "multi-stage comm hook such as PowerSGD), or run on NCCL, whose callbacks run in "
            "issue order. (fakepg.spawn(..., gloo_hazards='warn') makes this a warning, 'off' "
            "silences it.)"])
        if self.mode == "error":
            raise GlooHazardError(text)
        key = (root.site, from_callback.site, from_program.site)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, GlooHazardWarning, stacklevel=4)
