"""simddp.core: communicators, shared links and collectives as simpy processes."""

import simpy
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import simddp
from simddp import Network, Timing
from simddp.core import Channel, Fabric, at


def _arrive_at(fab, coll, t):
    """A member (a simpy process) that issues ``coll`` at virtual time ``t``."""
    def member():
        yield fab.at(t)
        coll.arrive()
    fab.env.process(member())


def test_a_communicator_serialises_collectives_and_starts_each_at_max_of_arrivals_and_previous_end():
    fab = Fabric()
    arrivals = [(0.0, 1.0, 0.5), (0.2, 0.3, 0.1), (9.0, 2.0, 8.0)]  # per collective, 3 members
    durations = [2.0, 0.5, 1.0]
    colls = []
    for times, dur in zip(arrivals, durations):
        c = fab.collective("world", members=3, duration=dur)
        colls.append(c)
        for t in times:
            _arrive_at(fab, c, t)
    fab.run()
    prev_end = 0.0
    for c, times, dur in zip(colls, arrivals, durations):
        assert c.start == max(max(times), prev_end)
        assert c.end == c.start + dur
        prev_end = c.end
    # the second collective's members all arrived at 0.3, but it waited for the first (ends 3.0)
    assert colls[1].start == 3.0 and colls[2].start == 9.0


def test_two_communicators_without_shared_links_run_concurrently():
    fab = Fabric()
    a = fab.collective("A", members=1, duration=1.0)
    b = fab.collective("B", members=1, duration=1.0)
    a.arrive(0.0)
    b.arrive(0.0)
    fab.run()
    assert (a.start, a.end) == (0.0, 1.0) and (b.start, b.end) == (0.0, 1.0)


def test_a_shared_link_makes_two_groups_collectives_slower_than_when_alone():
    def run(pair: bool, shared: bool) -> list:
        fab = Fabric()
        links = ["nic0"] if shared else []
        colls = [fab.collective(g, members=2, duration=1.0, links=links)
                 for g in (["A", "B"] if pair else ["A"])]
        for c in colls:
            _arrive_at(fab, c, 0.5)
            _arrive_at(fab, c, 0.5)
        fab.run()
        return colls

    alone = run(pair=False, shared=True)[0]
    together = run(pair=True, shared=True)
    assert (alone.start, alone.end) == (0.5, 1.5)
    assert max(c.end for c in together) == 2.5  # serialised on the NIC
    assert sorted((c.start, c.end) for c in together) == [(0.5, 1.5), (1.5, 2.5)]
    assert max(c.end for c in run(pair=True, shared=False)) == 1.5  # no link: concurrent


def test_links_are_taken_in_one_global_order_so_crossing_collectives_cannot_deadlock():
    fab = Fabric()
    fab.link("L1"), fab.link("L2")
    x = fab.collective("X", members=1, duration=1.0, links=["L1", "L2"])
    y = fab.collective("Y", members=1, duration=1.0, links=["L2", "L1"])
    x.arrive(0.0)
    y.arrive(0.0)
    fab.run()
    assert x.end is not None and y.end is not None
    assert sorted([x.end, y.end]) == [1.0, 2.0]


def test_a_collective_does_not_start_before_every_member_arrived():
    fab = Fabric()
    c = fab.collective("world", members=3, duration=1.0)
    c.arrive(0.0)
    c.arrive(1.0)
    fab.run()
    assert c.start is None and c.end is None and not c.done.triggered


def test_at_schedules_at_the_exact_absolute_time():
    env = simpy.Environment()

    def proc():
        yield env.timeout(0.1)
        yield at(env, 0.3)
        assert env.now == 0.3  # env.timeout(0.3 - 0.1) would land on 0.30000000000000004

    env.run(env.process(proc()))
    assert env.now == 0.3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=4),
                          st.floats(0, 10, allow_nan=False)), min_size=1, max_size=12))
def test_a_channel_reproduces_the_closed_form_exactly(calls):
    # co-simulation's channel: issue times known up front, non-decreasing latest issue not
    # required; start = max(latest issue, previous end), end = start + duration, bit for bit
    ch = Channel()
    prev = None
    for issues, dur in calls:
        start, end = ch.submit(issues, dur)
        expect = max(issues) if prev is None else max(max(issues), prev)
        assert start == expect and end == expect + dur
        prev = end


def _two_groups(rank):
    odd = dist.new_group([1, 3])
    even = dist.new_group([0, 2])
    mine = odd if rank % 2 else even
    model = DDP(torch.nn.Linear(16, 16), process_group=mine)
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
        t = torch.ones(1000)
        dist.all_reduce(t)
        dist.all_reduce(t, group=mine)


def test_cosimulation_times_every_collective_through_an_engine_channel(monkeypatch):
    calls = []
    original = Channel.submit

    def counting(self, issues, duration):
        out = original(self, issues, duration)
        calls.append((id(self), tuple(issues), duration, out))
        return out

    monkeypatch.setattr(Channel, "submit", counting)
    res = simddp.simulate(_two_groups, (), 4, timing=Timing(network=Network.preset("100gbe"),
                                                           rank_speed={1: 0.5}), seed=0)
    matched = {(r.group, r.seq) for rs in res.trace for r in rs}
    assert len(calls) == len(matched)
    assert len({c[0] for c in calls}) >= 3  # the world and two subgroups: a channel each
    for rs in res.trace:
        for r in rs:
            assert r.issue <= r.start <= r.end
    # per channel, in submission order: start = max(latest issue, previous end)
    last_end: dict = {}
    for ch, issues, dur, (start, end) in calls:
        assert start == max(max(issues), last_end.get(ch, float("-inf")))
        assert end == start + dur
        last_end[ch] = end
