"""Reading rank threads' CPU clocks never touches a thread that has ended (no SIGSEGV).

Before, the scheduler and the watchdog called ``pthread_getcpuclockid`` on the ident of every
rank slot's thread, ended or not: glibc then reads a freed thread descriptor, and once that
stack is unmapped the process dies with SIGSEGV (torch's test_c10d_gloo.py under
``pytest --fakepg-suites`` did, every 6-26 tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from fakepg.world.cpu_clocks import ThreadClocks


def test_clocks_of_thousands_of_ending_threads_are_read_safely_and_never_go_backwards():
    clocks = ThreadClocks()
    stop = threading.Event()
    samples: list[float] = []
    reads = [0, 0]  # (a value, None)

    def sampler() -> None:
        while not stop.is_set():
            samples.append(clocks.total())
            for rank in range(24):
                reads[clocks.read(rank) is None] += 1

    def rank(r: int, go: threading.Event) -> None:
        clocks.register(r)
        try:
            go.wait()
            sum(range(2000))  # some CPU, so that the total has something to keep
        finally:
            clocks.retire(r)

    watcher = threading.Thread(target=sampler)
    watcher.start()
    try:
        for _ in range(125):  # 3,000 threads, 24 at a time ending together (stacks unmapped)
            go = threading.Event()
            threads = [threading.Thread(target=rank, args=(r, go)) for r in range(24)]
            for t in threads:
                t.start()
            go.set()
            for t in threads:
                t.join()
    finally:
        stop.set()
        watcher.join()
    assert reads[0] > 0 and reads[1] > 0  # live threads were read, ended ones were not
    assert all(later >= earlier for earlier, later in zip(samples, samples[1:]))
    assert all(clocks.read(r) is None for r in range(24))  # all retired: nothing left to read
    assert clocks.retired > 0


def test_a_clock_is_unreadable_once_its_thread_retired():
    clocks = ThreadClocks()
    seen: list[float | None] = []

    def rank() -> None:
        clocks.register(0)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.01:
            pass
        seen.append(clocks.read(0))
        clocks.retire(0)
        seen.append(clocks.read(0))

    t = threading.Thread(target=rank)
    t.start()
    t.join()
    assert seen[0] is not None and seen[0] >= 0.01 and seen[1] is None
    assert clocks.retired >= 0.01


_WORLDS = textwrap.dedent("""
    import threading, time
    import fakepg

    def train(rank):
        if rank == 0:  # waits on a helper thread while the other ranks end: the scheduler
            done = threading.Event()  # samples the ranks' CPU clocks meanwhile
            threading.Thread(target=lambda: (time.sleep(0.004), done.set())).start()
            done.wait()
        return rank

    for _ in range(60):
        assert fakepg.spawn(train, nprocs=12).returns == list(range(12))
    print("ok")
""")


def test_worlds_whose_ranks_end_while_the_scheduler_samples_their_clocks_do_not_crash():
    # in a child process, so that a SIGSEGV fails this test instead of ending pytest
    proc = subprocess.run([sys.executable, "-c", _WORLDS], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().endswith("ok")


def test_a_thread_starved_of_a_core_counts_as_working_not_asleep():
    """The watchdog's inactivity fallback asks whether a rank is asleep; a runnable thread
    (state R) that gets no core on a loaded machine is not, nor is a process whose thread is."""
    clocks = ThreadClocks()
    stop = threading.Event()
    states = []

    def spinning() -> None:
        clocks.register(0)
        try:
            while not stop.is_set():
                pass
        finally:
            clocks.retire(0)

    def sleeping() -> None:
        clocks.register(1)
        try:
            stop.wait()
        finally:
            clocks.retire(1)

    threads = [threading.Thread(target=spinning), threading.Thread(target=sleeping)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        states = [clocks.asleep(0), clocks.asleep(1)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert states == [False, True]
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        clocks.register(2, pid=child.pid)  # process mode: the rank's work is another process
        assert clocks.asleep(2) is False
    finally:
        child.kill()
        child.wait()
        clocks.retire(2)
