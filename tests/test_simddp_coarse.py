"""simddp's coarse path (simddp.cosim.tape): a backward pass the rank has seen before is
charged from its tape, and every virtual time is what charging op by op gives."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fakepg import zoo
import simddp
from simddp import CollectiveTimeoutError, Compute, Network, Timing
from simddp.cosim import tape
from simddp.cosim.simulate import RerunWarning
from test_simddp_scenarios import run as train_scenario

ITERATIONS = 7  # three backward passes recorded per rank (the first two differ: rebuild)


def run(rank, name):
    return train_scenario(rank, name, iterations=ITERATIONS)


@pytest.fixture
def replays(monkeypatch):
    """How many backward passes ran from a tape (counted off the call stack: a frame of this
    file inside backward would become the collectives' call site)."""
    count = [0]

    class Counted(tape.Player):
        __slots__ = ()

        def __init__(self, *args):
            super().__init__(*args)
            count[0] += 1
    monkeypatch.setattr(tape, "Player", Counted)
    return count


def same(a, b):
    assert a.to_json() == b.to_json()  # the trace: issue, start and end of every collective
    assert a.timeline.to_csv() == b.timeline.to_csv()  # every span and wait
    assert a.timeline.to_chrome_trace() == b.timeline.to_chrome_trace()
    for x, y in zip(a.returns, b.returns):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


STRAGGLER = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"),
                   jitter=0.1, network_jitter=0.05, rank_speed={1: 0.6}, seed=3)


@pytest.mark.parametrize("name", sorted(zoo.SCENARIOS))
def test_a_zoo_scenario_has_the_same_times_coarse_and_per_op_with_stragglers_and_jitter(
        name, replays):
    per_op = simddp.simulate(run, (name,), 2, timing=STRAGGLER, coarse=False)
    assert replays[0] == 0
    coarse = simddp.simulate(run, (name,), 2, timing=STRAGGLER)
    same(per_op, coarse)


def test_repeated_backward_passes_of_ddp_are_replayed_and_keep_their_times(replays):
    timing = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"))
    per_op = simddp.simulate(run, ("mlp",), 3, timing=timing, coarse=False)
    coarse = simddp.simulate(run, ("mlp",), 3, timing=timing)
    same(per_op, coarse)
    assert replays[0] >= 3 * (ITERATIONS - 3)


def test_a_replayed_backward_that_meets_an_event_its_tape_lacks_reruns_per_op(replays):
    def body(rank):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                        torch.nn.Linear(8, 8)))
        x = torch.randn(4, 8)
        times = []
        for i in range(6):
            h = model.module[0](x)
            if i == 5:  # a hook on a non-leaf tensor: the graph's key does not show it
                h.register_hook(lambda g: times.append(simddp.now()))
            model.module[2](model.module[1](h)).sum().backward()
        return times

    timing = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"),
                    jitter=0.1)
    per_op = simddp.simulate(body, (), 2, timing=timing, coarse=False)
    with pytest.warns(RerunWarning, match="side effects .* ran twice"):
        coarse = simddp.simulate(body, (), 2, timing=timing)
    assert replays[0] > 0 and coarse.returns == per_op.returns
    assert coarse.timeline.to_csv() == per_op.timeline.to_csv()


def test_a_timeout_at_the_end_of_a_replayed_backward_fires_at_the_same_virtual_time():
    def train(rank):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(16, 16))
        x = torch.randn(4, 16)
        for i in range(8):
            loss = model(x).sum()
            if rank == 1 and i == 6:
                for _ in range(2000):
                    x.cos()  # a straggler before its backward
            loss.backward()

    timing = Timing(network=Network.preset("100gbe"), compute=Compute.constant(1e-3),
                    timeout=1.0)
    errors = []
    for coarse in (False, True):
        with pytest.raises(CollectiveTimeoutError) as info:
            if coarse:  # the timeout escapes a replayed segment: the world reruns per-op
                with pytest.warns(RerunWarning):
                    simddp.simulate(train, nprocs=2, timing=timing, coarse=coarse)
            else:
                simddp.simulate(train, nprocs=2, timing=timing, coarse=coarse)
        errors.append(info.value)
    assert errors[0].rank == errors[1].rank == 0
    assert str(errors[0]) == str(errors[1]) and errors[0].time == errors[1].time


def test_without_a_pure_compute_model_every_backward_is_charged_per_op(replays):
    timing = Timing(network=Network.preset("100gbe"),
                    compute=Compute.from_profile({"aten::mm": 1e-4}, fallback=Compute.constant(1e-6)))
    simddp.simulate(run, ("mlp",), 2, timing=timing)
    assert replays[0] == 0


def _tricky(rank):
    """Module outputs changed in place, an input shared by two branches, a graph walked twice
    (retain_graph), a frozen layer, eval mode and no_grad steps, a second optimizer."""
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    head = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 4))
    model = DDP(torch.nn.ModuleList([trunk, head]))
    opt = torch.optim.SGD(trunk.parameters(), lr=0.1, momentum=0.9)
    opt2 = torch.optim.Adam(head.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for i in range(8):
        h = trunk(x)
        if i % 3 == 0:
            h.relu_()
        out = head(h) + head(h * 2)
        loss = out.pow(2).mean()
        loss.backward(retain_graph=(i == 5))
        if i == 5:
            (out.sum() * 0).backward()
        head[2].weight.requires_grad_(i < 4)
        opt.step()
        opt2.step()
        opt.zero_grad()
        opt2.zero_grad(set_to_none=(i % 2 == 0))
        with torch.no_grad():
            trunk.eval()
            trunk(x)
            trunk.train()
    return [p.detach().clone() for p in model.parameters()]


def test_in_place_outputs_shared_inputs_retained_graphs_and_frozen_layers_keep_their_times(
        replays):
    timing = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"),
                    jitter=0.05, rank_speed={0: 0.8})
    per_op = simddp.simulate(_tricky, (), 2, timing=timing, coarse=False)
    coarse = simddp.simulate(_tricky, (), 2, timing=timing)
    same(per_op, coarse)
    assert replays[0] > 0


def test_gradient_accumulation_with_no_sync_replays_both_kinds_of_backward(
        replays, monkeypatch):
    diverged = []
    real = tape.diverged_at
    monkeypatch.setattr(tape, "diverged_at", lambda r, what: diverged.append(what) or real(r, what))

    def body(rank):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        for step in range(6):
            for micro in range(3):
                if micro < 2:
                    with model.no_sync():
                        model(x).sum().backward()
                else:
                    model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    timing = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"),
                    jitter=0.05)
    per_op = simddp.simulate(body, (), 2, timing=timing, coarse=False)
    coarse = simddp.simulate(body, (), 2, timing=timing)
    same(per_op, coarse)
    assert replays[0] > 0 and not diverged
