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
* :class:`Memory` — bytes allocated (+) or freed (−) in a category, as the tensors
  (``sizes``) torch allocates on a CUDA stream; not timed. :func:`peak_memory` sums them in
  program order; :func:`allocator_memory` replays them through the caching allocator
  (:mod:`simddp.models.allocator`) for what torch would report as allocated and reserved;
* :class:`Pace` — the iteration lasts at least so long (a producer it waits for: the data
  loader), shown as host time.

Durations are per captured profile (rank r replays profile ``r % nprofiles``) and are scaled by
the rank's slowness (1 / speed) and, where ``noise`` names one, the iteration's jitter factor
for that slot. Collectives run on the rank's communicator of their ``scope`` (a
:class:`~simddp.program.mesh.Mesh` dimension).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Protocol, Sequence, Union

from ..models.allocator import AllocatorStats, CachingAllocator

__all__ = ["Seconds", "Draw", "Collective", "Compute", "Segment", "Mark", "Issue", "Wait",
           "WaitAll", "Memory", "Pace", "Instruction", "StepProgram", "MEMORY_CATEGORIES",
           "peak_memory", "MemoryReport", "allocator_memory", "memory_events", "JobMemory",
           "job_memory"]

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
    """``nbytes`` allocated (> 0) or freed (< 0) in ``category`` (:data:`MEMORY_CATEGORIES`).

    For the caching allocator (:func:`allocator_memory`): ``sizes`` are the separate tensors an
    allocation is made of, in order (their sum is ``nbytes``; empty: one tensor of ``nbytes``);
    ``stream`` the CUDA stream they are allocated on (the allocator's pools are per stream:
    FSDP2 allocates its all-gather outputs on its all-gather stream); ``key`` names the
    allocation, and a free with the same key releases exactly its tensors (without a key a
    free releases the category's latest allocations, newest first, and keeps any excess as a
    new tensor)."""

    category: str
    nbytes: int
    label: str = ""
    sizes: tuple[int, ...] = ()
    stream: str = "compute"
    key: Hashable = None


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
    the end). Frees take effect where they stand, bytes unrounded: what torch's caching
    allocator makes of them is :func:`allocator_memory`'s."""
    now = dict(start or {})
    total = sum(now.values())
    peak, at_peak = total, dict(now)

    def apply(m: Memory) -> None:
        nonlocal total, peak, at_peak
        now[m.category] = now.get(m.category, 0) + m.nbytes
        total += m.nbytes
        if total > peak:
            peak, at_peak = total, dict(now)

    for m in memory_events(instructions):
        apply(m)
    return peak, at_peak, now


def memory_events(instructions: Sequence[Instruction]) -> Iterator[Memory]:
    """The :class:`Memory` instructions of ``instructions`` in program order (segments' marks
    included)."""
    for ins in instructions:
        if isinstance(ins, Memory):
            yield ins
        elif isinstance(ins, Segment):
            yield from (mk.do for mk in ins.marks if isinstance(mk.do, Memory))


@dataclass(frozen=True)
class MemoryReport:
    """A rank's memory in a step as torch's caching allocator would see it (bytes).

    ``allocated_peak`` / ``reserved_peak``: ``torch.cuda.max_memory_allocated`` /
    ``max_memory_reserved`` over the replayed steps; ``by_category``: each category's bytes
    at the program-order peak (unrounded); ``fragmentation``: the share of the reserved peak
    not allocated there; ``ooms``: allocations that failed even after the allocator released
    its cache (torch raises at the first), against ``limit_bytes``."""

    allocated_peak: int
    reserved_peak: int
    by_category: dict[str, int]
    fragmentation: float
    ooms: int
    stats: AllocatorStats = field(repr=False, compare=False, default=None)  # type: ignore


