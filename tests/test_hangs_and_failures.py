"""Hangs are reported in about a second, naming each rank's pending collective;
failures end the world and surface as RankFailedError."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg


def _ddp():
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))


def _step(model, rank, it):
    g = torch.Generator().manual_seed(rank * 100 + it)
    model(torch.randn(4, 8, generator=g)).sum().backward()


def _hang(fn, nprocs=2):
    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(fn, nprocs=nprocs)
    return info.value


def test_uneven_inputs_without_join_is_reported_as_a_hang_naming_the_pending_bucket_allreduce():
    def body(rank):
        model = _ddp()
        for it in range(2 + rank):  # rank 1 has one more batch
            _step(model, rank, it)

    err = _hang(body)
    assert "inactivity fallback" not in err.report  # decided exactly, not by waiting
    report = err.report
    assert "rank 0: finished" in report
    assert "rank 1: blocked waiting on all_reduce" in report
    assert "waits for ranks [0]" in report
    assert "test_hangs_and_failures.py:21" in report  # the backward() line
    assert "Join" in report


def test_a_rank_that_skips_backward_is_reported_with_each_ranks_pending_collective():
    def body(rank):
        model = _ddp()
        for it in range(3):
            if rank == 1 and it == 1:
                model(torch.randn(4, 8))  # forward only: no gradient all_reduce this step
                continue
            _step(model, rank, it)

    err = _hang(body)
    # rank 1 issued one gradient all_reduce fewer, so rank 0's last one never completes
    assert "rank 1: finished (returned)" in err.report
    assert "rank 0: blocked waiting on all_reduce" in err.report
    assert "test_hangs_and_failures.py:21; waits for ranks [1]" in err.report


def test_a_rank_that_returns_early_is_reported_as_a_hang():
    def body(rank):
        dist.all_reduce(torch.ones(2))
        if rank == 2:
            return
        dist.all_reduce(torch.ones(3))

    err = _hang(body, nprocs=3)
    assert "rank 2: finished (returned)" in err.report
    assert "pending #1 all_reduce" in err.report
    assert "still waits for ranks [2]" in err.report
    assert "rank 0: #0, rank 1: #0, rank 2: #0" in err.report  # last completed per group


def test_a_group_where_nothing_completed_says_so_in_words_not_as_sequence_number_minus_one():
    def body(rank):
        if rank == 0:
            dist.all_reduce(torch.ones(2))  # rank 1 never joins: the group's first collective

    err = _hang(body)
    assert "group '0' (ranks [0, 1]): rank 0: none completed yet, rank 1: none completed yet" in err.report
    assert "#-1" not in err.report


def test_hang_report_names_blocked_point_to_point_peers():
    def body(rank):
        dist.recv(torch.zeros(1), src=1 - rank)  # both receive first: deadlock

    err = _hang(body)
    assert "recv with rank 1" in err.report and "recv with rank 0" in err.report


def test_hang_error_is_raised_in_the_blocked_ranks_too():
    seen = {}

    def body(rank):
        try:
            if rank == 0:
                dist.all_reduce(torch.ones(1))
        except fakepg.CollectiveHangError as e:
            seen[rank] = e.report
            raise

    _hang(body)
    assert 0 in seen and "rank 0: blocked" in seen[0]


def test_an_exception_in_one_rank_surfaces_as_rank_failed_error_with_the_original_as_cause():
    def body(rank):
        dist.all_reduce(torch.ones(1))
        if rank == 2:
            raise ZeroDivisionError("bad batch")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=4)
    assert info.value.rank == 2
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert "bad batch" in str(info.value) and "test_hangs_and_failures.py" in str(info.value)


def test_surviving_ranks_pending_and_later_collectives_fail_so_their_threads_exit():
    errors = {}

    def body(rank):
        if rank == 0:
            raise RuntimeError("rank 0 dies")
        try:
            dist.all_reduce(torch.ones(1))
        except fakepg.FakePGError as e:
            errors[rank] = e
        try:
            dist.all_reduce(torch.ones(1))  # a later collective fails at once too
        except fakepg.FakePGError as e:
            errors[(rank, "later")] = e

    with pytest.raises(fakepg.RankFailedError):
        fakepg.spawn(body, nprocs=3)
    assert set(errors) == {1, 2, (1, "later"), (2, "later")}
    assert all("rank 0" in str(e) for e in errors.values())


def test_mismatched_collectives_raise_in_every_participant_and_in_spawn():
    raised = {}

    def body(rank):
        try:
            if rank == 0:
                dist.all_reduce(torch.ones(4))
            else:
                dist.all_reduce(torch.ones(5))
        except fakepg.CollectiveMismatchError as e:
            raised[rank] = str(e)
            raise

    with pytest.raises(fakepg.CollectiveMismatchError) as info:
        fakepg.spawn(body, nprocs=2)
    assert set(raised) == {0, 1}
    msg = str(info.value)
    assert "rank 0: all_reduce(shapes=[(4,)]" in msg and "rank 1: all_reduce(shapes=[(5,)]" in msg
    assert msg.count("test_hangs_and_failures.py:") == 2


@pytest.mark.parametrize("case,words", [
    ("op", ["all_reduce", "broadcast"]),
    ("dtype", ["float32", "float64"]),
    ("reduce_op", ["op=SUM", "op=MAX"]),
    ("root", ["root=0", "root=1"]),
])
def test_each_kind_of_mismatch_is_reported_with_both_sides(case, words):
    def body(rank):
        t = torch.ones(3, dtype=torch.float64 if (case == "dtype" and rank) else torch.float32)
        if case == "op":
            dist.all_reduce(t) if rank == 0 else dist.broadcast(t, 0)
        elif case == "dtype":
            dist.all_reduce(t)
        elif case == "reduce_op":
            dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        else:
            dist.broadcast(t, src=rank)

    with pytest.raises(fakepg.CollectiveMismatchError) as info:
        fakepg.spawn(body, nprocs=2)
    for w in words:
        assert w in str(info.value)
    assert str(info.value).count("test_hangs_and_failures.py:") == 2  # both sides' lines


def test_the_same_hang_gives_the_same_report_every_run():
    def body(rank):
        for i in range(rank + 1):
            dist.all_reduce(torch.ones(i + 1))

    assert _hang(body, 3).report == _hang(body, 3).report


def test_waiting_on_fakepg_futures_with_torch_futures_wait_all_is_not_a_hang():
    def body(rank):
        works = [dist.all_reduce(torch.full((2,), float(rank)), async_op=True) for _ in range(3)]
        values = torch.futures.wait_all([w.get_future() for w in works])
        return [v[0].tolist() for v in values]

    assert fakepg.spawn(body, nprocs=2).returns == [[[1.0, 1.0]] * 3] * 2


def test_a_wait_hidden_in_cpp_is_caught_by_the_inactivity_fallback_which_says_so():
    def body(rank):
        work = dist.all_reduce(torch.ones(1), async_op=True)
        torch._C._collect_all([work.get_future()]).wait()  # C++ wait: invisible to fakepg

    err = _hang(body)
    assert "inactivity fallback" in err.report and "rank 0" in err.report


def test_python_work_with_an_outstanding_collective_is_not_mistaken_for_a_cpp_wait():
    def body(rank):
        work = dist.all_reduce(torch.ones(1), async_op=True)
        deadline = time.monotonic() + 0.6  # busy in Python for twice the fallback's patience
        while time.monotonic() < deadline:
            pass
        work.wait()
        return "ok"

    assert fakepg.spawn(body, nprocs=2, hang_timeout=0.3).returns == ["ok", "ok"]


# Issue 8 item 7: wrong input gets the error the backend gives, catchable, naming the range.
@pytest.mark.parametrize("call, says", [
    (lambda: dist.broadcast(torch.zeros(1), src=7), "invalid root rank: 7 (a group of size 2 has ranks 0..1)"),
    (lambda: dist.broadcast(torch.zeros(1), src=-1), "invalid root rank: -1"),
    (lambda: dist.recv(torch.zeros(1), src=5), "invalid peer rank: 5 (a group of size 2 has ranks 0..1)"),
    (lambda: dist.send(torch.zeros(1), dst=2), "invalid peer rank: 2"),
])
def test_a_root_or_peer_outside_the_group_is_a_catchable_runtime_error_naming_the_range(call, says):
    def body(rank):
        try:
            call()
        except RuntimeError as e:
            return isinstance(e, ValueError), str(e)
        return None

    caught, message = fakepg.spawn(body, nprocs=2).returns[0]
    assert caught and says in message and "rank 0: invalid" in message


def test_init_process_group_twice_is_refused_as_torch_refuses_it():
    def body(rank):
        dist.init_process_group("gloo")          # maps onto the world spawn made
        with pytest.raises(ValueError, match="trying to initialize the default process group twice"):
            dist.init_process_group("gloo")
        dist.destroy_process_group()
        dist.init_process_group("nccl")          # after a destroy, once more
        with pytest.raises(ValueError, match="twice"):
            dist.init_process_group()
        return dist.get_world_size()

    assert fakepg.spawn(body, nprocs=2).returns == [2, 2]


def test_a_mismatch_in_device_alone_names_each_ranks_device():
    def body(rank):
        dist.all_reduce(torch.zeros(2, device="meta" if rank == 0 else "cpu"))

    with pytest.raises(fakepg.CollectiveMismatchError) as info:
        fakepg.spawn(body, nprocs=2)
    lines = str(info.value).splitlines()
    assert lines[1].endswith(" on meta") and lines[2].endswith(" on cpu")


def test_a_hang_in_a_big_world_is_reported_in_a_few_lines_naming_the_missing_rank():
    """Ranks in the same state share a line, rank lists become ranges: a report on 300 ranks
    (and on 4,096: ci/bench_fakepg_scale.py's worlds) is as short as one on 2."""
    def body(rank):
        if rank != 7:
            dist.all_reduce(torch.ones(2))

    with pytest.raises(fakepg.CollectiveHangError) as e:
        fakepg.spawn(body, nprocs=300)
    report = e.value.report
    assert len(report.splitlines()) <= 8
    assert "  ranks 0-6: blocked waiting on all_reduce" in report
    assert "group '0' (ranks [0-299])" in report and "waits for ranks [7]" in report
    assert "  rank 7: finished (returned)" in report
    assert "issued by ranks 0-6, 8-299 at " in report


def test_a_mismatch_in_a_big_world_names_the_odd_rank_on_its_own_line():
    def body(rank):
        dist.all_reduce(torch.ones(2 + (rank == 30)))

    with pytest.raises(fakepg.CollectiveMismatchError) as e:
        fakepg.spawn(body, nprocs=40)
    lines = str(e.value).splitlines()
    assert lines[1].startswith("  ranks 0-29: all_reduce(shapes=[(2,)]")
    assert lines[2].startswith("  rank 30: all_reduce(shapes=[(3,)]")
    assert lines[3].startswith("  ranks 31-39: all_reduce(shapes=[(2,)]")


def test_a_hang_with_thousands_in_flight_lists_the_oldest_and_counts_the_rest():
    # torch's *_stress tests leave 1,000s of async collectives in flight; a report listing
    # each was megabytes, copied into every failed work's error (gigabytes in process mode)
    def body(rank):
        if rank == 0:
            works = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(2000)]
            works[-1].wait()

    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(body, nprocs=2)
    report = info.value.report
    assert "waiting on all_reduce(shapes=[(1,)], dtypes=[float32], op=SUM) #1999" in report
    assert report.count("also pending: all_reduce") == 8
    assert "... and 1991 more pending (the oldest 8 are listed)" in report
    assert "pending #7 all_reduce" in report and "pending #8 all_reduce" not in report
    assert "... and 1992 more pending on this group (the oldest 8 are listed)" in report
    assert len(report) < 10_000
