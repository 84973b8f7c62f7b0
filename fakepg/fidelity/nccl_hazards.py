"""NCCL's hazards on a CPU fake world: what gloo-like semantics would let pass but NCCL does not.

Under the ``"nccl"`` personality (:mod:`fakepg.fidelity.backends`) fakepg checks three things a real GPU
job meets and a gloo test never shows:

* ``"order"``: collectives outstanding at the same time on different communicators (async works
  not yet waited), issued in inconsistent orders across ranks. NCCL does not promise to progress
  kernels of two streams at once, so this can deadlock: reported as a potential deadlock naming
  both groups and both issue sites on each rank.
* ``"p2p"``: point-to-point ops outside ``batch_isend_irecv`` run in issue order on each pair's
  stream. "Both ranks ``isend`` then ``irecv``" can then never match (a real NCCL deadlock
  for messages beyond its eager buffer): a hang verdict whose report says why.
* ``"cpu_tensors"``: a CPU tensor given to an nccl collective fails as torch fails
  ("No backend type associated with device type cpu").

Each is ``"error"``, ``"warn"`` (a :class:`NcclHazardWarning`; gloo-like semantics go on) or
``"off"``: ``fakepg.spawn(..., nccl_hazards="warn")`` for all three, or a mapping for some. By
default ``order`` and ``p2p`` are errors and ``cpu_tensors`` is ``"auto"``: an error where CUDA
is available, off on a CPU-only machine, where CPU tensors stand in for the program's CUDA ones
(so unmodified NCCL programs run there).

    >>> from fakepg.fidelity.nccl_hazards import parse_modes
    >>> parse_modes({"order": "warn"}), parse_modes("off")["p2p"]
    ({'order': 'warn', 'p2p': 'error', 'cpu_tensors': 'auto'}, 'off')
"""

from __future__ import annotations

import collections
import sys
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from ..errors import FakePGError
from ..ops.base import tensors_of
from ..world.checks import Checker

if TYPE_CHECKING:
    from ..ops.matching import Call, GroupState, PendingCollective

HAZARDS = ("order", "p2p", "cpu_tensors")
MODES = ("error", "warn", "off")
_BATCH_CODE = "batch_isend_irecv"
_MAX_UNWAITED = 64  # per rank: the async collectives compared with each new one


class NcclHazardError(FakePGError):
    """A program does something a real NCCL job may deadlock on (``order``), or that NCCL
    refuses (``cpu_tensors``; also a ``RuntimeError`` as torch raises it)."""


class NcclHazardWarning(UserWarning):
    """An NCCL hazard seen with ``nccl_hazards="warn"``: the fake world went on as gloo would."""


_DEFAULTS = {"order": "error", "p2p": "error", "cpu_tensors": "auto"}


def parse_modes(setting: str | Mapping[str, str] | None) -> dict[str, str]:
    """Each hazard's mode from ``spawn(nccl_hazards=...)``: None for the defaults, one mode
    for all, or a mapping naming some hazards (the others keep their defaults)."""
    if setting is None:
        return dict(_DEFAULTS)
    if isinstance(setting, str):
        if setting not in MODES:
            raise ValueError(f"fakepg.spawn: nccl_hazards={setting!r}; expected one of "
                             f"{', '.join(map(repr, MODES))} or a mapping from {HAZARDS} to those")
        return dict.fromkeys(HAZARDS, setting)
    if not isinstance(setting, Mapping):
        raise TypeError(f"fakepg.spawn: nccl_hazards must be a str or a mapping, got "
                        f"{type(setting).__name__}")
    modes = dict(_DEFAULTS)
    for name, mode in setting.items():
        if name not in HAZARDS or mode not in MODES + (("auto",) if name == "cpu_tensors" else ()):
            raise ValueError(f"fakepg.spawn: nccl_hazards[{name!r}]={mode!r}; hazards are "
                             f"{HAZARDS} and modes {MODES}")
        modes[name] = mode
    return modes


def _off_hint(hazard: str) -> str:
    return (f"(fakepg.spawn(..., nccl_hazards={{{hazard!r}: 'warn'}}) makes this a warning, "
            f"'off' silences it)")


def _in_batch() -> bool:
    """Whether the p2p op being issued comes from ``batch_isend_irecv`` (one NCCL group call:
    its ops are posted together, in no order). torch sends fakepg's group down the per-op path,
    so the caller's frames tell."""
    frame = sys._getframe(2)
    for _ in range(20):
        if frame is None:
            return False
        if frame.f_code.co_name == _BATCH_CODE:
            return True
        frame = frame.f_back
    return False


def _group_key(call: "Call") -> tuple[str, tuple[int, ...]]:
    rec = call.record
    return rec.group, tuple(rec.group_ranks)


def _short(call: "Call") -> str:
    rec = call.record
    return f"{rec.op} #{rec.seq} on group '{rec.group}' (ranks {list(rec.group_ranks)}) at {call.site}"


