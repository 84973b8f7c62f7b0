"""Per-rank isolation: each rank behaves like a separate process."""

import os
import random

import numpy as np
import torch
import torch.distributed as dist

import fakepg


def _draws(rank):
    torch.manual_seed(42 + rank)
    a = torch.rand(4)
    dist.barrier()  # a hand-off between ranks in the middle of the stream
    b = torch.rand(4)
    return torch.cat([a, b])


def test_manual_seed_in_one_rank_seeds_only_that_rank_as_in_separate_processes():
    out = fakepg.spawn(_draws, nprocs=4).returns
    for rank, drawn in enumerate(out):
        torch.manual_seed(42 + rank)  # what a separate process would draw
        expected = torch.rand(8)
        assert torch.equal(drawn, expected)


def test_unseeded_ranks_draw_the_same_numbers_every_run_with_the_same_seed():
    def body(rank):
        return torch.rand(5), random.random(), np.random.rand()

    a = fakepg.spawn(body, nprocs=3, seed=11).returns
    b = fakepg.spawn(body, nprocs=3, seed=11).returns
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and x[1] == y[1] and x[2] == y[2]


def test_unseeded_ranks_draw_different_numbers_from_each_other_and_across_seeds():
    body = lambda rank: torch.rand(5)  # noqa: E731
    a = fakepg.spawn(body, nprocs=3, seed=11).returns
    c = fakepg.spawn(body, nprocs=3, seed=12).returns
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])
    assert not torch.equal(a[0], c[0])


def test_each_rank_sees_its_own_launcher_environment():
    def body(rank):
        dist.barrier()
        return {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                           "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}

    out = fakepg.spawn(body, nprocs=3).returns
    for rank, env in enumerate(out):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] and env["MASTER_PORT"]


def test_a_rank_that_changes_its_environment_changes_only_its_own_view():
    def body(rank):
        if rank == 0:
            os.environ["MASTER_PORT"] = "12355"
        dist.barrier()
        return os.environ["MASTER_PORT"]

    assert fakepg.spawn(body, nprocs=2).returns == ["12355", "29500"]


def test_each_rank_has_its_own_default_group_and_group_registry():
    def body(rank):
        dist.new_group([0])  # every rank calls new_group; only members get a group
        dist.new_group([1])
        dist.barrier()
        return dist.get_rank(), len(dist.distributed_c10d._world.pg_map), id(dist.group.WORLD)

    out = fakepg.spawn(body, nprocs=2).returns
    assert [o[0] for o in out] == [0, 1]
    assert out[0][1] == 2 and out[1][1] == 2  # WORLD + the one group each rank is a member of
    assert out[0][2] != out[1][2]  # separate default group objects
