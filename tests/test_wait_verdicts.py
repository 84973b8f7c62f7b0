"""Every wait ends with a verdict or a deadline, and no rank thread outlives its world unless
it is blocked in C, which the error then names: locks by any name, RLocks and Conditions,
waits inside an import, and spawn's own timeout."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest
import torch.distributed as dist

import fakepg

LOCK = threading.Lock()
RLOCK = threading.RLock()
COND = threading.Condition()


def _ranks_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fakepg-rank")]


def _hang(fn) -> str:
    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(fn, nprocs=2, timeout=60)
    assert _ranks_alive() == []
    return str(info.value)


def test_a_lock_taken_through_a_local_name_gets_the_verdict_naming_that_name():
    def train(rank):
        lock = LOCK
        if rank == 0:
            lock.acquire()  # never released: rank 1 waits on it for ever
            dist.barrier()
        else:
            with lock:
                dist.barrier()

    report = _hang(train)
    assert "acquiring threading.Lock lock in `with lock:` at tests/test_wait_verdicts.py:" in report
    assert not LOCK.locked()


def test_a_timed_acquire_with_arguments_gets_the_verdict():
    def train(rank, held=LOCK):
        if rank == 0:
            held.acquire()
            dist.barrier()
        else:
            held.acquire(True, 100)
            dist.barrier()

    assert "acquiring threading.Lock held in `held.acquire(True, 100)`" in _hang(train)
    if LOCK.locked():
        LOCK.release()


def test_an_rlock_the_other_rank_never_releases_gets_the_verdict_and_no_thread_is_left():
    def train(rank):
        if rank == 0:
            RLOCK.acquire()  # held across the barrier: its owner frees it as the world ends
            dist.barrier()
        else:
            with RLOCK:
                dist.barrier()

    report = _hang(train)
    assert "acquiring threading.RLock RLOCK in `with RLOCK:`" in report
    assert RLOCK.acquire(blocking=False)  # free again for the next program
    RLOCK.release()


def test_a_condition_held_across_a_collective_gets_the_verdict_and_no_thread_is_left():
    def train(rank):
        if rank == 0:
            COND.acquire()
            dist.barrier()
        else:
            with COND:
                dist.barrier()

    assert "(inside a threading.Condition) in `with COND:`" in _hang(train)


def _module(tmp_path, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    sys.modules.pop(name, None)


def test_an_import_that_waits_on_a_thread_pool_completes_in_every_rank(tmp_path):
    _module(tmp_path, "pool_at_import", (
        "import concurrent.futures, time\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as ex:\n"
        "    VALUE = ex.submit(lambda: (time.sleep(0.1), 42)[1]).result()\n"
        "time.sleep(0.02)\n"))

    def train(rank):
        import pool_at_import  # every rank imports it, mid-run, as a script does
        dist.barrier()
        return pool_at_import.VALUE

    assert fakepg.spawn(train, nprocs=3, timeout=60).returns == [42, 42, 42]
    assert _ranks_alive() == []


def test_an_import_waiting_on_another_rank_is_a_verdict_naming_the_module_and_the_wait(tmp_path):
    _module(tmp_path, "event_at_import", "import threading\nREADY = threading.Event()\nREADY.wait()\n")

    def train(rank):
        import event_at_import  # rank 0 waits inside the import; nobody can set the event

    t0 = time.monotonic()
    report = _hang(train)
    assert time.monotonic() - t0 < 10
    assert "threading.Event.wait at " in report and "inside `import event_at_import`" in report
    assert "Import the module before the ranks start" in report


def test_a_collective_inside_an_import_another_rank_needs_is_a_verdict_naming_both(tmp_path):
    _module(tmp_path, "barrier_at_import", "import torch.distributed as dist\ndist.barrier()\n")

    def train(rank):
        import barrier_at_import  # noqa: F401

    report = _hang(train)
    assert "rank 1 is blocked importing module barrier_at_import, which rank 0 is importing" in report
    assert "barrier" in report


def test_spawn_timeout_fires_at_its_deadline_and_names_a_rank_blocked_in_c():
    a, b = socket.socketpair()

    def train(rank):
        if rank == 0:
            a.recv(1)  # blocked in C: no Python frame runs until something arrives
        dist.barrier()

    t0 = time.monotonic()
    with pytest.raises(fakepg.SpawnTimeoutError) as info:
        fakepg.spawn(train, nprocs=2, timeout=1.0)
    waited = time.monotonic() - t0
    assert waited < 1.0 + 1.5  # the deadline, plus a grace far below the old 10 s
    assert "ranks [0] could not be stopped" in str(info.value)
    assert "rank 0 at tests/test_wait_verdicts.py:" in str(info.value)
    assert fakepg.spawn(lambda r: r, nprocs=2).returns == [0, 1]  # the next world starts clean
    b.send(b"x")  # let the left-over thread reach its next wait, which raises: it ends
    deadline = time.monotonic() + 10
    while _ranks_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _ranks_alive() == []
    a.close()
    b.close()



def _blocked_in_c(how: str):
    """(a wait inside C that only ``release()`` ends, release)."""
    if how == "multiprocessing.Queue.get":
        import multiprocessing
        q = multiprocessing.get_context("spawn").Queue()
        return q.get, lambda: q.put(1)
    a, b = socket.socketpair()
    if how == "select.select":
        import select
        return (lambda: select.select([a], [], [])), lambda: b.send(b"x")
    import asyncio  # an event loop waiting for a socket to become readable
    a.setblocking(False)

    async def read():
        return await asyncio.get_running_loop().sock_recv(a, 1)

    return (lambda: asyncio.run(read())), lambda: b.send(b"x")


@pytest.mark.parametrize("how", ["select.select", "multiprocessing.Queue.get", "asyncio"])
def test_spawn_timeout_names_a_rank_inside_a_c_wait_and_the_next_world_starts_clean(how):
    wait, release = _blocked_in_c(how)

    def train(rank):
        if rank == 0:
            wait()  # no Python frame runs until something arrives
        dist.barrier()

    with pytest.raises(fakepg.SpawnTimeoutError) as info:
        fakepg.spawn(train, nprocs=2, timeout=0.5)
    assert "ranks [0] could not be stopped" in str(info.value)
    assert "rank 0 at tests/test_wait_verdicts.py:" in str(info.value)
    assert fakepg.spawn(lambda r: r, nprocs=2).returns == [0, 1]
    release()  # the left-over thread reaches its next wait, which raises: it ends
    deadline = time.monotonic() + 10
    while _ranks_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _ranks_alive() == []

def test_a_rank_process_waiting_on_its_own_thread_lets_the_other_ranks_run(tmp_path):
    """Process mode: rank 0 waits on an event its helper thread sets once rank 1 has written
    a file. Before, rank 0's process kept the baton through the wait, so rank 1 never ran."""
    flag = tmp_path / "rank1-was-here"

    def train(rank):
        if rank == 1:
            flag.write_text("1")
            return "wrote"
        seen = threading.Event()

        def watch():
            while not flag.exists():
                time.sleep(0.005)
            seen.set()

        threading.Thread(target=watch, daemon=True).start()
        return seen.wait(timeout=30)

    assert fakepg.spawn(train, nprocs=2, isolation="process", timeout=60).returns == [True, "wrote"]


@pytest.mark.parametrize("how", ["wait", "run"])
def test_a_rank_waiting_on_its_own_subprocess_lets_the_other_ranks_run(tmp_path, how):
    """Rank 0's child waits for a file rank 1 writes: before, rank 0 held the baton in
    waitpid/select and rank 1 never ran (the child gave up after its 20 s)."""
    import subprocess

    flag = tmp_path / "from-rank-1"
    child = [sys.executable, "-c", "import os, sys, time\nend = time.time() + 20\n"
             f"while not os.path.exists({str(flag)!r}):\n"
             "    if time.time() > end: sys.exit(1)\n    time.sleep(0.005)\nprint('seen')"]

    def train(rank):
        if rank == 1:
            flag.write_text("1")
            return None
        if how == "wait":
            return subprocess.Popen(child).wait()
        return subprocess.run(child, capture_output=True, text=True).stdout.strip()

    assert fakepg.spawn(train, nprocs=2, timeout=60).returns[0] == (0 if how == "wait" else "seen")
