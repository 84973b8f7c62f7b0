"""A backend the program registers runs as registered inside a fake world.

``dist.Backend.register_backend(name, creator)`` then ``init_process_group(name)`` (or
``new_group(backend=name)``): torch's own c10d calls the program's creator with the world's
store, the group rank and size and the timeout, and the group is the creator's —
``get_backend()`` and ``pg.name()`` are its own, a backend that does not communicate leaves
the tensors alone, and one that forwards to a ``ProcessGroupGloo`` it builds gets gloo's
results with fakepg's matching, checks and trace. The backends are written here in torch's
Python-ProcessGroup pattern (test_c10d_pypg.py: a ``dist.ProcessGroup`` subclass whose
collectives return works made from futures, or forward to another group).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future

import fakepg

MODES = ["thread", "process"]


def _done(value: Any) -> Any:
    fut = torch.futures.Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


class CountedWork(dist._Work):
    """A Work written in Python (torch's MyWork): done at once, counting its waits."""

    def __init__(self, result, counts):
        super().__init__()
        self.future = torch.futures.Future()
        self.future.set_result(result)
        self.counts = counts

    def wait(self, timeout=None):
        self.counts["wait"] = self.counts.get("wait", 0) + 1
        return True

    def get_future(self):
        return self.future


class LonelyGroup(dist.ProcessGroup):
    """Communicates with nobody: every collective leaves the tensors as they are
    (torch's LonelyRankProcessGroup, at any world size), its works written in Python."""

    def __init__(self, rank, size):
        super().__init__(rank, size)
        self.counts: dict[str, int] = {}

    def allreduce(self, tensors, opts):
        return CountedWork(tensors, self.counts)

    def broadcast(self, tensors, opts):
        return CountedWork(tensors, self.counts)

    def allgather(self, outputs, inputs, opts):
        for o in outputs[0]:  # every rank looks like this one
            o.copy_(inputs[0])
        return CountedWork(outputs, self.counts)

    def getBackendName(self):  # noqa: N802 - c10d's trampoline name
        return "lonely"


class ForwardingGroup(dist.ProcessGroup):
    """Forwards DDP's three collectives to a real gloo group built on the store it is given
    (what fault-tolerance wrappers do)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)

    def allreduce(self, tensors, opts):
        return self.inner.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return self.inner.broadcast(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        return self.inner.allgather(outputs, inputs, opts)

    def getBackendName(self):  # noqa: N802
        return "forwarding"


CREATED: list[tuple] = []  # what each creator was called with (thread mode: the same process)


def _lonely(store, rank, size, timeout):
    CREATED.append(("lonely", type(store).__name__, rank, size, timeout))
    return LonelyGroup(rank, size)


def _forwarding(store, rank, size, timeout):
    CREATED.append(("forwarding", type(store).__name__, rank, size, timeout))
    return ForwardingGroup(store, rank, size, timeout)


def _extended(opts, pg_options):
    pg = ForwardingGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    pg.created_with = ("extended", opts.group_rank, opts.group_size, opts.timeout,
                       list(opts.global_ranks_in_group), pg_options)
    return pg


for _name, _creator, _extended_api in (("lonely", _lonely, False),
                                       ("forwarding", _forwarding, False),
                                       ("extended", _extended, True)):
    if not hasattr(dist.Backend, _name.upper()):  # once per process (registration is global)
        dist.Backend.register_backend(_name, _creator, extended_api=_extended_api,
                                      devices=["cpu"])


@pytest.fixture(autouse=True)
def _fresh_record():
    CREATED.clear()


@pytest.mark.parametrize("isolation", MODES)
def test_init_process_group_calls_the_programs_creator_and_the_group_is_its_own(isolation):
    def body(rank):
        dist.init_process_group("lonely", timeout=datetime.timedelta(seconds=42))
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t)  # the lonely backend communicates with nobody
        pg = c10d._get_default_group()
        return dist.get_backend(), pg.name(), type(pg).__name__, t.tolist(), list(CREATED)

    returns = fakepg.spawn(body, nprocs=3, isolation=isolation).returns
    assert [r[:4] for r in returns] == [("lonely", "lonely", "LonelyGroup", [r + 1.0] * 2)
                                        for r in range(3)]
    # the creator ran on each rank with the world's store (prefixed by c10d), its rank, the
    # size and the program's timeout, as torch passes them
    timeout = datetime.timedelta(seconds=42)
    assert returns[2][4][-1] == ("lonely", "PrefixStore", 2, 3, timeout)
    if isolation == "thread":  # the rank threads share this module's record
        assert sorted(CREATED) == [("lonely", "PrefixStore", r, 3, timeout) for r in range(3)]


@pytest.mark.parametrize("isolation", MODES)
def test_a_backend_forwarding_to_gloo_gets_gloos_results_and_fakepgs_trace(isolation):
    def body(rank):
        dist.init_process_group("forwarding")
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t)
        return dist.get_backend(), t.tolist()

    result = fakepg.spawn(body, nprocs=3, isolation=isolation)
    assert result.returns == [("forwarding", [6.0, 6.0])] * 3
    record = result.trace[1][0]
    assert (record.op, record.group_ranks, record.shapes) == ("all_reduce", (0, 1, 2), ((2,),))
    forwards = ForwardingGroup.allreduce.__code__.co_firstlineno + 1  # its `return self.inner...`
    assert record.site.endswith(f"test_registered_backends.py:{forwards}")


@pytest.mark.parametrize("isolation", MODES)
def test_a_mismatch_through_a_forwarding_backend_is_reported_as_fakepgs(isolation):
    def body(rank):
        dist.init_process_group("forwarding")
        dist.all_reduce(torch.ones(2 + rank))

    with pytest.raises(fakepg.CollectiveMismatchError, match=r"rank 1: all_reduce\(shapes=\[\(3,\)\]"):
        fakepg.spawn(body, nprocs=2, isolation=isolation)


def test_ddp_on_a_backend_that_does_not_communicate_leaves_the_replicas_apart():
    def train(rank):
        dist.init_process_group("lonely")
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        torch.manual_seed(rank)
        model(torch.randn(8, 4)).sum().backward()
        return model.module.weight.grad.clone(), c10d._get_default_group().counts["wait"]

    (g0, waits0), (g1, waits1) = fakepg.spawn(train, nprocs=2).returns
    assert not torch.equal(g0, g1)  # on fakepg's own group DDP would have averaged them
    assert waits0 > 0 and waits1 > 0  # the Reducer waited on the backend's own works


def test_ddp_on_a_forwarding_backend_trains_as_on_the_fake_worlds_own_group():
    def train(rank, backend):
        if backend is not None:
            dist.init_process_group(backend)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(10 * step + rank)
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], dist.get_backend()

    own = fakepg.spawn(train, args=(None,), nprocs=2, backend="gloo").returns
    forwarded = fakepg.spawn(train, args=("forwarding",), nprocs=2).returns
    for (ps, _), (qs, backend) in zip(own, forwarded):
        assert backend == "forwarding"
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))


@pytest.mark.parametrize("isolation", MODES)
def test_new_group_of_a_registered_backend_gets_the_subgroups_rank_size_and_members(isolation):
    def body(rank):
        sub = dist.new_group([1, 2], backend="extended", pg_options={"mine": 1})
        if rank == 0:
            return None
        t = torch.ones(1) * rank
        dist.all_reduce(t, group=sub)
        return t.item(), sub.name(), sub.created_with

    returns = fakepg.spawn(body, nprocs=3, isolation=isolation).returns
    assert returns[0] is None
    timeout = datetime.timedelta(minutes=30)  # c10d's default, as torch passes it
    assert returns[1] == (3.0, "forwarding", ("extended", 0, 2, timeout, [1, 2], {"mine": 1}))
    assert returns[2] == (3.0, "forwarding", ("extended", 1, 2, timeout, [1, 2], {"mine": 1}))


def test_a_directly_built_gloo_group_must_span_the_world_and_says_what_to_do():
    def body(rank):
        dist.ProcessGroupGloo(dist.HashStore(), 0, 2, datetime.timedelta(seconds=5))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=3)
    message = str(info.value.__cause__)
    assert "ProcessGroupGloo(store, rank=0, size=2)" in message
    assert "dist.new_group(ranks)" in message
