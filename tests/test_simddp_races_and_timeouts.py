"""simddp: races on async collectives and virtual timeouts (DESIGN, simddp semantics 4-5)."""

import datetime
import re

import pytest
import torch
import torch.distributed as dist

import fakepg
import simddp
from simddp import CollectiveRaceError, CollectiveTimeoutError, Compute, Network, Timing

NET = Network(bandwidth_GBps=10.0, latency_us=5.0)
TIMING = Timing(network=NET, compute=Compute.constant(1e-6))
mm_costs_one_second = Compute.from_profile({"aten::mm": 1.0}, fallback=Compute.constant(0.0))


def test_reading_an_async_all_reduce_output_before_its_wait_raises_a_race_naming_it_and_both_lines():
    def body(rank):
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)  # ISSUE
        try:
            t.sum()  # READ
        except CollectiveRaceError as e:
            caught = e
        else:
            caught = None
        work.wait()
        return caught

    res = simddp.simulate(body, nprocs=3, timing=TIMING)
    for rank, e in enumerate(res.returns):
        assert isinstance(e, CollectiveRaceError) and isinstance(e, fakepg.FakePGError)
        assert (e.rank, e.op, e.seq) == (rank, "all_reduce", 0)
        text = str(e)
        assert f"rank {rank}:" in text and "all_reduce #0" in text and "reads" in text
        assert "wait()" in text
        issue_line = _line_of("# ISSUE")
        read_line = _line_of("# READ")
        assert e.issued_at.endswith(f"test_simddp_races_and_timeouts.py:{issue_line}")
        assert e.accessed_at.endswith(f"test_simddp_races_and_timeouts.py:{read_line}")
        assert e.issued_at in text and e.accessed_at in text
    # rank 0 read before ranks 1 and 2 even issued it; the last rank before it ended
    assert "missing: ranks [1, 2]" in str(res.returns[0])
    assert "runs until" in str(res.returns[2])


def test_reading_an_async_all_reduce_output_after_its_wait_is_no_race():
    def body(rank):
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        return t.sum().item()

    assert simddp.simulate(body, nprocs=3, timing=TIMING).returns == [12.0] * 3


def test_a_wait_on_the_future_counts_as_a_wait_too():
    def body(rank):
        t = torch.ones(4)
        fut = dist.all_reduce(t, async_op=True).get_future()
        fut.wait()
        return t.sum().item()

    assert simddp.simulate(body, nprocs=2, timing=TIMING).returns == [8.0] * 2


def test_writing_into_an_async_collectives_output_before_its_wait_is_a_race():
    def body(rank):
        t = torch.ones(4)
        dist.all_reduce(t, async_op=True)
        t.add_(1)

    with pytest.raises(CollectiveRaceError, match="writes a tensor that all_reduce #0") as info:
        simddp.simulate(body, nprocs=2, timing=TIMING)
    assert info.value.rank == 0  # an uncaught race ends the world; simulate raises it as is


def test_touching_the_output_after_the_collective_ended_in_virtual_time_is_no_race():
    def body(rank):
        t = torch.ones(4)
        dist.all_reduce(t, async_op=True)  # never waited on
        dist.barrier()  # runs after it on the group, so the all_reduce has ended by now
        return t.sum().item()

    assert simddp.simulate(body, nprocs=2, timing=TIMING).returns == [8.0] * 2


def test_races_are_decided_from_program_order_and_virtual_time_so_reruns_agree():
    def body(rank):
        t = torch.ones(4)
        dist.all_reduce(t, async_op=True)
        if rank == 1:
            t.mul(2)

    messages = set()
    for _ in range(3):
        with pytest.raises(CollectiveRaceError) as info:
            simddp.simulate(body, nprocs=2, timing=TIMING)
        messages.add(str(info.value))
    assert len(messages) == 1


def test_a_virtual_timeout_fires_at_the_configured_time_on_the_waiting_rank():
    def body(rank):
        if rank == 1:
            a = torch.ones(2, 2)
            for _ in range(3):
                a = a @ a  # rank 1 issues 3 s late
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        issued = simddp.now()
        try:
            work.wait()
        except CollectiveTimeoutError as e:
            return "timeout", issued, e, simddp.now()
        return "ok", issued, None, simddp.now()

    timing = Timing(network=NET, compute=mm_costs_one_second, timeout=0.5)
    res = simddp.simulate(body, nprocs=2, timing=timing)
    kind, issued, e, clock = res.returns[0]
    assert kind == "timeout" and issued == 0.0
    assert e.time == clock == pytest.approx(0.5)
    assert (e.rank, e.op, e.seq, e.timeout) == (0, "all_reduce", 0, 0.5)
    text = str(e)
    assert text.startswith("[Rank 0] Watchdog caught collective operation timeout: WorkFakePG(SeqNum=1, "
                           "OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=500) ran for 500 "
                           "milliseconds before timing out.")
    assert "rank 1" in text  # names the late rank
    assert isinstance(e, fakepg.CollectiveTimeoutError)
    kind, issued, e, clock = res.returns[1]
    assert kind == "ok" and issued == 3.0 and e is None


def test_a_collective_that_ends_within_the_timeout_does_not_fire():
    def body(rank):
        if rank == 1:
            a = torch.ones(2, 2)
            a @ a  # 1 s late
        t = torch.ones(4)
        dist.all_reduce(t)
        return simddp.now()

    res = simddp.simulate(body, nprocs=2, timing=Timing(network=NET, compute=mm_costs_one_second,
                                                         timeout=datetime.timedelta(seconds=2)))
    assert res.returns[0] == pytest.approx(1.0 + NET.collective_time("all_reduce", 16, 2))


def test_without_a_timing_timeout_the_groups_own_timeout_applies_and_an_uncaught_one_ends_the_world():
    def body(rank):
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
        if rank == 1:
            a = torch.ones(2, 2)
            for _ in range(5):
                a = a @ a  # 5 s late
        dist.all_reduce(torch.ones(4), group=group)

    with pytest.raises(CollectiveTimeoutError, match=r"Timeout\(ms\)=2000\) ran for 2000 milliseconds") as info:
        simddp.simulate(body, nprocs=2, timing=Timing(network=NET, compute=mm_costs_one_second))
    assert info.value.rank == 0 and info.value.time == pytest.approx(2.0)


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(marker) and "def " not in line:
                return i
    raise AssertionError(marker)


def test_a_straggler_past_the_timeout_fails_ddp_backward_on_the_waiting_rank():
    def train(rank):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        x = torch.randn(4, 16)
        for i in range(3):
            loss = model(x).sum()
            if rank == 1 and i == 1:
                torch.cosh(x)  # 10 s of virtual compute before its backward
            loss.backward()

    timing = Timing(network=NET, timeout=5,
                    compute=Compute.from_profile({"aten::cosh": 10.0}, fallback=Compute.constant(1e-4)))
    with pytest.raises(CollectiveTimeoutError, match="OpType=ALLREDUCE") as info:
        simddp.simulate(train, nprocs=2, timing=timing)
    e = info.value
    assert e.rank == 0 and "last member, rank 1" in str(e)
    issued = float(re.search(r"issued by rank 0 at t=([0-9.]+) s", str(e)).group(1))
    assert e.time == pytest.approx(issued + 5)
