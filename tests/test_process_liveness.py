"""Liveness (mostly in process mode): the inactivity fallback (a baton holder with collectives in flight
that does nothing for ``hang_timeout``) must not take a rank process that is slow to be
scheduled, stopped, served by its proxy, or waiting on a working child (either mode) for one
blocked in C++.
Each condition is made deterministically (a stopped process, a child that computes, a proxy
that reduces a large tensor while its process sleeps waiting for the reply); the world must end
normally. On a loaded machine these are the states a rank process passes through for long
stretches; ci/bench_stress.py runs them under load."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import fakepg


def test_a_rank_process_stopped_by_sigstop_with_a_collective_in_flight_is_not_a_hang():
    """A stopped process (state T) is not blocked: it runs again when continued, as one that
    waits for a core does."""
    def body(rank):
        work = dist.all_reduce(torch.ones(2), async_op=True)
        if rank == 0:  # stopped for three hang timeouts; a process of its own continues it
            waker = subprocess.Popen(["sh", "-c", f"sleep 0.6; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            waker.wait()
        work.wait()
        return "ok"

    assert fakepg.spawn(body, nprocs=2, isolation="process", hang_timeout=0.2).returns == ["ok", "ok"]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_rank_in_waitpid_on_a_child_that_computes_is_not_a_hang(isolation):
    """``os.system`` waits in C (fakepg cannot make it cooperative); the rank's thread or
    process sleeps there while its child burns CPU: the rank works."""
    child = textwrap.dedent("""
        import time
        while time.process_time() < 0.6:
            pass
    """)

    def body(rank):
        work = dist.all_reduce(torch.ones(2), async_op=True)
        status = os.system(f"{sys.executable} -c '{child}'") if rank == 0 else 0
        work.wait()
        return status

    assert fakepg.spawn(body, nprocs=2, isolation=isolation, hang_timeout=0.2).returns == [0, 0]


def test_a_rank_process_whose_proxy_serves_a_long_request_is_not_a_hang():
    """Rank 1 arrives last at a large all_reduce: its proxy, in the parent, reduces while the
    rank's process sleeps waiting for the reply, with an isend of its own in flight. The
    process neither runs nor uses CPU, yet its rank works (before: a hang verdict here, and
    under load for any request whose proxy waited for a core or the GIL)."""
    def body(rank):
        big = torch.ones(20_000_000)
        for _ in range(4):  # each a chance for the fallback's 50 ms polls to look
            if rank == 1:
                sent = dist.isend(torch.ones(2), 0)
            dist.all_reduce(big)
            if rank == 0:
                dist.recv(torch.empty(2), 1)
            else:
                sent.wait()
        return float(big[0])

    assert fakepg.spawn(body, nprocs=2, isolation="process", hang_timeout=0.01).returns == [16.0, 16.0]


@pytest.mark.parametrize("how", ["wait", "run"])
def test_a_rank_process_waiting_on_its_own_subprocess_lets_the_other_ranks_run(tmp_path, how):
    """As on a rank thread (test_wait_verdicts): Popen.wait/communicate poll the child and let
    the other ranks run between looks. Before, rank 0's process held the baton in waitpid, so
    rank 1 never wrote the file its child waits for (and, with a collective in flight, the
    world was judged hung after hang_timeout)."""
    flag = tmp_path / "from-rank-1"
    child = [sys.executable, "-c", "import os, sys, time\nend = time.time() + 20\n"
             f"while not os.path.exists({str(flag)!r}):\n"
             "    if time.time() > end: sys.exit(1)\n    time.sleep(0.005)\nprint('seen')"]

    def train(rank):
        work = dist.all_reduce(torch.ones(2), async_op=True)
        if rank == 1:
            flag.write_text("1")
            work.wait()
            return None
        out = (subprocess.Popen(child).wait() if how == "wait" else
               subprocess.run(child, capture_output=True, text=True).stdout.strip())
        work.wait()
        return out

    returns = fakepg.spawn(train, nprocs=2, isolation="process", timeout=60).returns
    assert returns[0] == (0 if how == "wait" else "seen")


def test_a_wait_hidden_in_cpp_in_a_rank_process_is_still_caught_by_the_inactivity_fallback():
    """The other side: a rank process blocked in a C++ wait (asleep, no request on its pipe,
    its proxy listening) is judged hung, as in thread mode."""
    def body(rank):
        work = dist.all_reduce(torch.ones(1), async_op=True)
        torch._C._collect_all([work.get_future()]).wait()  # C++ wait: invisible to fakepg

    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(body, nprocs=2, isolation="process", hang_timeout=0.3, timeout=60)
    assert "inactivity fallback" in info.value.report and "rank 0" in info.value.report


def test_a_helper_thread_that_is_runnable_counts_as_activity_even_without_cpu_since_last_look():
    """A rank's Python wait (or a lock) may be released by a thread the ranks started; on a
    loaded machine that thread can be runnable (R) for a long time without a core, so the
    inactivity window asks the kernel too: a thread other than the ranks' that is runnable is
    activity, one asleep is not."""
    import hashlib
    import threading
    import time

    from fakepg.world.cpu_clocks import ThreadClocks

    clocks = ThreadClocks()
    stop = threading.Event()
    data = b"x" * 50_000_000

    def hashing() -> None:  # hashlib releases the GIL: runnable in C, no GIL needed
        while not stop.is_set():
            hashlib.sha256(data).digest()

    helper = threading.Thread(target=hashing)
    helper.start()
    try:
        seen = [clocks.others_runnable() for _ in range(20)]
    finally:
        stop.set()
        helper.join()
    assert any(seen)
    idle = threading.Event()
    sleeper = threading.Thread(target=idle.wait)
    sleeper.start()
    time.sleep(0.1)  # past its start, into its wait
    try:
        quiet = [clocks.others_runnable() for _ in range(5)]
    finally:
        idle.set()
        sleeper.join()
    assert not all(quiet)  # the asleep thread is not activity (an odd torch worker may spin)


def _fifos(tmp_path, *names):
    for name in names:
        os.mkfifo(tmp_path / name)
    return [str(tmp_path / name) for name in names]


def test_a_rank_process_in_a_native_wait_on_another_rank_lets_that_rank_run(tmp_path):
    """Opening a FIFO blocks in the kernel until its other end is opened: each rank's process
    waits there, asleep, for the other -- as torchft's should_commit waits in Rust for every
    rank to call it. Under torchrun both processes run at once; here the waiting rank's proxy
    lends the baton until its process calls in (before: rank 1 never started, and the world
    ran to its timeout)."""
    ping, pong = _fifos(tmp_path, "ping", "pong")

    def train(rank):
        got = []
        for step in range(2):
            if rank == 0:
                with open(ping, "w") as f:
                    f.write(f"ping {step}")
                with open(pong) as f:
                    got.append(f.read())
            else:
                with open(ping) as f:
                    got.append(f.read())
                with open(pong, "w") as f:
                    f.write(f"pong {step}")
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            got.append(t.item())
        return got

    returns = fakepg.spawn(train, nprocs=2, isolation="process", timeout=60).returns
    assert returns == [["pong 0", 3.0, "pong 1", 3.0], ["ping 0", 3.0, "ping 1", 3.0]]


def test_a_native_wait_nobody_answers_ends_at_the_deadline_and_the_report_names_it(tmp_path):
    """A rank process asleep in native code is never judged hung (something outside fakepg may
    answer it, as under torchrun); the world's deadline ends it, and the report says where."""
    (never,) = _fifos(tmp_path, "never")

    def train(rank):
        if rank == 0:
            open(never).close()  # nobody ever opens it for writing
        dist.barrier()

    with pytest.raises(fakepg.SpawnTimeoutError) as info:
        fakepg.spawn(train, nprocs=2, isolation="process", timeout=1.5)
    report = str(info.value)
    assert "rank 0: sleeping in a wait inside native code in its process" in report
    assert "rank 1: blocked waiting on barrier" in report