class NcclHazards(Checker):
    """One world's NCCL hazard checker (a :class:`~fakepg.world.checks.Checker`: the world
    calls it at issue, match, wait and hang time). Calls not under the nccl personality pass
    untouched."""

    def __init__(self, modes: Mapping[str, str] | None = None):
        self.modes = dict(modes) if modes is not None else parse_modes(None)
        if self.modes["cpu_tensors"] == "auto":
            self.modes["cpu_tensors"] = "error" if torch.cuda.is_available() else "off"
        self._warned: set[Any] = set()
        # order: per rank, its async collectives not yet waited; (first, second) -> who saw it
        self._unwaited: dict[int, list["Call"]] = collections.defaultdict(list)
        self._seen_order: dict[tuple[Any, Any], tuple["Call", "Call"]] = {}
        # p2p: per (group, rank, peer) stream, its unbatched p2p calls not yet matched, in order
        self._streams: dict[tuple[Any, int, int], collections.deque["Call"]] = \
            collections.defaultdict(collections.deque)
        self._deferred: set[int] = set()  # id() of calls held back behind their stream's head

    def _active(self, call: "Call", hazard: str) -> bool:
        return getattr(call, "personality", "") == "nccl" and self.modes[hazard] != "off"

    def _warn_once(self, key: Any, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, NcclHazardWarning, stacklevel=4)

    # -- cpu_tensors: before anything is issued ------------------------------------------
    def issuing(self, call: "Call") -> None:
        if not self._active(call, "cpu_tensors"):
            return
        cpu = [t for t in tensors_of(call.inputs, call.outputs) if t.device.type == "cpu"]
        if not cpu:
            return
        # torch's dispatch on the tensors' device finds no backend for cpu on an NCCL-only group
        text = (f"No backend type associated with device type cpu (rank {call.rank}: {call.op} "
                f"on an nccl group at {call.site}; NCCL takes CUDA tensors) "
                f"{_off_hint('cpu_tensors')}")
        if self.modes["cpu_tensors"] == "error":
            raise NcclHazardError(text)
        self._warn_once("cpu_tensors", text)

    # -- order: after a collective is issued; a wait ends its overlap -------------------
    def issued(self, call: "Call") -> None:
        if call.spec.p2p or call.hidden_wait or not self._active(call, "order"):
            return
        me = (_group_key(call), call.record.seq)
        mine = self._unwaited[call.rank]
        for earlier in mine:
            first = (_group_key(earlier), earlier.record.seq)
            if first[0] == me[0]:
                continue  # one communicator: one stream, its order is the sequence order
            self._seen_order.setdefault((first, me), (earlier, call))
            other = self._seen_order.get((me, first))
            if other is not None and other[0].rank != call.rank:
                self._report_order((earlier, call), other)
        mine.append(call)
        if len(mine) > _MAX_UNWAITED:  # works never waited: keep the check's cost bounded
            del mine[0]

    def waited(self, call: "Call") -> None:
        mine = self._unwaited.get(call.rank)
        if mine and call in mine:
            mine.remove(call)

    def _report_order(self, here: tuple["Call", "Call"], there: tuple["Call", "Call"]) -> None:
        text = "\n".join([
            "fakepg: potential deadlock under NCCL: collectives outstanding at the same time on "
            "different communicators were issued in inconsistent orders:",
            f"  rank {here[0].rank}: {_short(here[0])}, then {_short(here[1])}",
            f"  rank {there[0].rank}: {_short(there[0])}, then {_short(there[1])}",
            "NCCL gives no forward-progress guarantee across streams: each rank's first kernel "
            "can wait for the other's. Issue them in the same order on every rank, or wait on "
            "the first before issuing the second " + _off_hint("order")])
        if self.modes["order"] == "error":
            raise NcclHazardError(text)
        self._warn_once(("order", here[0].record.group, here[1].record.group), text)

    # -- p2p: unbatched send/recv in issue order per pair's stream -----------------------
    def holds(self, call: "Call") -> bool:
        """Track ``call`` on its stream; True when it must wait behind an earlier unmatched op
        of that stream (then the cluster matches it later, from :meth:`released`)."""
        if call.peer is None or not self._active(call, "p2p") or _in_batch():
            return False
        stream = self._streams[(_group_key(call), call.grank, call.peer)]
        stream.append(call)
        if len(stream) == 1 or self.modes["p2p"] != "error":
            return False
        self._deferred.add(id(call))
        return True

    def released(self, coll: "PendingCollective") -> Iterator["Call"]:
        """After a p2p pair matched: drop its calls from their streams and yield the calls that
        now head a stream and were held back (the cluster matches each in turn)."""
        for call in coll.members():
            if call.peer is None or getattr(call, "personality", "") != "nccl":
                continue
            stream = self._streams.get((_group_key(call), call.grank, call.peer))
            if not stream or call not in stream:
                continue
            if stream[0] is not call:  # warn mode: NCCL would have matched the head first
                self._warn_once(("p2p", call.rank, call.peer), self._p2p_text(stream[0], call))
            stream.remove(call)
            if stream and id(stream[0]) in self._deferred:
                self._deferred.discard(id(stream[0]))
                yield stream[0]

    def _p2p_text(self, head: "Call", held: "Call") -> str:
        return (f"rank {held.rank}: {held.op} with rank {held.record.peer} at {held.site} runs "
                f"after its unmatched {head.op} with rank {head.record.peer} at {head.site}: "
                f"p2p ops outside batch_isend_irecv run in issue order on the pair's NCCL stream")

    def hang_notes(self) -> list[str]:
        """Lines for the hang report: the p2p ops held back behind their stream's head."""
        notes = []
        for stream in self._streams.values():
            held = [c for c in stream if id(c) in self._deferred]
            if held:
                notes.append("  " + self._p2p_text(stream[0], held[0]))
        if notes:
            notes.insert(0, "Under NCCL (nccl_hazards 'p2p'): unbatched sends and receives "
                            "between two ranks match in issue order, so these never can:")
            notes.append("  Post them together with dist.batch_isend_irecv, or order them "
                         "oppositely on the two ranks (one sends first, the other receives first) "
                         + _off_hint("p2p"))
        return notes


__all__ = ["NcclHazards", "NcclHazardError", "NcclHazardWarning", "parse_modes", "HAZARDS", "MODES"]
