"""simddp's contracts between its parts: the models both engines accept (NetworkModel), the
result shape both engines return, the co-simulation's observer hook, capture's scenario."""

import dataclasses
import sys

import pytest
import simpy
import torch
import torch.nn as nn
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import models
import simddp
from simddp import Compute, Network, NetworkModel, Timing
from simddp.core import at
from simddp.models import collective_time
from simddp.replay import replay
from simddp import capture


class FlatLink:
    """A network model that is not a simddp.Network: every collective costs a fixed latency
    plus its bytes over one link."""

    name = "flat-link"
    gpus_per_node = None

    def __init__(self, bandwidth_Bps: float = 1e9, latency_s: float = 1e-5) -> None:
        self.bandwidth_Bps, self.latency_s = bandwidth_Bps, latency_s

    def collective_time(self, op: str, nbytes: int, nranks: int) -> float:
        return 0.0 if nranks <= 1 else self.latency_s + nbytes / self.bandwidth_Bps

    def describe(self) -> dict:
        return {"network": self.name, "bandwidth_Bps": self.bandwidth_Bps}


def train_steps(rank, iters=3):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)]), bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    for _ in range(iters):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


@pytest.fixture(scope="module")
def cap():
    return capture(models.get("mlp", bucket_cap_mb=0.02), 2,
                   timing=Timing(network=Network.preset("100gbe"),
                                 compute=Compute.roofline("a100")))


def test_a_network_model_of_ones_own_works_in_cosimulation_and_replay_alike(cap):
    link = FlatLink()
    assert isinstance(link, NetworkModel) and isinstance(Network.preset("100gbe"), NetworkModel)
    sim = simddp.simulate(train_steps, nprocs=2, timing=Timing(network=link), seed=0)
    for recs in sim.trace:
        for r in recs:
            assert r.end - r.start == pytest.approx(link.collective_time(r.op, r.bytes, 2))
    res = replay(cap, 8, network=link)
    assert res.iteration_time > 0
    assert res.row()["network"] == "flat-link" and res.row()["bandwidth_Bps"] == 1e9
    for c in res.collectives:
        assert c["end"] - c["start"] == pytest.approx(link.collective_time(c["op"], c["bytes"], 8))


def test_an_object_missing_part_of_the_network_model_protocol_is_refused_by_both_engines(cap):
    class OnlyTimes:  # co-simulation alone once accepted this; replay then broke on it
        def collective_time(self, op, nbytes, nranks):
            return 1e-3

    with pytest.raises(TypeError, match="NetworkModel"):
        Timing(network=OnlyTimes())
    with pytest.raises(TypeError, match="NetworkModel"):
        replay(cap, 4, network=OnlyTimes())


def test_simulate_and_replay_results_share_one_shape(cap):
    sim = simddp.simulate(train_steps, nprocs=2, timing=Timing(), seed=0)
    rep = replay(cap, 4, network=Network.preset("100gbe"), iterations=2)
    for res in (sim, rep):
        assert isinstance(res, simddp.RunResult)
        assert isinstance(res.timeline, simddp.Timeline)
        assert res.iteration_times == res.timeline.iteration_times()
        assert res.exposed_comm == res.timeline.exposed_comm()
        assert res.slowest_rank == res.timeline.slowest_ranks()
        assert len(res.iteration_times) == len(res.exposed_comm) == len(res.slowest_rank) > 0
        assert res.iteration_time == pytest.approx(
            sum(res.iteration_times) / len(res.iteration_times))
        assert res.world_size == res.timeline.nranks
        assert isinstance(res.summary(), str) and res.summary()


def test_an_observer_is_told_of_each_ranks_end_of_backward_wait():
    seen = []

    class Recorder(simddp.Observer):
        def backward_waited(self, rank, start, end):
            seen.append((rank, start, end))

    res = simddp.simulate(train_steps, nprocs=2, timing=Timing(network=Network.preset("100gbe")),
                          seed=0, observer=Recorder())
    assert sorted(r for r, _, _ in seen) == [0, 0, 0, 1, 1, 1]  # one per backward pass
    for rank, start, end in seen:
        assert start <= end
        if end > start:  # the wait shows in the timeline exactly as the observer saw it
            waits = res.timeline.rank_spans(rank, ("wait",))
            assert any(s.start == start and s.end == end for s in waits)


@dataclasses.dataclass
class _MyScenario:
    """Not a models.Scenario: only the attributes capture reads."""

    name: str = "mine"
    ddp_kwargs: dict = dataclasses.field(default_factory=lambda: {"bucket_cap_mb": 0.01})

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def inputs(self, rank, world_size):
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(4, 32, generator=g)]  # one batch, repeated by capture

    def step(self, model, batch):
        return model(batch).pow(2).mean()


def test_capture_takes_any_object_with_the_scenario_attributes():
    c = capture(_MyScenario(), 2, timing=Timing(network=Network.preset("100gbe")))
    assert c.name == "mine" and c.world_size == 2 and len(c.params) == 4
    assert c.bucket_cap_bytes == int(0.01 * 1024 * 1024)
    assert sorted(c.ready_order) == [0, 1, 2, 3]
    assert replay(c, network=Network.preset("100gbe")).iteration_time == pytest.approx(
        c.cosim_iteration_time, rel=0.05)
    with pytest.raises(ValueError, match="iterations must be an integer >= 3"):
        capture(_MyScenario(), 2, iterations=2)


def test_plotting_without_matplotlib_says_which_extra_to_install(monkeypatch, tmp_path):
    tl = simddp.simulate(train_steps, nprocs=2, timing=Timing(), seed=0).timeline
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches",
                 "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'fakepg-simddp\[plot\]'"):
        tl.plot(tmp_path / "t.png")


@settings(max_examples=200, deadline=None)
@given(now=st.floats(0, 1e6, allow_nan=False), t=st.floats(0, 1e6, allow_nan=False))
@example(now=1.4856100389655822, t=65.99999999999999)  # no delay d gives now + d == t
def test_at_lands_on_any_absolute_time_exactly(now, t):
    assume(t >= now)
    env = simpy.Environment(initial_time=now)
    got = []

    def waiter():
        got.append((yield at(env, t, "v")))
        got.append(env.now)

    env.process(waiter())
    env.run()
    assert got == ["v", t]


def test_an_op_the_registry_does_not_know_is_costed_as_an_all_reduce():
    net = Network.preset("100gbe")
    assert collective_time(net, "my_fused_op", 1 << 20, 8) == \
        net.collective_time("all_reduce", 1 << 20, 8)
    with pytest.raises(ValueError, match="unknown collective 'my_fused_op'"):
        net.collective_time("my_fused_op", 1 << 20, 8)


def test_a_timeline_subset_renumbers_ranks_and_keeps_their_figures(cap):
    res = replay(cap, 16, network=Network.preset("100gbe"), rank_speed={5: 0.5}, iterations=2)
    sub = res.timeline.subset([5, 0])
    assert sub.nranks == 2
    assert sub.iteration_times() == res.timeline.iteration_times(rank=5)
    assert sub.iteration_times(rank=1) == res.timeline.iteration_times(rank=0)
    assert {c.rank for c in sub.comms} == {0, 1}
    assert [c.start for c in sub.rank_comms(0)] == [c.start for c in res.timeline.rank_comms(5)]
