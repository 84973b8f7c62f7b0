"""simddp: properties of virtual time that must hold for any timing (Hypothesis)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import simddp
from simddp import Compute, Network, Timing

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def train(rank, iters=3, cap=0.01):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(48, 48) for _ in range(3)]), bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 48) * (rank + 1)
    for _ in range(iters):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def never_later(fast, slow):
    """Every event of ``fast`` happens no later than the same event of ``slow``."""
    tol = 1e-12 * max(1.0, slow.timeline.makespan)
    for a, b in zip(fast.timeline.boundaries, slow.timeline.boundaries):
        assert len(a) == len(b)
        assert all(x <= y + tol for x, y in zip(a, b))
    for ra, rb in zip(fast.trace, slow.trace):
        assert all(x.end <= y.end + tol for x, y in zip(ra, rb))
    assert fast.timeline.makespan <= slow.timeline.makespan + tol


timings = st.builds(
    lambda bw, lat, per_op, jitter, cap: (Timing(network=Network(bandwidth_GBps=bw, latency_us=lat),
                                                 compute=Compute.constant(per_op), jitter=jitter), cap),
    bw=st.floats(0.01, 100.0), lat=st.floats(0.0, 100.0), per_op=st.floats(0.0, 1e-3),
    jitter=st.sampled_from([0.0, 0.2]), cap=st.sampled_from([0.005, 0.02, 1.0]))


@SETTINGS
@given(timing_cap=timings, factor=st.floats(1.0, 100.0), nprocs=st.integers(2, 4),
       seed=st.integers(0, 3))
def test_more_bandwidth_is_never_slower(timing_cap, factor, nprocs, seed):
    timing, cap = timing_cap
    faster = dataclasses.replace(timing, network=timing.network.with_(
        bandwidth_GBps=timing.network.bandwidth_GBps * factor))
    slow = simddp.simulate(train, args=(3, cap), nprocs=nprocs, timing=timing, seed=seed)
    fast = simddp.simulate(train, args=(3, cap), nprocs=nprocs, timing=faster, seed=seed)
    never_later(fast, slow)


@SETTINGS
@given(timing_cap=timings, data=st.data(), nprocs=st.integers(2, 4), seed=st.integers(0, 3))
def test_a_straggler_is_never_faster(timing_cap, data, nprocs, seed):
    timing, cap = timing_cap
    rank = data.draw(st.integers(0, nprocs - 1), label="straggler")
    speed = data.draw(st.floats(0.05, 1.0), label="speed")
    slowed = dataclasses.replace(timing, rank_speed={rank: speed})
    base = simddp.simulate(train, args=(3, cap), nprocs=nprocs, timing=timing, seed=seed)
    straggling = simddp.simulate(train, args=(3, cap), nprocs=nprocs, timing=slowed, seed=seed)
    never_later(base, straggling)


OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
steps = st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(["world", "pair"]),
                           st.integers(1, 50_000), st.booleans()), min_size=1, max_size=8)


def issue_program(rank, steps, delays):
    """Every rank issues ``steps`` async, computing ``delays[rank][i]`` matmuls before each."""
    pair = dist.new_group([0, 1])
    pending = []
    a = torch.ones(2, 2)
    for i, (op, where, numel, wait_now) in enumerate(steps):
        if where == "pair" and rank > 1:
            continue
        group = pair if where == "pair" else None
        n = 2 if where == "pair" else dist.get_world_size()
        for _ in range(delays[rank][i]):
            a = a @ a
        t = torch.ones(numel)
        if op == "all_reduce":
            w = dist.all_reduce(t, group=group, async_op=True)
        elif op == "broadcast":
            w = dist.broadcast(t, src=0, group=group, async_op=True)
        elif op == "all_gather":
            w = dist.all_gather_into_tensor(torch.empty(n * numel), t, group=group, async_op=True)
        elif op == "reduce_scatter":
            w = dist.reduce_scatter_tensor(torch.empty(numel), torch.ones(n * numel), group=group,
                                           async_op=True)
        else:
            w = dist.barrier(group=group, async_op=True)
        if wait_now:
            w.wait()
        else:
            pending.append(w)
    for w in pending:
        w.wait()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@SETTINGS
@given(steps=steps, data=st.data(), nprocs=st.integers(2, 3), jitter=st.sampled_from([0.0, 0.3]))
def test_collectives_on_one_group_never_overlap_in_time(steps, data, nprocs, jitter):
    delays = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=len(steps), max_size=len(steps)),
                                min_size=nprocs, max_size=nprocs), label="delays")
    timing = Timing(network=Network(bandwidth_GBps=1.0, latency_us=20.0),
                    compute=Compute.from_profile({"aten::mm": 1e-4}, fallback=Compute.constant(0)),
                    jitter=jitter)
    res = simddp.simulate(issue_program, args=(steps, delays), nprocs=nprocs, timing=timing)
    by_collective = {}
    for recs in res.trace:
        by_group = {}
        for r in recs:
            by_group.setdefault(r.group, []).append(r)
            by_collective.setdefault((r.group, r.seq), []).append(r)
        for group_recs in by_group.values():
            group_recs.sort(key=lambda r: r.seq)
            for prev, nxt in zip(group_recs, group_recs[1:]):
                assert prev.end <= nxt.start
    for members in by_collective.values():
        assert len({(r.start, r.end) for r in members}) == 1  # one collective, one interval
        assert members[0].start >= max(r.issue for r in members)  # never before all issued