def allocator_memory(instructions: Sequence[Instruction], start: dict[str, int] | None = None,
                     *, start_sizes: dict[str, Sequence[int]] | None = None,
                     lazy: Sequence[str] = ("optimizer",), iterations: int = 2,
                     expandable_segments: bool = True, limit_bytes: int | None = None,
                     extra: Sequence[Memory] = ()) -> MemoryReport:
    """Replay a rank's step ``iterations`` times through the caching allocator model
    (:class:`~simddp.models.allocator.CachingAllocator`) and report torch's peaks.

    ``start``: bytes per category held before the step (``start_sizes``: as which tensors;
    default one tensor per category). Categories in ``lazy`` (the optimizer's state: Adam
    creates it in the first ``step()``) are allocated before the first iteration's optimizer
    compute instead, into whatever the first backward left cached — as a real run does.
    ``extra``: allocations held throughout, made first (buffers outside the program's
    categories). Deterministic: the same program gives the same segments."""
    alloc = CachingAllocator(expandable_segments=expandable_segments, limit_bytes=limit_bytes)
    live: dict[str, list[tuple[Hashable, list[int]]]] = {}  # category -> allocations, in order
    alloc_sizes: dict[int, int] = {}  # handle -> bytes asked for
    by_key: dict[Hashable, tuple[str, list[int]]] = {}
    serial = [0]

    def allocate(m: Memory, sizes: Sequence[int]) -> None:
        handles = []
        for n in sizes:
            if n > 0:
                handles.append(alloc.malloc(int(n), m.stream))
                alloc_sizes[handles[-1]] = int(n)
        key = m.key if m.key is not None else ("anon", serial[0])
        serial[0] += 1
        if key in by_key:  # the same key again (the next iteration): a new allocation
            release(key)
        by_key[key] = (m.category, handles)
        live.setdefault(m.category, []).append((key, handles))

    def release(key: Hashable) -> int:
        cat, handles = by_key.pop(key)
        for h in handles:
            alloc.free(h)
        lst = live[cat]
        for i, (k, _) in enumerate(lst):
            if k == key:
                del lst[i]
                break
        return sum(alloc_sizes.pop(h) for h in handles)


    def apply(m: Memory) -> None:
        if m.nbytes > 0:
            sizes = m.sizes or (m.nbytes,)
            allocate(m, sizes)
        elif m.nbytes < 0:
            if m.key is not None and m.key in by_key:
                freed = release(m.key)
                excess = freed + m.nbytes
            else:  # the category's newest allocations, until as many bytes are freed
                want, freed = -m.nbytes, 0
                lst = live.get(m.category, [])
                exact = [k for k, hs in lst if sum(alloc_sizes[h] for h in hs) == want]
                if exact:
                    freed = release(exact[-1])
                while freed < want and lst:
                    freed += release(lst[-1][0])
                excess = freed - want
            if excess > 0:
                allocate(Memory(m.category, excess, m.label, stream=m.stream), (excess,))

    for m in extra:
        apply(m)
    sizes = dict(start_sizes or {})
    for cat, nbytes in (start or {}).items():
        if cat in lazy or nbytes <= 0:
            continue
        apply(Memory(cat, nbytes, "held before the step", tuple(sizes.get(cat, ()))))
    pending = [Memory(c, n, "created by the first optimizer step", tuple(sizes.get(c, ())))
               for c, n in (start or {}).items() if c in lazy and n > 0]
    for it in range(max(1, iterations)):
        for ins in instructions:
            if pending and getattr(ins, "kind", None) == "optimizer" and \
                    isinstance(ins, (Compute, Segment)):
                for m in pending:
                    apply(m)
                pending = []
            for m in memory_events((ins,)):
                apply(m)
        for m in pending:
            apply(m)
        pending = []
    _, at_peak, _ = peak_memory(instructions, start)
    st = alloc.stats()
    return MemoryReport(st.max_allocated, st.max_reserved, at_peak, st.fragmentation, st.ooms,
                        st)


