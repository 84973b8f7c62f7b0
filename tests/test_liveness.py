"""Wall-clock liveness: time.sleep lets other ranks run, timeouts fail the way the backend
fails (gloo's words, torch's types) at their deadline -- or at once when no rank could ever
arrive -- and spawn(timeout=) and Ctrl-C stop every rank thread before spawn returns."""

import _thread
import datetime
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import fakepg

pytest_plugins = ["pytester"]

MS100 = datetime.timedelta(seconds=0.1)


@pytest.fixture
def no_leftover_threads():
    before = set(threading.enumerate())
    yield
    assert set(threading.enumerate()) <= before


def test_a_polling_loop_with_sleep_lets_the_other_rank_set_the_key(no_leftover_threads):
    def body(rank):
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            polls = 0
            while not store.check(["k"]):
                polls += 1
                time.sleep(0.01)
            return polls
        time.sleep(0.05)
        store.set("k", "1")
        return None

    polls = fakepg.spawn(body, nprocs=2).returns[0]
    assert polls >= 1


def test_a_rank_waiting_on_a_sleeping_rank_is_not_a_hang():
    def body(rank):
        if rank == 1:
            time.sleep(0.05)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return t.item()

    assert fakepg.spawn(body, nprocs=2).returns == [3.0, 3.0]


def test_sleep_3600_past_the_world_timeout_is_stopped_with_each_ranks_stack(no_leftover_threads):
    def body(rank):
        if rank == 1:
            time.sleep(3600)  # the line the report must show
        dist.barrier()

    with pytest.raises(fakepg.SpawnTimeoutError) as info:
        fakepg.spawn(body, nprocs=2, timeout=0.2)
    report = info.value.report
    assert "timeout of 0.2 s" in report
    assert "rank 0: blocked waiting on barrier" in report
    assert "rank 1: sleeping in time.sleep(3600)" in report
    assert "time.sleep(3600)  # the line the report must show" in report


def test_a_busy_loop_past_the_world_timeout_is_interrupted(no_leftover_threads):
    def body(rank):
        if rank == 0:
            n = 0
            while True:  # spins in Python, never reaching fakepg
                n += 1
        dist.barrier()

    with pytest.raises(fakepg.SpawnTimeoutError) as info:
        fakepg.spawn(body, nprocs=2, timeout=0.2)
    report = info.value.report
    assert "rank 0: running" in report
    assert re.search(r'test_liveness.py", line \d+, in body\n +(while True:|n \+= 1)', report)
    assert "rank 1: never started" in info.value.report


def test_spawn_timeout_must_be_a_positive_number():
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        fakepg.spawn(lambda rank: None, nprocs=1, timeout=-1)


@pytest.mark.parametrize("how", ["sleeping", "spinning"])
def test_ctrl_c_during_spawn_stops_every_rank_before_it_propagates(how, no_leftover_threads):
    def body(rank):
        if rank == 1:
            while True:
                if how == "sleeping":
                    time.sleep(3600)
        dist.barrier()

    for _ in range(3):
        timer = threading.Timer(0.1, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                fakepg.spawn(body, nprocs=2)
        finally:
            timer.cancel()
            timer.join()
        # the next world runs alone and normally
        assert fakepg.spawn(lambda rank: rank, nprocs=2).returns == [0, 1]


def _catching(call):
    def body(rank):
        if rank != 0:
            time.sleep(0.3)  # still running when rank 0's deadline passes
            return None
        try:
            call()
        except RuntimeError as e:
            return e
        return None
    return body


def test_monitored_barrier_timeout_raises_gloos_error_while_a_rank_still_runs():
    err = fakepg.spawn(_catching(lambda: dist.monitored_barrier(timeout=MS100)), nprocs=2).returns[0]
    assert isinstance(err, dist.DistBackendError) and isinstance(err, fakepg.CollectiveHangError)
    assert str(err).startswith(
        "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 100 ms\n Original exception: \n"
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
        "Timed out waiting 100ms for recv operation to complete\n")
    assert "rank 1: sleeping in time.sleep(0.3)" in str(err)
    assert err.expired


def test_monitored_barrier_wait_all_ranks_names_every_missing_rank():
    call = lambda: dist.monitored_barrier(timeout=MS100, wait_all_ranks=True)  # noqa: E731
    err = fakepg.spawn(_catching(call), nprocs=3).returns[0]
    assert str(err).startswith("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 100 ms")


def test_a_barrier_past_the_group_timeout_raises_gloos_recv_timeout():
    def body(rank):
        group = dist.new_group(timeout=MS100)
        return _catching(lambda: dist.barrier(group=group))(rank)

    err = fakepg.spawn(body, nprocs=2).returns[0]
    assert isinstance(err, fakepg.BackendTimeoutError)
    assert "Timed out waiting 100ms for recv operation to complete" in str(err).splitlines()[0]


def test_an_unhandled_timeout_fails_its_rank():
    def body(rank):
        if rank == 1:
            time.sleep(0.3)
            return
        dist.monitored_barrier(timeout=MS100)

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2)
    assert info.value.rank == 0
    assert isinstance(info.value.__cause__, fakepg.BackendTimeoutError)


