"""Stores inside a fake world: one in-process store per world (and per TCPStore address or
FileStore path), whose blocking calls let the other ranks run, whose unsatisfiable waits are
hang verdicts naming the keys, and whose timeouts raise what torch's stores raise."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import fakepg
from fakepg.fidelity import store as _store

SHORT = datetime.timedelta(seconds=0.05)


def _hang(fn, nprocs=2):
    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(fn, nprocs=nprocs)
    return info.value.report


def test_default_store_get_and_wait_before_another_rank_sets_the_key():
    def body(rank):
        store = c10d._get_default_store()
        if rank == 0:
            store.wait(["ready"])
            return store.get("payload"), store.get("ready")
        store.set("payload", "hello")
        store.set("ready", b"1")
        return None

    assert fakepg.spawn(body, nprocs=2).returns[0] == (b"hello", b"1")


def test_a_store_get_nobody_can_satisfy_is_a_hang_naming_the_key_and_each_waiting_rank():
    def body(rank):
        store = c10d._get_default_store()
        if rank == 0:
            store.get("never-set")
        elif rank == 1:
            store.wait(["also-missing", "present"])
        else:
            store.set("present", "x")

    report = _hang(body, nprocs=3)
    assert "rank 0: blocked waiting on store get" in report and "never-set" in report
    assert "rank 1: blocked waiting on store wait" in report and "also-missing" in report
    assert "'present'" not in report.splitlines()[2]  # only the keys still missing
    assert "rank 2: finished (returned)" in report


def test_tcpstores_on_the_world_master_port_are_one_shared_store_and_still_tcpstores():
    def body(rank):
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              2, rank == 0, timeout=datetime.timedelta(seconds=30))
        if rank == 1:
            store.set("from-rank-1", "hi")
        return store.get("from-rank-1"), isinstance(store, dist.TCPStore), store.timeout

    returns = fakepg.spawn(body, nprocs=2).returns
    assert returns == [(b"hi", True, datetime.timedelta(seconds=30))] * 2
    assert dist.TCPStore is torch._C._distributed_c10d.TCPStore  # restored after the world


def test_filestores_on_one_path_are_shared_and_hashstores_stay_private_to_their_rank(tmp_path):
    def body(rank):
        shared = dist.FileStore(str(tmp_path / "store"), 2)
        private = dist.HashStore()
        if rank == 1:
            shared.set("k", "shared")
            private.set("k", "private")
            return None
        got = shared.get("k")
        private.get("k")  # rank 1's HashStore is another process's: never set here
        return got

    report = _hang(body)
    assert "rank 0: blocked waiting on store get on HashStore" in report
    assert "(private to its rank)" in report


def test_prefixstore_over_the_world_store_namespaces_keys():
    def body(rank):
        base = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0)
        mine = dist.PrefixStore(f"r{rank}", base)
        mine.set("k", str(rank))
        other = dist.PrefixStore(f"r{1 - rank}", base)
        return other.get("k"), base.get(f"r{1 - rank}/k")

    assert fakepg.spawn(body, nprocs=2).returns == [(b"1", b"1"), (b"0", b"0")]


def test_a_store_based_barrier_add_then_wait_releases_every_rank_once_all_arrived():
    def body(rank):
        store = c10d._get_default_store()
        if store.add("arrived", 1) == 3:
            store.set("go", "1")
        store.wait(["go"])
        return int(store.get("arrived"))

    assert fakepg.spawn(body, nprocs=3).returns == [3, 3, 3]

    def one_rank_skips(rank):
        store = c10d._get_default_store()
        if rank == 2:
            return
        if store.add("arrived", 1) == 3:
            store.set("go", "1")
        store.wait(["go"])

    report = _hang(one_rank_skips, nprocs=3)
    assert report.count("store wait") == 2 and "'0//go'" in report


def test_store_barrier_method_and_check_polling_without_sleep_make_progress():
    def body(rank):
        store = c10d._get_default_store()
        if rank == 0:
            while not store.check(["flag"]):  # a bare poll: each miss lets the others run
                pass
        else:
            store.set("flag", "1")
        store.barrier("b", 2)
        return True

    assert fakepg.spawn(body, nprocs=2).returns == [True, True]


def test_a_store_wait_past_its_timeout_while_another_rank_runs_raises_diststoreerror():
    def body(rank):
        store = c10d._get_default_store()
        if rank == 1:
            time.sleep(0.3)
            store.set("late", "1")
            return None
        try:
            store.wait(["late"], SHORT)
        except dist.DistStoreError as e:
            store.wait(["late"])  # the program handles it; the world goes on
            return str(e), isinstance(e, fakepg.StoreTimeoutError)
        return "no timeout"

    message, typed = fakepg.spawn(body, nprocs=2).returns[0]
    assert message.startswith("wait timeout after 50ms, keys: /0//late")
    assert "rank 1: sleeping in time.sleep(0.3)" in message
    assert typed


def test_a_timed_store_wait_nobody_can_satisfy_fails_at_once_as_a_store_timeout():
    caught = []

    def body(rank):
        if rank == 0:
            store = dist.HashStore()
            store.set_timeout(datetime.timedelta(hours=1))
            try:
                store.get("k")
            except dist.DistStoreError as e:  # what HashStore raises, without the hour's wait
                caught.append(e)

    # rank 0 handled the timeout and returned: the world succeeds, as torchrun's would
    result = fakepg.spawn(body, nprocs=2)
    assert "rank 0: blocked waiting on store get on HashStore" in result.hang_report
    (e,) = caught
    assert str(e).startswith("Wait timeout\nfakepg: hang detected")
    assert "fails at once because no rank can satisfy it" in str(e)


def test_nonblocking_store_operations_answer_as_torchs_tcpstore_does():
    def script(store):
        out = [store.compare_set("c", "", "v"), store.compare_set("c", "x", "w"),
               store.compare_set("c", "v", "w"), store.compare_set("n", "x", "y"),
               store.add("a", 2), store.add("a", -5), store.delete_key("a"), store.delete_key("a"),
               store.check(["c"]), store.check(["c", "a"]), store.has_extended_api()]
        store.append("ap", "x")
        store.append("ap", b"y")
        store.multi_set(["m1", "m2"], ["1", b"2"])
        store.queue_push("q", "1")
        out += [store.get("ap"), store.multi_get(["m2", "m1"]), store.queue_len("q"),
                store.queue_pop("q"), store.queue_len("q")]
        with pytest.raises(dist.QueueEmptyError):
            store.queue_pop("q", block=False)
        return out

    real = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    fake = fakepg.FakeStore(_store._Data("test"))
    assert script(fake) == script(real)


def test_outside_a_world_a_fake_store_wait_times_out_at_once():
    fake = fakepg.FakeStore(_store._Data("test"), "hash")
    with pytest.raises(dist.DistStoreError, match="^Wait timeout"):
        fake.get("missing")


def test_compare_set_and_add_zero_polling_loops_let_the_other_ranks_run():
    def body(rank):
        store = c10d._get_default_store()
        if rank == 0:
            while store.compare_set("lock", "free", "mine") != b"mine":
                pass
            while store.add("done", 0) == 0:
                pass
            return True
        store.set("lock", "free")
        store.add("done", 1)
        return True

    assert fakepg.spawn(body, nprocs=2).returns == [True, True]
