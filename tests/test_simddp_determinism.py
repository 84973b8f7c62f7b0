"""simddp: same program + seed => bitwise identical traces and timelines, jitter included,
even where torch itself runs a rank's ops in a run-dependent order."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import simddp
from simddp import Compute, Timing

sys.path.insert(0, str(Path(__file__).parent))
from test_simddp_scenarios import run  # noqa: E402

# With find_unused_parameters=True, DDP's C++ Reducer walks an unordered_map keyed by autograd
# node pointers: the zero_ of unused parameters' grads ((32,) and (32, 32) tensors) come in an
# order that changes from run to run.
REORDERING = ("rank_dependent_unused",)
JITTERED = Timing(jitter=0.1, rank_speed={1: 0.7})


def test_jittered_timeline_is_identical_even_when_torch_reorders_ops():
    results = [simddp.simulate(run, REORDERING, 3, timing=JITTERED) for _ in range(4)]
    assert len({r.to_json() for r in results}) == 1
    assert len({r.timeline.to_csv() for r in results}) == 1
    assert all(r.timeline.to_chrome_trace() == results[0].timeline.to_chrome_trace()
               for r in results)


def test_another_jitter_seed_changes_the_timeline():
    base = simddp.simulate(run, REORDERING, 3, timing=JITTERED)
    same = simddp.simulate(run, REORDERING, 3, timing=Timing(jitter=0.1, rank_speed={1: 0.7}, seed=0))
    other = simddp.simulate(run, REORDERING, 3, timing=Timing(jitter=0.1, rank_speed={1: 0.7}, seed=1))
    assert same.timeline.to_csv() == base.timeline.to_csv()  # seed=None: simulate's seed (0)
    assert other.timeline.to_csv() != base.timeline.to_csv()
    assert other.to_json() != base.to_json()
    assert other.timeline.iteration_times() != base.timeline.iteration_times()
    # only the times moved
    assert [[(r.op, r.bytes) for r in rs] for rs in other.trace] == \
        [[(r.op, r.bytes) for r in rs] for rs in base.trace]


def _permuted(rank, order):
    """Ops of different costs in a given order, around a collective: the order must not show."""
    ts = [torch.ones(32), torch.ones(32, 32), torch.ones(64, 64)]
    for i in order:
        ts[i].zero_()
        ts[i].add_(1.0)
    dist.all_reduce(torch.ones(8))
    for i in order:
        ts[i].mul_(3.0)
    return simddp.now()


@pytest.mark.parametrize("seed", range(6))
def test_the_order_of_a_ranks_ops_changes_no_virtual_time(seed):
    timing = Timing(jitter=0.2, rank_speed={1: 0.6}, seed=seed)
    runs = [simddp.simulate(_permuted, (order,), 2, timing=timing)
            for order in itertools.permutations(range(3))]
    assert len({(tuple(r.returns), r.to_json(), r.timeline.to_csv()) for r in runs}) == 1
    # not vacuous: the noise is there, and another seed moves it
    plain = simddp.simulate(_permuted, ((0, 1, 2),), 2, timing=Timing(rank_speed={1: 0.6}))
    other = simddp.simulate(_permuted, ((0, 1, 2),), 2,
                            timing=Timing(jitter=0.2, rank_speed={1: 0.6}, seed=seed + 100))
    assert plain.returns != runs[0].returns != other.returns


def test_op_jitter_is_mean_one_log_normal_with_relative_stddev_jitter_scaled_by_rank_speed():
    def body(rank, n):
        x = torch.ones(4)
        times = [simddp.now()]
        for _ in range(n):
            x.add_(1.0)
            times.append(simddp.now())
        return times

    res = simddp.simulate(body, (4000,), 2, timing=Timing(compute=Compute.constant(1e-3),
                                                          jitter=0.1, rank_speed={1: 0.5}))
    for rank, per_op in ((0, 1e-3), (1, 2e-3)):
        dts = np.diff(res.returns[rank]) / per_op
        assert dts.mean() == pytest.approx(1.0, abs=0.01)
        assert dts.std() == pytest.approx(0.1, rel=0.1)
        assert np.median(dts) < dts.mean()  # log-normal: skewed right
        assert len(set(dts.tolist())) > 3900  # one op's factors do not cycle quickly


def test_a_compute_model_giving_a_non_finite_cost_is_named():
    class Broken(Compute):
        def op_time(self, func, args, kwargs, out):
            return float("nan")

    def body(rank):
        torch.ones(4).add_(1.0)

    for jitter in (0.0, 0.1):
        with pytest.raises(Exception, match="cost of nan s"):
            simddp.simulate(body, (), 1, timing=Timing(compute=Broken(), jitter=jitter))
