"""A model of torch's CUDA caching allocator: what a step's allocations *reserve*.

torch reports two peaks: ``max_memory_allocated`` (bytes of live blocks, each request rounded
up) and ``max_memory_reserved`` (bytes of the segments the allocator got from CUDA and keeps
cached). Published training figures (torchtitan's logs) are the reserved peak. This module
replays a sequence of allocations and frees (sizes, streams) through the allocator's rules, as
``c10/cuda/CUDACachingAllocator.cpp`` implements them (read at pytorch/pytorch
001074d25084fdb87a799823e395a50f5ec044d3; line references are to that file's functions):

* ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` = 512 B
  (``roundup_power2_divisions`` is off by default);
* ``get_pool``: requests of at most ``kSmallSize`` = 1 MiB go to the small pool, the rest to
  the large pool; pools are per stream (``BlockComparatorSize`` orders by stream, then size,
  then address, so a block freed on one stream is only reused on that stream);
* ``get_free_block``: best fit — the smallest cached block of at least the rounded size, the
  lowest address among equals; with ``max_split_size`` set, a request below it never takes a
  block at or above it, and one above it takes a block only within ``kLargeBuffer`` of it;
* ``get_allocation_size``: a new segment (``cudaMalloc``) is ``kSmallBuffer`` = 2 MiB for a
  small request, ``kLargeBuffer`` = 20 MiB for a request below ``kMinLargeAlloc`` = 10 MiB,
  else the request rounded up to ``kRoundLarge`` = 2 MiB;
* ``should_split``: a block larger than the request is split when the remainder is at least
  512 B (small pool, or expandable segments), or (large pool) when the request is below
  ``max_split_size`` and the remainder is more than ``kSmallSize`` = 1 MiB — else the whole
  block is handed out (allocated bytes count the whole block);
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours in the
  same segment;
* ``malloc``'s retry when ``cudaMalloc`` fails (here: the reserved bytes would pass
  ``limit_bytes``): ``release_available_cached_blocks`` (only with ``max_split_size``), then
  ``release_cached_blocks`` — every cached segment with no block in use is returned to CUDA
  (``empty_cache``) — and one more try; if that fails too, torch raises OutOfMemoryError: the
  model counts it (``ooms``) and goes on as if the memory were there, so the peaks stay
  measurable;
* ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``; torchtitan sets it): one segment
  per pool and stream whose address space grows by mapping pages — ``kSmallBuffer`` (2 MiB)
  pages for the small pool, ``kLargeBuffer`` (20 MiB) pages for the large pool
  (``find_expandable_block``, ``map_block``, ``ExpandableSegment::map``); blocks are split
  whenever 512 B or more remain; on an OOM retry the free whole pages are unmapped
  (``release_blocks`` → ``unmap_block``).

Not modelled: ``record_stream`` (a block used on another stream is freed when that stream's
event completes; here frees take effect where they stand), CUDA graph private pools, the
garbage-collection threshold (off by default), ``roundup_power2_divisions``.

Deterministic: the same trace gives the same segments (addresses are handed out in order).
What a process holds outside the allocator (the CUDA context, NCCL's buffers) is
:mod:`simddp.models.outside_allocator`'s.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Hashable, Iterable

__all__ = ["K_MIN_BLOCK_SIZE", "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_MIN_LARGE_ALLOC",
           "K_LARGE_BUFFER", "K_ROUND_LARGE", "round_size", "allocation_size",
           "CachingAllocator", "AllocatorStats", "replay_trace"]

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: 1 to 10 MiB requests may use kLargeBuffer
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_ROUND_LARGE = 2 << 20  # kRoundLarge: round up large allocations to 2 MiB

# the address space of one expandable segment: torch reserves 1 1/8 of the card's memory
# (find_expandable_block); any size larger than the card's memory behaves the same here
_EXPANDABLE_SPACE = 1 << 44
_UIDS = itertools.count()


def round_size(nbytes: int) -> int:
    """``round_size``: the request rounded up to a multiple of 512 B (at least 512)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` gets for a (rounded) request that no
    cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    ptr: int
    size: int
    stream: Hashable
    small: bool
    expandable: bool = False
    allocated: bool = False
    mapped: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None
    base: int = 0  # the segment's first address (expandable pages count from it)
    uid: int = field(default_factory=lambda: next(_UIDS))

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass
class AllocatorStats:
    """What a replay found (bytes). ``max_allocated`` / ``max_reserved``: torch's
    ``max_memory_allocated`` / ``max_memory_reserved``; ``allocated_at_max_reserved``: the
    allocated bytes when the reserved peak was reached; ``fragmentation``: the share of the
    reserved peak not allocated then; ``ooms``: requests that failed even after the cache was
    released (torch raises OutOfMemoryError at the first); ``segments``: segments (or mapped
    expandable pages' ranges) held at the end; ``requested_max``: the peak of the bytes asked
    for, unrounded."""

    max_allocated: int
    max_reserved: int
    allocated_at_max_reserved: int
    allocated: int
    reserved: int
    ooms: int
    segments: int
    requested_max: int
    retries: int = 0

    @property
    def fragmentation(self) -> float:
        if self.max_reserved <= 0:
            return 0.0
        return 1.0 - self.allocated_at_max_reserved / self.max_reserved


class CachingAllocator:
    """torch's ``DeviceCachingAllocator`` for one device (see the module docstring).

    ``malloc(nbytes, stream)`` returns a handle; ``free(handle)`` returns it to the cache;
    ``empty_cache()`` releases every segment with no block in use. ``limit_bytes``: the memory
    the allocator may reserve (the card's, less what is not torch's); None: no limit.
    ``max_split_size``: ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb`` in bytes (None: off)."""

    def __init__(self, *, expandable_segments: bool = False, max_split_size: int | None = None,
                 limit_bytes: int | None = None) -> None:
        self.expandable = bool(expandable_segments)
        self.max_split = max_split_size if max_split_size is not None else (1 << 63)
        self.limit = limit_bytes
        # free mapped blocks per (small, stream): a sorted list of (size, ptr, block)
        self._free: dict[tuple[bool, Hashable], list[tuple[int, int, int]]] = {}
        # unmapped blocks (expandable) per (small, stream): sorted (ptr, block)
        self._unmapped: dict[tuple[bool, Hashable], list[tuple[int, int]]] = {}
        self._blocks: dict[int, _Block] = {}  # uid -> block, for the sorted lists
        self._live: dict[int, tuple[_Block, int]] = {}  # handle -> (block, requested)
        self._next_handle = 0
        self._next_ptr = 1 << 20
        self.allocated = self.reserved = self.requested = 0
        self.max_allocated = self.max_reserved = self.requested_max = 0
        self.allocated_at_max_reserved = 0
        self.ooms = self.retries = 0

    # -- the public calls -------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: Hashable = 0) -> int:
        """Allocate ``nbytes`` on ``stream``; returns the handle to :meth:`free`."""
        if nbytes < 0:
            raise ValueError(f"an allocation's size must be >= 0 bytes, got {nbytes}")
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE  # get_pool
        block = self._get_free_block(size, small, stream)
        if block is None:
            block = self._alloc_block(size, small, stream)
            if block is None:  # release_available_cached_blocks + release_cached_blocks
                self.retries += 1
                self._release_available(size, small, stream)
                block = self._alloc_block(size, small, stream)
                if block is None:
                    self.empty_cache()
                    block = self._alloc_block(size, small, stream)
            if block is None:  # torch: OutOfMemoryError; the model goes on past the limit
                self.ooms += 1
                block = self._alloc_block(size, small, stream, force=True)
        block = self._alloc_found_block(block, size)
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes
        self.max_allocated = max(self.max_allocated, self.allocated)
        if self.reserved == self.max_reserved:  # the most in use while reserved is at its peak
            self.allocated_at_max_reserved = max(self.allocated_at_max_reserved, self.allocated)
        self.requested_max = max(self.requested_max, self.requested)
        return handle

    def free(self, handle: int) -> None:
        """Return ``handle``'s block to its pool, merged with its free neighbours."""
        try:
            block, nbytes = self._live.pop(handle)
        except KeyError:
            raise ValueError(f"free({handle!r}): no live allocation has that handle") from None
        self.allocated -= block.size
        self.requested -= nbytes
        block.allocated = False
        # free_block: try_merge_blocks with prev, then next
        for other in (block.prev, block.next):
            self._try_merge(block, other)
        self._insert_free(block)

    def empty_cache(self) -> None:
        """``release_cached_blocks``: every cached segment with no block in use goes back to
        CUDA (expandable segments: every free whole page is unmapped)."""
        for key in sorted(self._free, key=repr):
            for _, _, bid in list(self._free[key]):
                b = self._blocks.get(bid)
                if b is None or b.allocated:
                    continue
                if b.expandable:
                    self._unmap_block(b)
                elif not b.is_split():
                    self._remove_free(b)
                    self._drop(b)
                    self._set_reserved(self.reserved - b.size)

    def stats(self) -> AllocatorStats:
        segments = sum(1 for b in self._blocks.values() if b.prev is None and b.mapped)
        return AllocatorStats(self.max_allocated, self.max_reserved,
                              self.allocated_at_max_reserved, self.allocated, self.reserved,
                              self.ooms, segments, self.requested_max, self.retries)

    # -- the allocator's rules ----------------------------------------------------------------
    def _get_free_block(self, size: int, small: bool, stream: Hashable) -> _Block | None:
        """``get_free_block``: the smallest cached block of at least ``size`` on ``stream``'s
        pool (lowest address among equals), within the ``max_split_size`` rules."""
        lst = self._free.get((small, stream))
        if not lst:
            return None
        i = bisect.bisect_left(lst, (size, -1, -1))
        if i == len(lst):
            return None
        if self.expandable and self._blocks[lst[i][2]].expandable:
            # best fit by the size a block can grow to (itself and the unmapped space after it)
            def grow(j: int) -> int:
                b = self._blocks[lst[j][2]]
                return b.size + (b.next.size if b.next is not None and not b.next.mapped
                                 else 0)
            while i + 1 < len(lst) and grow(i + 1) < grow(i):
                i += 1
        cand = self._blocks[lst[i][2]]
        if size < self.max_split <= cand.size:
            return None  # do not return an oversized block for a large request
        if size >= self.max_split and cand.size >= size + K_LARGE_BUFFER:
            return None
        self._remove_free(cand)
        return cand

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: _Block, size: int) -> _Block:
        """``alloc_found_block``: split the remainder off into the pool when ``should_split``."""
        if self._should_split(block, size):
            self._insert_free(self._split(block, size))
        block.allocated = True
        return block

    def _split(self, block: _Block, size: int, mapped: bool = True) -> _Block:
        """Cut ``block`` after its first ``size`` bytes: the rest becomes a block of the same
        segment linked after it (``mapped`` or not), returned for the caller to pool."""
        rest = _Block(block.ptr + size, block.size - size, block.stream, block.small,
                      block.expandable, mapped=mapped, prev=block, next=block.next,
                      base=block.base)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self._blocks[rest.uid] = rest
        return rest

    def _alloc_block(self, size: int, small: bool, stream: Hashable,
                     force: bool = False) -> _Block | None:
        """``alloc_block``: a new segment (``cudaMalloc`` of ``get_allocation_size``), or with
        expandable segments new pages mapped at the lowest address that fits. None when the
        reserved bytes would pass the limit (unless ``force``)."""
        if self.expandable:
            return self._alloc_expandable(size, small, stream, force)
        seg = allocation_size(size)
        if not force and self.limit is not None and self.reserved + seg > self.limit:
            return None
        b = _Block(self._next_ptr, seg, stream, small, base=self._next_ptr)
        self._next_ptr += seg + K_ROUND_LARGE  # a gap: segments never touch
        self._blocks[b.uid] = b
        self._set_reserved(self.reserved + seg)
        return b

    def _release_available(self, size: int, small: bool, stream: Hashable) -> None:
        """``release_available_cached_blocks``: with ``max_split_size`` set, release oversize
        cached blocks (the smallest that covers the request, else the largest ones in turn)."""
        if self.max_split >= (1 << 63) or self.expandable:
            return
        lst = self._free.get((small, stream)) or []
        key = max(size, self.max_split)
        i = bisect.bisect_left(lst, (key, -1, -1))
        unsplit = lambda b: not b.is_split()  # noqa: E731 - only whole segments can go back
        if i < len(lst):
            b = self._blocks[lst[i][2]]
            if unsplit(b):
                self._remove_free(b)
                self._drop(b)
                self._set_reserved(self.reserved - b.size)
            return
        released = 0
        for _, _, bid in reversed(list(lst)):
            b = self._blocks[bid]
            if released >= key or b.size < self.max_split:
                break
            if unsplit(b):
                released += b.size
                self._remove_free(b)
                self._drop(b)
                self._set_reserved(self.reserved - b.size)

    # -- expandable segments ------------------------------------------------------------------
    def _page(self, small: bool) -> int:
        return K_SMALL_BUFFER if small else K_LARGE_BUFFER

    def _alloc_expandable(self, size: int, small: bool, stream: Hashable,
                          force: bool) -> _Block | None:
        """``try_allocate_expandable_block``: the lowest-addressed unmapped range of the
        stream's segments (joined with the free block before it) with room for ``size``;
        pages are mapped to cover it."""
        cand = self._find_expandable(size, small, stream)
        if not cand.mapped:
            cand = self._map_block(cand, min(cand.size, size), force)
            if cand is None:
                return None
        while cand.size < size:
            nxt = cand.next
            assert nxt is not None and not nxt.mapped
            merged = self._map_block(nxt, min(size - cand.size, nxt.size), force)
            if merged is None:
                return None
            cand = merged
        self._remove_free(cand)
        return cand

    def _find_expandable(self, size: int, small: bool, stream: Hashable) -> _Block:
        free = lambda b: b is not None and not b.allocated  # noqa: E731
        for _, bid in self._unmapped.get((small, stream), []):
            c = self._blocks[bid]
            if free(c.prev) and c.prev.mapped:
                c = c.prev
            room, b = 0, c
            while room < size and free(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        seg = _Block(self._next_ptr, _EXPANDABLE_SPACE, stream, small, expandable=True,
                     mapped=False, base=self._next_ptr)
        self._next_ptr += _EXPANDABLE_SPACE + K_LARGE_BUFFER
        self._blocks[seg.uid] = seg
        self._insert_unmapped(seg)
        return seg

    def _map_block(self, block: _Block, size: int, force: bool) -> _Block | None:
        """``map_block``: map the pages covering ``size`` bytes from ``block``'s start (pages
        of the pool's size); the mapped part merges with free neighbours. Returns the merged
        free block (not in the free lists' sense removed), or None past the limit."""
        page = self._page(block.small)
        mapped = min(block.size, -(-size // page) * page)
        if not force and self.limit is not None and self.reserved + mapped > self.limit:
            return None
        self._remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            self._insert_unmapped(self._split(block, mapped, mapped=False))
        for other in (block.prev, block.next):
            self._try_merge(block, other)
        self._insert_free(block)
        self._set_reserved(self.reserved + mapped)
        return block

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block of an expandable
        segment; what is left on either side stays a free mapped block."""
        page = self._page(block.small)
        off = block.ptr - block.base
        lo = block.base + -(-off // page) * page
        hi = block.base + (off + block.size) // page * page
        if hi <= lo:
            return
        self._remove_free(block)
        if lo > block.ptr:
            before = _Block(block.ptr, lo - block.ptr, block.stream, block.small, True,
                            prev=block.prev, next=block, base=block.base)
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._blocks[before.uid] = before
            self._insert_free(before)
        end = block.ptr + block.size
        if end > hi:
            after = _Block(hi, end - hi, block.stream, block.small, True, prev=block,
                           next=block.next, base=block.base)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._blocks[after.uid] = after
            self._insert_free(after)
        block.ptr, block.size, block.mapped = lo, hi - lo, False
        for other in (block.prev, block.next):
            if other is not None and not other.mapped:
                self._remove_unmapped(other)
                self._try_merge(block, other)
        self._insert_unmapped(block)
        self._set_reserved(self.reserved - (hi - lo))

    # -- bookkeeping --------------------------------------------------------------------------
    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour of the same mapping into ``dst``."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        self._drop(src)

    def _insert_free(self, b: _Block) -> None:
        bisect.insort(self._free.setdefault((b.small, b.stream), []), (b.size, b.ptr, b.uid))

    def _remove_free(self, b: _Block) -> None:
        lst = self._free.get((b.small, b.stream), [])
        key = (b.size, b.ptr, b.uid)
        i = bisect.bisect_left(lst, key)
        if i < len(lst) and lst[i] == key:
            del lst[i]

    def _insert_unmapped(self, b: _Block) -> None:
        bisect.insort(self._unmapped.setdefault((b.small, b.stream), []), (b.ptr, b.uid))

    def _remove_unmapped(self, b: _Block) -> None:
        lst = self._unmapped.get((b.small, b.stream), [])
        key = (b.ptr, b.uid)
        i = bisect.bisect_left(lst, key)
        if i < len(lst) and lst[i] == key:
            del lst[i]

    def _drop(self, b: _Block) -> None:
        self._blocks.pop(b.uid, None)

    def _set_reserved(self, value: int) -> None:
        self.reserved = value
        if value > self.max_reserved:
            self.max_reserved = value
            self.allocated_at_max_reserved = self.allocated


def replay_trace(events: Iterable[tuple], *, expandable_segments: bool = False,
                 max_split_size: int | None = None, limit_bytes: int | None = None
                 ) -> AllocatorStats:
    """Replay ``events`` in order through a :class:`CachingAllocator`: ``("alloc", key,
    nbytes[, stream])`` and ``("free", key)`` (``key``: any hashable naming the allocation).
    Returns the allocator's :class:`AllocatorStats`."""
    alloc = CachingAllocator(expandable_segments=expandable_segments,
                             max_split_size=max_split_size, limit_bytes=limit_bytes)
    handles: dict[Hashable, int] = {}
    for ev in events:
        if ev[0] == "alloc":
            key, nbytes = ev[1], int(ev[2])
            if key in handles:
                raise ValueError(f"replay_trace: {key!r} allocated twice without a free")
            handles[key] = alloc.malloc(nbytes, ev[3] if len(ev) > 3 else 0)
        elif ev[0] == "free":
            if ev[1] not in handles:
                raise ValueError(f"replay_trace: free of {ev[1]!r}, which is not allocated")
            alloc.free(handles.pop(ev[1]))
        else:
            raise ValueError(f"replay_trace: an event is ('alloc', key, nbytes[, stream]) or "
                             f"('free', key), got {ev!r}")
    return alloc.stats()
