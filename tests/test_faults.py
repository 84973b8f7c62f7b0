"""Injected faults: a rank that dies or raises at an exact collective, deterministically."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg import faults


def reconfiguring(rank):
    """Fault-tolerant loop: on a dead peer, abort the group and go on without it."""
    group, members, t = dist.group.WORLD, list(range(dist.get_world_size())), torch.ones(1)
    for _ in range(6):
        try:
            dist.all_reduce(t, group=group)
        except RuntimeError as e:
            if "Connection closed by peer" not in str(e):
                raise
            dead = int(str(e).split("fakepg: rank ")[1].split()[0])
            group.abort()
            members = [r for r in members if r != dead]
            group = dist.new_group(members)
            dist.all_reduce(t, group=group)
    return t.item(), members


def test_a_crashed_rank_fails_its_peers_collectives_and_they_can_go_on_in_a_new_group():
    result = fakepg.spawn(reconfiguring, nprocs=3, faults=[faults.crash(1, at=2)])
    assert result.crashed == [1]
    # 1 -> 3 -> 9 with three ranks; then 18, 36, 72, 144 with two
    assert result.returns == [(144.0, [0, 2]), None, (144.0, [0, 2])]
    assert [r.state for r in result.trace[0]][2] == "failed"


def test_a_crash_is_deterministic():
    runs = [fakepg.spawn(reconfiguring, nprocs=3, faults=[faults.crash(2, at=1)]) for _ in range(2)]
    assert runs[0].returns == runs[1].returns and runs[0].to_json() == runs[1].to_json()


def test_an_unhandled_dead_peer_fails_the_world_with_glooss_connection_closed_error():
    def body(rank):
        for _ in range(3):
            dist.all_reduce(torch.ones(1))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2, faults=[faults.crash(1, at=1)])
    cause = info.value.__cause__
    assert isinstance(cause, fakepg.PeerCrashedError) and isinstance(cause, RuntimeError)
    assert "Connection closed by peer" in str(cause) and "rank 1 crashed" in str(cause)


def test_a_receive_from_a_crashed_rank_fails_instead_of_hanging():
    def body(rank):
        if rank == 0:
            with pytest.raises(fakepg.PeerCrashedError):
                dist.recv(torch.zeros(1), src=1)
            return "caught"
        dist.barrier()  # rank 1 dies here

    result = fakepg.spawn(body, nprocs=2, faults=[faults.crash(1, at=0)])
    assert result.returns == ["caught", None] and result.crashed == [1]


def test_raise_in_makes_a_rank_raise_at_its_kth_collective():
    def body(rank):
        for _ in range(3):
            dist.all_reduce(torch.ones(1))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2, faults=[faults.raise_in(0, at=2, exc=ValueError("disk full"))])
    assert info.value.rank == 0 and str(info.value.__cause__) == "disk full"


def test_faults_are_checked_against_the_world():
    with pytest.raises(ValueError, match="names rank 5, but the world has ranks 0..1"):
        fakepg.spawn(lambda rank: None, nprocs=2, faults=[faults.crash(5)])
    with pytest.raises(TypeError, match="faults must come from fakepg.faults"):
        fakepg.spawn(lambda rank: None, nprocs=2, faults=["crash"])
    with pytest.raises(ValueError, match="at must be an integer >= 0"):
        faults.crash(0, at=-1)


def not_fault_tolerant(rank):
    """Retries a failed all_reduce on the same (broken) group: no crash handling."""
    t = torch.ones(1)
    for _ in range(4):
        dist.all_reduce(t)
    return t.item()


def test_explore_searches_faults_and_names_the_one_that_breaks_the_program():
    from fakepg import strategies

    fakepg.spawn(not_fault_tolerant, nprocs=3)
    with pytest.raises(fakepg.ExplorationError) as info:
        fakepg.explore(not_fault_tolerant, nprocs=3, runs=30,
                       faults=strategies.faults(nprocs=3, max_at=3))
    err = info.value
    assert len(err.faults) == 1 and isinstance(err.faults[0], faults.Crash)
    assert err.faults[0] == faults.crash(0, at=0)  # shrunk: the first rank, first collective
    assert "faults=[faults.crash(0, at=0)]" in str(err).splitlines()[-1]


def test_a_fault_tolerant_program_survives_every_explored_crash():
    from fakepg import strategies

    summary = fakepg.explore(reconfiguring, nprocs=3, runs=30,
                             faults=strategies.faults(nprocs=3, max_at=5))
    assert summary.runs == 30


def test_abort_fails_the_callers_pending_work_and_a_new_group_works_afterwards():
    def body(rank):
        g = dist.new_group([0, 1])
        fresh = dist.new_group([0, 1])
        if rank == 0:
            work = dist.all_reduce(torch.ones(1), group=g, async_op=True)  # rank 1 never joins
            g.abort()
            with pytest.raises(fakepg.PeerCrashedError, match="rank 0 aborted"):
                work.wait()
            with pytest.raises(fakepg.FakePGError):
                dist.all_reduce(torch.ones(1), group=g)  # an aborted group takes no more calls
        t = torch.ones(1)
        dist.all_reduce(t, group=fresh)
        return t.item()

    assert fakepg.spawn(body, nprocs=2).returns == [2.0, 2.0]
