"""simddp: every scenario of the zoo runs under virtual time as it runs untimed."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
from fakepg import zoo as models  # the scenario zoo, installed as fakepg.zoo
import simddp
from simddp import Timing


def run(rank, name, **overrides):
    """Train zoo scenario ``name`` (``overrides`` go to ``zoo.get``) under DDP; its parameters."""
    sc = models.get(name, **overrides)
    model = DDP(sc.build_model(), **sc.ddp_kwargs)
    opt = sc.optimizer(model.parameters())
    with Join([model], enable="uneven" in sc.features):
        for batch in sc.inputs(rank, dist.get_world_size()):
            opt.zero_grad()
            sc.step(model, batch).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(models.SCENARIOS))
def test_a_zoo_scenario_gives_the_untimed_results_and_a_timeline_without_false_races(name):
    untimed = fakepg.spawn(run, (name,), 2)
    timed = simddp.simulate(run, (name,), 2, timing=Timing(jitter=0.1))
    for a, b in zip(untimed.returns, timed.returns):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    steps = [len(models.get(name).inputs(r, 2)) for r in range(2)]
    assert [len(b) for b in timed.timeline.boundaries] == steps
    assert all(t > 0 for t in timed.timeline.iteration_times())
    assert all(r.issue <= r.start <= r.end for rs in timed.trace for r in rs)
