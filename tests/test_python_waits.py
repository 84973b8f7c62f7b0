"""Every wait gets a verdict or a deadline: ranks that wait on each other through Python's
own synchronisation, a rank busy-waiting on the clock past a peer's timeout, a rank blocked on
a lock another rank holds, and processes a rank forks -- each written as the user's program."""

from __future__ import annotations

import concurrent.futures
import datetime
import multiprocessing
import os
import queue
import re
import select
import threading
import time

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg.world.scheduler import Scheduler

Q: queue.Queue = queue.Queue()  # module globals: one per process under torchrun, shared by rank threads
EVENT = threading.Event()
LOCK = threading.Lock()


@pytest.fixture
def no_leftover_threads():
    before = set(threading.enumerate())
    yield
    assert set(threading.enumerate()) <= before


def _hang_report(fn, **kwargs) -> str:
    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(fn, nprocs=2, **kwargs)
    return str(info.value)


def test_a_queue_get_nobody_will_fill_is_a_hang_naming_queue_get_and_the_line(no_leftover_threads):
    def train(rank):
        if rank == 0:
            dist.barrier()
        else:
            Q.get()  # waits for rank 0, which waits in the barrier for rank 1

    report = _hang_report(train)
    assert "rank 1: blocked waiting on queue.Queue.get at tests/test_python_waits.py:" in report
    assert "(Python's own synchronisation)" in report
    assert "rank 0: blocked waiting on barrier" in report
    assert "a busy loop or a long sleep" not in report
    assert "Between processes ranks share no Python objects" in report
    assert "--isolation process" in report


@pytest.mark.parametrize("primitive", ["threading.Event.wait", "threading.Condition.wait",
                                       "concurrent.futures.Future.result",
                                       "threading.Semaphore.acquire"])
def test_each_python_primitive_blocking_while_no_rank_can_progress_is_named(primitive):
    def train(rank):
        if rank == 0:
            dist.barrier()
            return
        if primitive == "threading.Event.wait":
            threading.Event().wait()
        elif primitive == "threading.Condition.wait":
            cond = threading.Condition()
            with cond:
                cond.wait()
        elif primitive == "concurrent.futures.Future.result":
            concurrent.futures.Future().result()
        else:
            threading.Semaphore(0).acquire()

    report = _hang_report(train)
    assert f"rank 1: blocked waiting on {primitive} at tests/test_python_waits.py:" in report


def test_ranks_passing_items_through_a_shared_queue_run_to_completion():
    def train(rank):
        if rank == 0:
            Q.put(41)
            dist.barrier()
            return None
        item = Q.get()  # rank 0 runs meanwhile
        dist.barrier()
        return item + 1

    assert fakepg.spawn(train, nprocs=2).returns == [None, 42]


@pytest.mark.parametrize("helper_waits", [
    pytest.param(lambda: time.sleep(0.3), id="in time.sleep"),
    # a native wait fakepg cannot see into, burning no CPU, as torchft's quorum thread waits
    # in Rust for its lighthouse: before, a false hang verdict
    pytest.param(lambda: select.select([], [], [], 0.6), id="inside a native call"),
])
def test_a_wait_a_thread_of_the_rank_releases_later_is_not_a_hang(helper_waits):
    """The helper waits longer than the world's inactivity window (hang_timeout)."""
    def train(rank):
        done = threading.Event()

        def work():
            helper_waits()
            done.set()

        helper = threading.Thread(target=work)
        helper.start()
        done.wait()
        helper.join()
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    assert fakepg.spawn(train, nprocs=2, hang_timeout=0.1).returns == [2.0, 2.0]


def test_a_thread_stuck_in_a_native_call_delays_the_verdict_by_the_grace_and_is_named(
        monkeypatch):
    monkeypatch.setattr(Scheduler, "native_grace", 0.5)
    r, w = os.pipe()
    helpers = []

    def train(rank):
        done = threading.Event()

        def work():
            os.read(r, 1)  # nobody writes while the world runs
            done.set()

        helpers.append(threading.Thread(target=work, name=f"reader{rank}"))
        helpers[-1].start()
        done.wait()

    try:
        report = _hang_report(train, hang_timeout=0.1)
    finally:
        os.write(w, b"xx")
        for t in helpers:
            t.join()
        os.close(r)
        os.close(w)
    assert "Threads the program started were still inside a native call after 0.5 s" in report
    assert re.search(r"reader0 at \S*tests/test_python_waits.py:\d+", report)


def test_a_timed_python_wait_ends_at_its_timeout_and_the_rank_goes_on():
    def train(rank):
        got = threading.Event().wait(timeout=0.05)
        dist.barrier()
        return got

    assert fakepg.spawn(train, nprocs=2).returns == [False, False]


def test_a_lock_another_rank_holds_across_a_collective_is_a_hang_naming_the_lock(
        no_leftover_threads):
    def train(rank):
        with LOCK:  # one lock per process under torchrun; here both ranks share it
            dist.barrier()

    report = _hang_report(train)
    assert "rank 1: blocked acquiring threading.Lock LOCK in `with LOCK:` at " in report
    assert "rank 1 has been blocked for" in report
    assert "acquiring threading.Lock LOCK in `with LOCK:` at tests/test_python_waits.py:" in report
    assert "run the ranks as processes (fakerun --isolation process" in report
    assert not LOCK.locked()


