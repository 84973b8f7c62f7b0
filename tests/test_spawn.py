"""fakepg.spawn: the world, its inputs, and what it leaves behind."""

import os
import threading

import pytest
import torch
import torch.distributed as dist

import fakepg


def test_spawn_returns_each_ranks_value_in_rank_order():
    result = fakepg.spawn(lambda rank, k: rank * k, args=(10,), nprocs=4)
    assert result.returns == [0, 10, 20, 30]


def test_torch_distributed_is_initialised_on_the_fake_backend_in_every_rank():
    def body(rank):
        return dist.is_initialized(), dist.get_rank(), dist.get_world_size(), dist.get_backend()

    assert fakepg.spawn(body, nprocs=3).returns == [(True, r, 3, "fakepg") for r in range(3)]


@pytest.mark.parametrize("backend", ["nccl", "gloo", None])
def test_init_process_group_by_unmodified_code_yields_the_same_fake_world(backend):
    def body(rank):
        dist.init_process_group(backend, init_method="env://")
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    assert fakepg.spawn(body, nprocs=3).returns == [6.0, 6.0, 6.0]


def test_destroy_then_init_again_gives_a_working_world():
    def body(rank):
        dist.destroy_process_group()
        assert not dist.is_initialized()
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    assert fakepg.spawn(body, nprocs=2).returns == [2.0, 2.0]


def test_world_size_in_init_process_group_that_differs_from_nprocs_is_a_clear_error():
    def body(rank):
        dist.init_process_group("gloo", world_size=8, rank=rank)

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=4)
    assert "world_size=8" in str(info.value.__cause__)
    assert "nprocs=4" in str(info.value.__cause__)
    assert "test_spawn.py" in str(info.value.__cause__)


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, "4", True])
def test_nprocs_must_be_a_positive_integer(nprocs):
    with pytest.raises(ValueError, match="nprocs must be an integer >= 1"):
        fakepg.spawn(lambda rank: None, nprocs=nprocs)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        fakepg.spawn("train", nprocs=2)


def test_collective_on_a_destroyed_group_is_a_clear_error():
    def body(rank):
        g = dist.new_group([0, 1])
        dist.destroy_process_group(g)
        dist.all_reduce(torch.ones(1), group=g)

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2)
    assert info.value.rank == 0
    assert "not initialized" in str(info.value.__cause__)  # torch's own check comes first
    assert "test_spawn.py:74" in str(info.value)


def test_direct_call_on_a_destroyed_fake_group_names_rank_op_and_line():
    def body(rank):
        g = dist.new_group([0, 1])
        dist.destroy_process_group(g)
        g.allreduce([torch.ones(1)])

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2)
    msg = str(info.value.__cause__)
    assert "rank 0: all_reduce" in msg and "destroyed" in msg and "test_spawn.py:87" in msg


def test_new_group_subgroups_reduce_only_among_members():
    def body(rank):
        evens = dist.new_group([0, 2])
        odds = dist.new_group([1, 3])
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens if rank % 2 == 0 else odds)
        return t.item()

    assert fakepg.spawn(body, nprocs=4).returns == [2.0, 4.0, 2.0, 4.0]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_new_group_naming_a_real_backend_is_a_group_of_the_fake_world(backend):
    # Found by torch's own suite (test_batch_isend_irecv_mixed_backend_err): a real
    # ProcessGroupGloo built inside a world rendezvoused in C++ and hung in half the runs.
    def body(rank):
        g = dist.new_group(ranks=[0, 1], backend=backend)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        return isinstance(g, fakepg.FakeProcessGroup), t.item()

    for _ in range(5):
        assert fakepg.spawn(body, nprocs=2, timeout=60).returns == [(True, 3.0), (True, 3.0)]


def test_no_thread_survives_hundreds_of_spawns_including_failing_ones():
    before = threading.active_count()

    def ok(rank):
        t = torch.ones(2)
        dist.all_reduce(t)

    def fails(rank):
        if rank == 1:
            raise KeyError("x")
        dist.all_reduce(torch.ones(2))

    def hangs(rank):
        if rank == 0:
            dist.all_reduce(torch.ones(2))

    for i in range(300):
        body = (ok, fails, hangs)[i % 3]
        try:
            fakepg.spawn(body, nprocs=3)
        except fakepg.FakePGError:
            pass
    assert threading.active_count() == before


def test_worlds_run_one_after_another_without_leaking_state():
    def body(rank):
        return dist.get_world_size(), len(dist.distributed_c10d._world.pg_map)

    assert fakepg.spawn(body, nprocs=2).returns == [(2, 1)] * 2
    assert fakepg.spawn(body, nprocs=5).returns == [(5, 1)] * 5
    assert not dist.is_initialized()


def test_host_environment_and_rng_are_restored_after_the_world():
    os.environ.pop("RANK", None)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fakepg.spawn(lambda rank: torch.rand(100), nprocs=3)
    assert "RANK" not in os.environ
    assert torch.equal(torch.rand(3), expected)


def test_nested_spawn_is_refused():
    def body(rank):
        fakepg.spawn(lambda r: None, nprocs=2)

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=1)
    assert "nested" in str(info.value.__cause__)


def test_fakepg_backend_outside_a_world_says_how_to_use_it():
    with pytest.raises(Exception, match="fakepg.spawn"):
        dist.init_process_group("fakepg", rank=0, world_size=1, store=dist.HashStore())
    if dist.is_initialized():
        dist.destroy_process_group()


def _child(rank):  # runs in a real process started by torch.multiprocessing
    pass


def test_torch_multiprocessing_in_a_rank_thread_warns_that_it_starts_real_processes():
    import torch.multiprocessing as mp

    def body(rank):
        mp.spawn(_child, nprocs=1)  # real processes: nothing of the fake world reaches them

    with pytest.warns(fakepg.RealProcessesWarning, match=r"rank 0: torch.multiprocessing starts 1 "
                      r"real process\(es\) at .*test_spawn.py:\d+; .*isolation=\"process\""):
        fakepg.spawn(body, nprocs=1)
