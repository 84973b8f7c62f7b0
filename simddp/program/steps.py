"""The step program: what one rank does in one training step, as every replay engine runs it.

A planner (:mod:`simddp.program.ddp`, :mod:`simddp.program.fsdp`) turns a capture of the real
program into a :class:`StepProgram`; an engine (:mod:`simddp.replay`: simpy, vectorised) runs
it on a world of any size. The program is a list of instructions per rank and iteration:

* :class:`Compute` — compute on the rank's main stream;
* :class:`Segment` — a stretch of compute with :class:`Mark` s in it where collectives are
  issued or waited for. ``anchored=False`` (forward, FSDP): a mark's offset is the compute done
  before it, waits excluded — the capture measures it that way. ``anchored=True`` (DDP's
  backward): offsets are times since the segment began (grad-ready times), and a mark's ``pre``
  work (a comm hook's) pushes everything after it later;
* :class:`Issue` — collectives issued now; ``stages`` chain on the rank's side stream (stage
  j + 1 is issued when stage j's callback ends: PowerSGD);
* :class:`Wait` (one collective, by tag) and :class:`WaitAll` (everything issued with
  ``pending=True`` since the last WaitAll);
* :class:`Memory` — bytes allocated (+) or freed (−) in a category; not timed;
* :class:`Pace` — the iteration lasts at least so long (a producer it waits for: the data
  loader), shown as host time.

Durations are per captured profile (rank r replays profile ``r % nprofiles``) and are scaled by
the rank's slowness (1 / speed) and, where ``noise`` names one, the iteration's jitter factor
for that slot. Collectives run on the rank's communicator of their ``scope`` (a
:class:`~simddp.program.mesh.Mesh` dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, Union

__all__ = ["Seconds", "Draw", "Collective", "Compute", "Segment", "Mark", "Issue", "Wait",
           "WaitAll", "Memory", "Pace", "Instruction", "StepProgram", "MEMORY_CATEGORIES",
           "peak_memory"]

Seconds = tuple[float, ...]  # per captured profile

# what a rank's memory holds, as torch's FSDPMemTracker names it (its _FSDPRefType and
# _MemRefType), one word each
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers",
                     "communication", "temporary")


class Draw(Protocol):
    """What an instruction's durations depend on for a rank in one iteration: its slowness
    (``slow``, 1 / speed), the value of a per-profile duration for its profile (``pick``) and
    its jitter factor for a noise slot (``factor``). The simpy engine's draw is one rank's
    (floats); the vectorised engine's is every rank's at once (numpy arrays, elementwise).
    Every duration an engine charges comes from the instructions' methods below, so each
    formula is written once and both engines compute it with the same operations."""

    slow: Any

    def pick(self, per_profile: Seconds) -> Any: ...

    def factor(self, slot: int) -> Any: ...


@dataclass(frozen=True)
class Collective:
    """One collective a rank takes part in. ``tag`` names it within an iteration (the engine
    prefixes the iteration); ``scope``: the rank's communicator it runs on; ``op``: fakepg's
    registry name, costed by the network model; ``nbytes`` as nccl-tests counts them."""

    tag: tuple
    scope: str
    op: str
    nbytes: int
    in_backward: bool = False


@dataclass(frozen=True)
class Compute:
    """``seconds`` of compute on the main stream (× slowness × the jitter factor of slot
    ``noise``, in that order), shown as ``kind`` ("forward", "backward", "optimizer")."""

    kind: str
    seconds: Seconds
    noise: int | None = None
    label: str | None = None

    def duration(self, d: Draw) -> Any:
        t = d.pick(self.seconds) * d.slow
        return t if self.noise is None else t * d.factor(self.noise)


@dataclass(frozen=True)
class Issue:
    """Collectives issued now. ``stages``: (collective, seconds of its callback on the side
    stream); each stage after the first is issued when the previous callback ends. ``pre``:
    compute before the issue (a comm hook's). ``costed``: the network's per-collective issue
    cost applies (shown as ``kind`` with ``label`` outside a segment). ``pending``: the next
    :class:`WaitAll` waits for it (else a :class:`Wait` of its first stage's tag)."""

    stages: tuple[tuple[Collective, float], ...]
    pre: float = 0.0
    kind: str = "forward"
    label: str | None = None
    pending: bool = True
    costed: bool = True

    @property
    def first(self) -> Collective:
        return self.stages[0][0]

    def pre_time(self, scale: Any) -> Any:
        """The comm hook's compute before the issue, at ``scale`` (slowness × jitter)."""
        return self.pre * scale

    def callback_time(self, stage: int, scale: Any) -> Any:
        """Stage ``stage``'s callback on the side stream, at ``scale``."""
        return self.stages[stage][1] * scale


@dataclass(frozen=True)
class Wait:
    """Wait for the collective ``tag`` (issued earlier in the iteration) to end."""

    tag: tuple
    label: str


@dataclass(frozen=True)
class WaitAll:
    """Wait for every pending issue (and its callbacks) since the last WaitAll."""

    label: str


@dataclass(frozen=True)
class Memory:
    """``nbytes`` allocated (> 0) or freed (< 0) in ``category`` (:data:`MEMORY_CATEGORIES`)."""

    category: str
    nbytes: int
    label: str = ""


@dataclass(frozen=True)
class Pace:
    """The iteration does not end before ``seconds`` after it began: a producer that delivers
    one input per ``seconds`` (:mod:`simddp.models.host`); the rank waits for it here, shown
    as ``label`` (kind ``"host"``). Not scaled by the rank's slowness: the host's pace is not
    the device's."""

    seconds: float
    label: str = "data loading (waiting for the loader)"

    def until(self, began: Any) -> Any:
        """When the iteration that began at ``began`` may go on."""
        return began + self.seconds


@dataclass(frozen=True)
class Mark:
    """Where in a :class:`Segment` an :class:`Issue` or :class:`Wait` happens: ``at`` per
    profile (None: right where the previous mark left off)."""

    at: Seconds | None
    do: Union[Issue, Wait, Memory]

    def offset(self, d: Draw, scale: Any) -> Any:
        """Where the mark sits in its segment (``at`` is not None), at ``scale``."""
        return d.pick(self.at) * scale


@dataclass(frozen=True)
class Segment:
    """``seconds`` of ``kind`` compute with marks in it (see the module docstring for
    ``anchored``); scaled by slowness × the jitter factor of slot ``noise``."""

    kind: str
    seconds: Seconds
    noise: int
    marks: tuple[Mark, ...]
    anchored: bool = False

    def scale(self, d: Draw) -> Any:
        """The factor on the segment's durations: slowness × the jitter of its slot."""
        return d.slow * d.factor(self.noise)

    def length(self, d: Draw, scale: Any) -> Any:
        """The segment's compute at ``scale``."""
        return d.pick(self.seconds) * scale


Instruction = Union[Compute, Segment, Issue, Wait, WaitAll, Memory, Pace]


class StepProgram(Protocol):
    """What a planner hands the engines.

    ``nprofiles``: captured profiles (rank r runs profile r % nprofiles); ``iterations``;
    ``mesh``: the communicators (:class:`~simddp.program.mesh.Mesh`);
    ``iteration(rank, it)``: rank's instructions in iteration ``it``; ``epilogue(rank)``:
    after its last iteration; ``uniform()``: None when every rank runs the same instructions
    in every iteration (only their durations differ), else why not — the vectorised engine
    runs uniform programs only; ``rank_kinds``: ranks whose instructions differ from the
    others' (they get their own equivalence class); ``param_bytes``: the model's parameter
    bytes (for the result)."""

    nprofiles: int
    iterations: int
    mesh: object

    def iteration(self, rank: int, it: int) -> Sequence[Instruction]: ...

    def epilogue(self, rank: int) -> Sequence[Instruction]: ...

    def uniform(self) -> str | None: ...


def peak_memory(instructions: Sequence[Instruction], start: dict[str, int] | None = None
                ) -> tuple[int, dict[str, int], dict[str, int]]:
    """Walk ``instructions`` (segments' marks included) in program order from ``start`` bytes
    per category: (peak total bytes, bytes per category at the peak, bytes per category at
    the end). Frees take effect where they stand: the caching allocator's reuse and
    fragmentation are not modelled."""
    now = dict(start or {})
    total = sum(now.values())
    peak, at_peak = total, dict(now)

    def apply(m: Memory) -> None:
        nonlocal total, peak, at_peak
        now[m.category] = now.get(m.category, 0) + m.nbytes
        total += m.nbytes
        if total > peak:
            peak, at_peak = total, dict(now)

    for ins in instructions:
        if isinstance(ins, Memory):
            apply(ins)
        elif isinstance(ins, Segment):
            for mk in ins.marks:
                if isinstance(mk.do, Memory):
                    apply(mk.do)
    return peak, at_peak, now
