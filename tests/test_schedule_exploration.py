"""Controlled choices and exploration: races a real multi-process run can lose are found,
shrunk to the fewest deviations from the default schedule, and replayed from one token."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
from fakepg.choices.schedule import Schedule, decode, encode

pytest_plugins = ["pytester"]


def store_counter(rank):
    """Read-modify-write of a store counter without store.add: loses updates in some orders."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("n", "0")
    dist.barrier()
    v = int(store.get("n"))
    store.set("n", str(v + 1))
    dist.barrier()
    if int(store.get("n")) != dist.get_world_size():
        raise AssertionError(f"lost update: n={store.get('n')}")


def any_source(rank):
    """Assumes the first message from any source comes from rank 1."""
    if rank == 0:
        dist.barrier()  # both sends are pending when the receive is matched
        t = torch.zeros(1)
        if dist.recv(t) != 1:
            raise AssertionError("rank 2's message came first")
        dist.recv(t)
    else:
        work = dist.isend(torch.ones(1) * rank, 0)
        dist.barrier()
        work.wait()


def completion_assumed(rank):
    """Assumes a finished collective is visible as completed without waiting on it."""
    work = dist.all_reduce(torch.ones(2), async_op=True)
    dist.barrier()
    if not work.is_completed():
        raise AssertionError("polled before the result was visible")
    work.wait()


PROGRAMS = [(store_counter, 2, "preempt"), (any_source, 3, "any_source"),
            (completion_assumed, 2, "completed")]


@pytest.mark.parametrize("program, nprocs, kind", PROGRAMS)
def test_each_kind_of_choice_alone_can_expose_its_race(program, nprocs, kind):
    fakepg.spawn(program, nprocs=nprocs)  # the default schedule passes

    def deviating_at(k):  # option 1 at the k-th point of this kind, defaults elsewhere
        seen = []

        def chooser(point_kind, n):
            if point_kind != kind:
                return 0
            seen.append(point_kind)
            return 1 if len(seen) == k + 1 else 0
        return Schedule(chooser=chooser)

    failures = 0
    for k in range(10):
        try:
            fakepg.spawn(program, nprocs=nprocs, schedule=deviating_at(k))
        except fakepg.RankFailedError:
            failures += 1
    assert failures >= 1


@pytest.mark.parametrize("program, nprocs, kind", PROGRAMS)
def test_explore_finds_each_race_and_shrinks_it_to_one_deviation(program, nprocs, kind):
    with pytest.raises(fakepg.ExplorationError) as info:
        fakepg.explore(program, nprocs=nprocs, runs=100)
    err = info.value
    assert len(err.deviations) == 1  # run order can expose some races too
    assert isinstance(err.__cause__, fakepg.RankFailedError)
    assert str(err).splitlines()[-1].startswith(
        f"replay: fakepg.spawn({program.__name__}, nprocs={nprocs}, seed=0, schedule='fp2:")
    assert f"--fakepg-schedule {err.schedule}" in str(err)


def test_a_token_replays_the_failure_bitwise_twice():
    with pytest.raises(fakepg.ExplorationError) as info:
        fakepg.explore(store_counter, nprocs=2, runs=100)
    outcomes = []
    for _ in range(2):
        with pytest.raises(fakepg.RankFailedError) as failed:
            fakepg.spawn(store_counter, nprocs=2, schedule=info.value.schedule)
        outcomes.append(str(failed.value))
    assert outcomes[0] == outcomes[1] == str(info.value.__cause__)


def test_the_same_call_finds_the_same_token():
    tokens = []
    for _ in range(2):
        with pytest.raises(fakepg.ExplorationError) as info:
            fakepg.explore(store_counter, nprocs=2, runs=100, seed=3)
        tokens.append(info.value.schedule)
    assert tokens[0] == tokens[1]


def test_an_empty_schedule_is_the_default_run_with_the_same_trace():
    def body(rank):
        t = torch.ones(3) * rank
        dist.all_reduce(t)
        return t

    plain = fakepg.spawn(body, nprocs=3)
    replayed = fakepg.spawn(body, nprocs=3, schedule=Schedule([0, 0, 0]))
    assert [t.tolist() for t in plain.returns] == [t.tolist() for t in replayed.returns]
    assert plain.to_json() == replayed.to_json()


def test_tokens_round_trip_and_a_bad_token_says_what_a_token_is():
    assert decode(encode([2, 3, 0, 200, 1])) == [2, 3, 0, 200, 1]
    with pytest.raises(ValueError, match="not a fakepg schedule token.*fakepg.explore prints them"):
        fakepg.spawn(lambda rank: None, nprocs=2, schedule="abc")


def _correct_ddp(rank):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), bucket_cap_mb=0.0001)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.ones(2, 4) * (i + rank) for i in range(2 + rank)]  # uneven inputs
    with Join([model]):
        for x in batches:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_correct_ddp_program_explored_for_200_schedules_reports_no_failure():
    def replicas_agree(result):
        first = result.returns[0]
        assert all(all(torch.equal(a, b) for a, b in zip(first, r)) for r in result.returns)

    summary = fakepg.explore(_correct_ddp, nprocs=3, runs=200, check=replicas_agree)
    assert summary.runs == 200 and summary.choice_points.get("run", 0) > 0


def test_explore_is_a_method_of_the_fake_cluster_fixture_and_the_option_replays(pytester):
    pytester.makepyfile(test_race=f'''
import torch.distributed as dist
import pytest

{__import__("inspect").getsource(store_counter)}

def test_store(fake_cluster):
    fake_cluster.explore(store_counter, runs=50)

def test_replay(fake_cluster):
    fake_cluster.run(store_counter)
''')
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "test_store")
    result.assert_outcomes(failed=1)
    line = next(x for x in result.stdout.lines if x.startswith("replay: python -m pytest"))
    token = line.split("--fakepg-schedule ")[1].strip()
    pytester.runpytest("-p", "no:cacheprovider", "-k", "test_replay").assert_outcomes(passed=1)
    replay = pytester.runpytest("-p", "no:cacheprovider", "-k", "test_replay",
                                "--fakepg-schedule", token)
    replay.assert_outcomes(failed=1)
    replay.stdout.fnmatch_lines(["*lost update*"])


def callback_order_assumed(rank):
    """Assumes two async works' callbacks run in issue order."""
    order = []
    a = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(lambda f: order.append("a"))
    b = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(lambda f: order.append("b"))
    dist.barrier()
    b.wait()
    a.wait()
    if order != ["a", "b"]:
        raise AssertionError(f"callbacks ran in order {order}")


def test_the_callback_order_of_different_works_is_a_choice_explore_finds():
    fakepg.spawn(callback_order_assumed, nprocs=2)
    with pytest.raises(fakepg.ExplorationError) as info:
        fakepg.explore(callback_order_assumed, nprocs=2, runs=100)
    assert [k for _, k, _ in info.value.deviations] == ["callback_order"]