def test_the_same_lock_program_runs_as_processes():
    def train(rank):
        with LOCK:
            dist.barrier()
        return rank

    assert fakepg.spawn(train, nprocs=2, isolation="process").returns == [0, 1]


def test_a_group_timeout_fires_at_the_deadline_on_a_peer_that_busy_waits_on_the_clock():
    def train(rank):
        group = dist.new_group(timeout=datetime.timedelta(seconds=0.2))
        if rank == 1:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # busy, never reaching fakepg
                pass
            return "done"
        try:
            dist.barrier(group=group)
        except dist.DistBackendError as e:
            return str(e)

    waited, busy = fakepg.spawn(train, nprocs=2).returns
    assert busy == "done"
    assert waited.startswith("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                             "unbound_buffer.cc:78] Timed out waiting 200ms for recv operation")
    assert "rank 0 gave up after its timeout of 0.2 s while other ranks were still running" in waited
    assert "rank 1: running (a loop reading the clock" in waited


def _sleep_then_write(path: str) -> None:
    time.sleep(0.2)
    with open(path, "w") as f:
        f.write("slept")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_process_a_rank_forks_sleeps_for_real_and_ends(isolation, tmp_path, no_leftover_threads):
    def train(rank):
        path = tmp_path / f"child{rank}"
        child = multiprocessing.get_context("fork").Process(target=_sleep_then_write,
                                                            args=(str(path),))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        t = torch.ones(1)
        dist.all_reduce(t)
        return child.exitcode, alive, path.read_text() if path.exists() else None, t.item()

    returns = fakepg.spawn(train, nprocs=2, isolation=isolation).returns
    assert returns == [(0, False, "slept", 2.0)] * 2


from torch.distributed import TCPStore as _BOUND_AT_IMPORT  # noqa: E402 - as torchft binds it


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_native_store_client_of_the_worlds_address_fails_at_once_naming_the_native_wait(
        isolation):
    def train(rank):
        _BOUND_AT_IMPORT("127.0.0.1", 29500, is_master=False,
                         timeout=datetime.timedelta(seconds=60))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(train, nprocs=2, isolation=isolation)
    cause = info.value.__cause__
    assert type(cause).__name__ == "NativeWaitError"
    text = str(cause)
    assert "rank 0: tests/test_python_waits.py:" in text
    assert "builds torch's native TCPStore client for 127.0.0.1:29500, the fake world's store" in text
    assert "in thread mode and with --isolation process alike" in text
    assert "run this program under torchrun with real gloo" in text



def test_a_native_store_client_a_rank_thread_starts_and_the_program_catches_ends_the_world():
    """torchft builds its store client in its quorum thread and catches the error: the world
    ends at once naming the refused native wait, not the program's later error of its own
    (torchft's AttributeError), and the other rank's quorum thread, reaching its store after
    the world ended, is refused too instead of retrying inside C++ past the world."""
    from concurrent.futures import ThreadPoolExecutor

    def quorum():
        try:
            _BOUND_AT_IMPORT("127.0.0.1", 29500, is_master=False,
                             timeout=datetime.timedelta(seconds=30))
        except Exception as e:  # noqa: BLE001 - as torchft's quorum catches it
            return e
        return None

    def train(rank):
        with ThreadPoolExecutor(1) as pool:
            caught = pool.submit(quorum).result()
        dist.barrier()  # the program goes on, as torchft does, and fails its own way
        raise AttributeError(f"program's own error after {type(caught).__name__}")

    t0 = time.monotonic()
    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(train, nprocs=2, timeout=60)
    assert time.monotonic() - t0 < 20  # not the native client's 30 s connect timeout
    assert type(info.value.__cause__).__name__ == "NativeWaitError"
    assert "failed: NativeWaitError:" in str(info.value)
    assert "in a thread the program started" in str(info.value)
    assert "program's own error" not in str(info.value).splitlines()[0]

def test_a_thread_of_a_world_ended_by_a_verdict_that_then_builds_a_native_client_is_refused():
    """torchft's quorum thread reaching its store after the world ended with a hang verdict
    (not a refusal): before, its native client retried inside C++ until its timeout."""
    go, out = threading.Event(), []

    def late_quorum():
        go.wait()  # until the world has ended
        try:
            _BOUND_AT_IMPORT("127.0.0.1", 29517, is_master=False,
                             timeout=datetime.timedelta(seconds=30))
        except Exception as e:  # noqa: BLE001
            out.append(e)

    helpers = []

    def train(rank):
        if rank == 0:
            helpers.append(threading.Thread(target=late_quorum))
            helpers[0].start()
        dist.barrier() if rank == 0 else threading.Event().wait()

    try:
        _hang_report(train, master_port=29517)
    finally:
        go.set()
        for t in helpers:
            t.join()
    assert type(out[0]).__name__ == "NativeWaitError", out
    assert "127.0.0.1:29517, that world's store, which is gone" in str(out[0])


COND = threading.Condition(threading.Lock())


def test_a_condition_another_rank_holds_across_a_collective_is_a_hang_naming_it(
        no_leftover_threads):
    def train(rank):
        with COND:
            dist.barrier()

    report = _hang_report(train)
    assert ("acquiring threading.Lock (inside a threading.Condition) in `with COND:` at "
            "tests/test_python_waits.py:") in report
