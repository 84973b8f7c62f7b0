"""simddp.models.allocator against closed forms of torch's CUDACachingAllocator.cpp rules."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from simddp.models.allocator import (K_LARGE_BUFFER, K_SMALL_BUFFER, CachingAllocator,
                                     allocation_size, replay_trace, round_size)
from simddp.models.outside_allocator import (CUDA_CONTEXT_BYTES, NCCL_BUFFSIZE,
                                             NCCL_LL128_BUFFSIZE, NCCL_LL_BUFFSIZE,
                                             nccl_buffer_bytes)
from simddp.program.steps import (Collective, Compute, Issue, Memory, allocator_memory,
                                  job_memory)

MiB = 1 << 20


def test_round_size_is_512_byte_multiples_at_least_512() -> None:
    assert round_size(0) == 512 and round_size(1) == 512 and round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(MiB + 1) == MiB + 512


def test_allocation_size_follows_the_pool_and_segment_rules() -> None:
    assert allocation_size(512) == K_SMALL_BUFFER == 2 * MiB  # small: 2 MiB buffers
    assert allocation_size(MiB) == 2 * MiB  # 1 MiB is still small (<= kSmallSize)
    assert allocation_size(MiB + 512) == K_LARGE_BUFFER == 20 * MiB  # 1..10 MiB: 20 MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # >= kMinLargeAlloc: rounded to 2 MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_small_requests_pack_into_one_2_mib_segment_until_it_is_full() -> None:
    a = CachingAllocator()
    for _ in range(4096):  # 4096 × 512 B = 2 MiB
        a.malloc(100)
    assert (a.allocated, a.reserved) == (2 * MiB, 2 * MiB)
    a.malloc(1)
    assert a.reserved == 4 * MiB


def test_a_1_mib_plus_1_byte_request_reserves_a_20_mib_segment_that_19_such_requests_fill() -> None:
    a = CachingAllocator()
    a.malloc(MiB + 1)
    assert (a.allocated, a.reserved) == (MiB + 512, 20 * MiB)
    for _ in range(18):
        a.malloc(MiB + 1)
    # the 19th takes the whole remainder: what would be left (1 MiB − 9,728 B) is not more
    # than kSmallSize, so should_split says no and allocated counts the whole block
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    a.malloc(MiB + 1)
    assert a.reserved == 40 * MiB


def test_a_remainder_of_at_most_1_mib_is_not_split_off_a_large_block() -> None:
    a = CachingAllocator()
    a.malloc(11 * MiB)  # a 12 MiB segment; 1 MiB left is not > kSmallSize
    assert (a.allocated, a.reserved) == (12 * MiB, 12 * MiB)


def test_freed_blocks_are_reused_best_fit_and_split_remainders_stay_cached() -> None:
    a = CachingAllocator()
    h = a.malloc(100 * MiB)
    a.free(h)
    a.malloc(60 * MiB)  # reuses the 100 MiB segment, 40 MiB split off
    assert (a.allocated, a.reserved) == (60 * MiB, 100 * MiB)
    a.malloc(50 * MiB)  # the 40 MiB remainder does not fit: a new segment
    assert (a.allocated, a.reserved, a.max_reserved) == (110 * MiB, 150 * MiB, 150 * MiB)
    a.malloc(40 * MiB)  # the remainder, exactly
    assert a.reserved == 150 * MiB


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    a = CachingAllocator()
    big, small = a.malloc(100 * MiB), a.malloc(30 * MiB)
    a.free(big)
    a.free(small)
    a.malloc(30 * MiB)  # the 30 MiB block, not a split of the 100 MiB one
    a.malloc(100 * MiB)
    assert a.reserved == 130 * MiB


def test_freed_neighbours_coalesce_into_the_whole_segment() -> None:
    a = CachingAllocator()
    a.free(a.malloc(100 * MiB))
    x, y = a.malloc(60 * MiB), a.malloc(40 * MiB)
    a.free(x)
    a.free(y)
    a.malloc(100 * MiB)  # fits only if the two halves merged back
    assert a.reserved == 100 * MiB


def test_blocks_freed_on_one_stream_are_not_reused_on_another() -> None:
    a = CachingAllocator()
    a.free(a.malloc(100 * MiB, stream="compute"))
    a.malloc(100 * MiB, stream="all_gather")
    assert a.reserved == 200 * MiB
    a.malloc(100 * MiB, stream="compute")
    assert a.reserved == 200 * MiB


def test_an_allocation_past_the_limit_releases_the_cache_and_retries() -> None:
    a = CachingAllocator(limit_bytes=150 * MiB)
    a.free(a.malloc(100 * MiB, stream=0))
    a.malloc(120 * MiB, stream=1)  # 100 cached + 120 > 150: the cache is released first
    s = a.stats()
    assert (s.reserved, s.max_reserved, s.ooms, s.retries) == (120 * MiB, 120 * MiB, 0, 1)
    a.malloc(40 * MiB, stream=1)  # 160 MiB of live blocks cannot fit: torch raises
    assert a.stats().ooms == 1


def test_empty_cache_keeps_segments_with_a_live_block() -> None:
    a = CachingAllocator()
    a.free(a.malloc(100 * MiB))
    a.malloc(60 * MiB)
    a.free(a.malloc(30 * MiB))
    a.empty_cache()  # the 100 MiB segment is split (a live block): kept; 30 MiB released
    assert a.reserved == 100 * MiB


def test_expandable_segments_grow_in_20_mib_pages_and_join_the_free_tail() -> None:
    plain, grow = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for a in (plain, grow):
        a.free(a.malloc(40 * MiB))
        a.malloc(30 * MiB)  # 10 MiB left free at the end of the first 40 MiB
        a.malloc(30 * MiB)
    assert plain.reserved == 70 * MiB  # a new 30 MiB segment
    assert grow.reserved == 60 * MiB  # 20 MiB more mapped right after the free 10 MiB


def test_expandable_small_pool_maps_2_mib_pages_and_empty_cache_unmaps_them() -> None:
    a = CachingAllocator(expandable_segments=True)
    hs = [a.malloc(MiB) for _ in range(3)]  # 3 MiB on 2 MiB pages
    assert (a.allocated, a.reserved) == (3 * MiB, 4 * MiB)
    for h in hs:
        a.free(h)
    a.empty_cache()
    assert a.reserved == 0


def test_replay_trace_takes_keys_and_streams() -> None:
    s = replay_trace([("alloc", "a", 100 * MiB), ("free", "a"),
                      ("alloc", "b", 60 * MiB, "s"), ("alloc", "c", 60 * MiB)])
    assert (s.max_allocated, s.max_reserved) == (120 * MiB, 160 * MiB)
    assert s.fragmentation == pytest.approx(1 - 120 / 160)
    with pytest.raises(ValueError, match="not allocated"):
        replay_trace([("free", "x")])


def _random_trace(seed: int, n: int = 400) -> list[tuple]:
    rng = random.Random(seed)
    live, out = [], []
    for i in range(n):
        if live and rng.random() < 0.45:
            out.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB),
                               rng.randrange(MiB, 64 * MiB)])
            out.append(("alloc", i, size, rng.choice([0, 0, 1])))
            live.append(i)
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), expandable=st.booleans())
def test_any_trace_keeps_allocated_within_reserved_and_gives_it_all_back(seed: int,
                                                                         expandable: bool
                                                                         ) -> None:
    trace = _random_trace(seed)
    a = CachingAllocator(expandable_segments=expandable)
    handles, live = {}, {}
    for ev in trace:
        if ev[0] == "alloc":
            handles[ev[1]] = a.malloc(ev[2], ev[3])
            live[ev[1]] = round_size(ev[2])
        else:
            a.free(handles.pop(ev[1]))
            del live[ev[1]]
        assert sum(live.values()) <= a.allocated <= a.reserved
    for h in handles.values():
        a.free(h)
    assert a.allocated == 0
    a.empty_cache()
    assert a.reserved == 0


def test_the_same_trace_gives_the_same_segments() -> None:
    trace = _random_trace(7, 2000)
    for expandable in (False, True):
        a = replay_trace(trace, expandable_segments=expandable)
        b = replay_trace(trace, expandable_segments=expandable)
        assert a == b


# -- a step program through the allocator (simddp.program.steps) ------------------------------


def test_the_optimizer_state_is_created_in_what_the_first_backward_left_cached() -> None:
    step = [Memory("activations", 100 * MiB, key="act"), Memory("activations", -100 * MiB,
                                                                 key="act"),
            Compute("optimizer", (0.1,))]
    r = allocator_memory(step, {"parameters": 50 * MiB, "optimizer": 60 * MiB},
                         expandable_segments=False)
    # step 1: Adam's 60 MiB state splits the freed 100 MiB activation segment; step 2's
    # activations then need a new segment, 40 MiB stay stranded
    assert (r.allocated_peak, r.reserved_peak) == (210 * MiB, 250 * MiB)
    assert r.fragmentation == pytest.approx(40 / 250)


def test_a_free_without_a_key_releases_the_categorys_newest_allocation_and_keeps_the_excess(
        ) -> None:
    step = [Memory("gradients", 64 * MiB, "unsharded"),
            Memory("gradients", -48 * MiB, "sharded kept")]  # frees 64, keeps 16 MiB
    r = allocator_memory(step, iterations=1, expandable_segments=False)
    s = r.stats
    assert (s.max_allocated, s.allocated) == (64 * MiB, 16 * MiB)


def test_tensors_of_one_allocation_are_rounded_each() -> None:
    r = allocator_memory([Memory("activations", 3000, sizes=(1000, 1000, 1000))], iterations=1)
    assert r.allocated_peak == 3 * 1024  # 512-byte multiples, one block each


def test_nccl_buffers_follow_the_per_connection_formula() -> None:
    per = NCCL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE
    assert per == 4 * MiB + 4_915_200 + 524_288
    assert nccl_buffer_bytes(2, 1) == 2 * 32 * per + 1 * 2 * 2 * NCCL_BUFFSIZE


class _Program:
    def __init__(self, steps):
        self._steps = steps

    def memory_programs(self):
        return self._steps


def test_the_oom_verdict_compares_the_reserved_peak_with_the_card_less_context_and_nccl() -> None:
    coll = Issue(((Collective(("ag",), "shard", "all_gather_into_tensor", 1), 0.0),))
    step = [coll, Memory("activations", 1000 * MiB), Memory("activations", -1000 * MiB)]
    prog = _Program([(step, {"parameters": 200 * MiB})])
    outside = CUDA_CONTEXT_BYTES + nccl_buffer_bytes(1)
    fits = job_memory(prog, gpu_memory_bytes=outside + 1300 * MiB)
    assert fits.ooms == 0 and fits.margin == 1300 * MiB - fits.reserved_peak > 0
    assert fits.outside == {"cuda_context": CUDA_CONTEXT_BYTES,
                            "nccl_buffers": nccl_buffer_bytes(1)}
    short = job_memory(prog, gpu_memory_bytes=outside + 1100 * MiB)
    assert short.ooms > 0 and short.margin < 0
    assert short.reserved_peak == fits.reserved_peak  # the peak it would have needed


def test_a_planner_without_memory_programs_keeps_its_program_order_peak() -> None:
    class Old:
        def memory_programs(self):  # the contract's default: memory() only
            return None

        def memory(self):
            return 3 * MiB, {"parameters": 3 * MiB}

    got = job_memory(Old(), gpu_memory_bytes=2 * MiB)
    assert (got.reserved_peak, got.allocated_peak, got.ooms, got.margin) == \
        (3 * MiB, 3 * MiB, 1, -MiB)