@dataclass(frozen=True)
class JobMemory:
    """The job's memory per rank in a step (bytes; see docs/fsdp-and-memory.md).
    ``reserved_peak`` / ``allocated_peak``: torch's ``max_memory_reserved`` /
    ``max_memory_allocated`` (the caching allocator model), each the largest over ranks;
    ``by_category``: at the program-order peak of the rank with the largest reserved peak;
    ``outside``: what the process holds outside
    torch's allocator (the CUDA context, NCCL's buffers); ``allocatable``: the card's memory
    less ``outside`` (None: no card given); ``ooms``: allocations the allocator could not
    serve within ``allocatable`` even after releasing its cache, over all ranks; ``margin``:
    the smallest over ranks of its allocatable memory less its reserved peak (negative: it
    does not fit)."""

    reserved_peak: int
    allocated_peak: int
    by_category: dict[str, int]
    fragmentation: float
    outside: dict[str, int]
    allocatable: int | None
    ooms: int | None
    margin: int | None


def _communicators(instructions: Sequence[Instruction]) -> tuple[int, int]:
    """(collective communicators, pipeline peers) a rank's step uses: the distinct scopes of
    its collectives, p2p sends/receives apart (a peer per direction)."""
    coll, p2p = set(), set()
    for ins in instructions:
        issues = [mk.do for mk in ins.marks] if isinstance(ins, Segment) else [ins]
        for x in issues:
            if isinstance(x, Issue):
                for c, _ in x.stages:
                    (p2p if c.op in ("send", "recv") else coll).add(c.scope)
    return len(coll), len({s.replace("send_", "").replace("recv_", "") for s in p2p})


def job_memory(program: Any, *, gpu_memory_bytes: int | None = None,
               expandable_segments: bool = True) -> JobMemory:
    """The job's memory per rank for ``program`` (a planner's step program): each distinct
    rank's step (``program.memory_programs()``: (instructions, bytes per category before the
    step) pairs; a planner without it gives its program-order ``memory()``) replayed twice through the caching allocator (:func:`allocator_memory`), the
    largest reserved peak kept; plus the CUDA context and NCCL's buffers
    (:mod:`simddp.models.allocator`), which lower what the allocator may take of
    ``gpu_memory_bytes``."""
    from ..models.outside_allocator import CUDA_CONTEXT_BYTES, nccl_buffer_bytes
    pairs = program.memory_programs()
    if pairs is None:  # a planner without per-rank memory programs:
        peak, at_peak = program.memory()  # its program-order peak, nothing outside
        return JobMemory(peak, peak, at_peak, 0.0, {}, gpu_memory_bytes,
                         None if gpu_memory_bytes is None else int(peak > gpu_memory_bytes),
                         None if gpu_memory_bytes is None else gpu_memory_bytes - peak)
    best: MemoryReport | None = None  # the largest reserved peak over ranks
    outside_max: dict[str, int] = {}
    ooms, margin, allocated = 0, None, 0
    for instructions, start in pairs:
        ncoll, npeers = _communicators(instructions)
        outside = {"cuda_context": CUDA_CONTEXT_BYTES,
                   "nccl_buffers": nccl_buffer_bytes(ncoll, npeers)}
        limit = None if gpu_memory_bytes is None else \
            max(0, gpu_memory_bytes - sum(outside.values()))
        rep = allocator_memory(instructions, start, expandable_segments=expandable_segments,
                               limit_bytes=limit)
        if rep.ooms:  # the peak it would have needed: the same step without a limit
            free = allocator_memory(instructions, start,
                                    expandable_segments=expandable_segments)
            rep = MemoryReport(free.allocated_peak, free.reserved_peak, free.by_category,
                               free.fragmentation, rep.ooms, free.stats)
        ooms += rep.ooms
        if limit is not None:  # the rank closest to running out decides the margin
            m = gpu_memory_bytes - sum(outside.values()) - rep.reserved_peak
            margin = m if margin is None else min(margin, m)
        if best is None or (rep.reserved_peak, rep.allocated_peak) > \
                (best.reserved_peak, best.allocated_peak):
            best, outside_max = rep, outside
        allocated = max(allocated, rep.allocated_peak)
    assert best is not None, "a step program has at least one rank"
    allocatable = None if gpu_memory_bytes is None else \
        gpu_memory_bytes - sum(outside_max.values())
    return JobMemory(best.reserved_peak, allocated, best.by_category,
                     best.fragmentation, outside_max, allocatable,
                     None if gpu_memory_bytes is None else ooms, margin)