def test_monitored_barrier_whose_peer_returned_fails_at_once_with_a_timeout_the_rank_can_catch():
    caught = []

    def body(rank):
        if rank < 2:
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(hours=1))
            except dist.DistBackendError as e:
                caught.append(e)
            # Not a hang of the world: the two ranks that caught it go on together, as on gloo.
            t = torch.ones(1)
            dist.all_reduce(t, group=dist.new_group([0, 1]))
            return t.item()
        dist.new_group([0, 1])
        return None  # rank 2 returns without reaching the barrier

    result = fakepg.spawn(body, nprocs=3)
    assert result.returns == [2.0, 2.0, None] and result.hang_report is None
    root, peer = caught
    assert str(root).startswith("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 3600000 ms")
    assert str(peer).startswith("Rank 1 successfully reached monitoredBarrier, but received errors")
    assert "the ranks it waits for have finished" in str(root) and "rank 2: finished" in str(root)
    # Uncaught, it is the rank's own failure, reported as such.
    with pytest.raises(fakepg.RankFailedError, match="rank 0 failed: BackendTimeoutError"):
        fakepg.spawn(lambda r: dist.monitored_barrier() if r == 0 else None, nprocs=2)


TIMEOUT_TEST = '''
import time, pytest

def sleepy(rank):
    time.sleep(3600)

@pytest.mark.fakepg_timeout(0.1)
def test_marker_bounds_the_world(fake_cluster):
    fake_cluster.run(sleepy)

def test_option_bounds_the_world(fake_cluster):
    fake_cluster.run(sleepy)
'''


def test_pytest_timeout_marker_and_option_bound_fake_cluster_worlds(pytester):
    pytester.makepyfile(test_timeouts=TIMEOUT_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "--fakepg-timeout", "0.1")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*SpawnTimeoutError*", "*time.sleep(3600)*"])
    assert result.stdout.str().count("timeout of 0.1 s") >= 2


def test_monitored_barrier_on_a_rank_other_than_0_blames_rank_0_as_gloo_does():
    def body(rank):
        if rank == 0:
            time.sleep(0.3)
            return None
        try:
            dist.monitored_barrier(timeout=MS100)
        except dist.DistBackendError as e:
            return str(e)

    message = fakepg.spawn(body, nprocs=2).returns[1]
    assert message.startswith("Rank 1 successfully reached monitoredBarrier, but received errors "
                              "while waiting for send/recv from rank 0.")
    assert "rank 0: sleeping in time.sleep(0.3)" in message


# Found by torch's own suite (DistributedTest.test_monitored_barrier_gloo_subgroup and
# test_monitored_barrier_gloo_rank_0_timeout); messages checked against real gloo.
def test_monitored_barrier_zero_timeout_expires_at_once_in_gloos_words():
    def body(rank):
        g = dist.new_group([0, 1])
        if rank == 0:
            return _catching(lambda: g.monitored_barrier(datetime.timedelta(0)))(rank)
        time.sleep(0.2)  # still running: not a hang

    err = fakepg.spawn(body, nprocs=2).returns[0]
    assert isinstance(err, dist.DistBackendError)
    assert str(err).startswith(
        "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 0 ms\n Original exception: \n"
        "Rank 0 timed out in monitoredBarrier after 0 ms.\n"
        "No ranks successfully processed in monitoredBarrier.")


def test_monitored_barrier_takes_seconds_as_a_float_and_is_a_no_op_outside_its_group():
    def body(rank):
        sub = dist.new_group(ranks=[0, 1])
        if rank == 1:
            time.sleep(0.3)
            return None
        if rank == 0:
            with pytest.warns(UserWarning, match="Converting current value of 0.1"):
                return _catching(lambda: dist.monitored_barrier(sub, 0.1))(rank)
        return dist.monitored_barrier(sub, 0.1)  # rank 2 is not a member: torch returns None

    err, _, outsider = fakepg.spawn(body, nprocs=3).returns
    assert str(err).startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 100 ms")
    assert outsider is None
