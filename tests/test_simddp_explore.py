"""simddp.explore (issue 10, part 3) and simddp's timing faults (part 5): slow_rank/slow_link
from a virtual time, perturbed timings, shrinking toward the base, replay tokens."""

import dataclasses
import math
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

import simddp
from simddp import (CollectiveRaceError, CollectiveTimeoutError, Compute, ExplorationError,
                    Network, Timing, faults)

OP = 1e-3  # every op costs 1 ms of virtual time
NET = Network(bandwidth_GBps=10.0, latency_us=5.0)


def forty_ops_then_barrier(rank):
    x = torch.ones(8, 8)
    for _ in range(20):
        x = x @ x * 0.01  # two ops: 2 ms
    dist.barrier()
    return simddp.now()


# 40 ms of compute, then a barrier under a 50 ms virtual timeout: a rank ~2.2x slower than
# its peers leaves them waiting past the watchdog.
BARRIER_BASE = Timing(network=NET, compute=Compute.constant(OP), timeout=0.05)


def _explore_barrier(**kw):
    with pytest.raises(ExplorationError) as info:
        simddp.explore(forty_ops_then_barrier, nprocs=4, timing=BARRIER_BASE, runs=60, **kw)
    return info.value


# -- explore: a straggler-induced timeout ---------------------------------------------------

def test_explore_finds_a_straggler_timeout_and_shrinks_it_to_one_slowed_rank():
    threads = threading.active_count()
    e = _explore_barrier()
    assert threading.active_count() == threads  # no rank thread left behind
    assert len(e.deviations) == 1 and e.deviations[0].startswith("rank ")
    assert "x slower" in e.deviations[0]
    [(rank, speed)] = e.timing.rank_speed.items()
    # shrunk to the smallest slowdown on the strategy's grid (1 + 3k/16) that still fails:
    # the straggler arrives after 40 ms x factor, its peers time out 50 ms after 40 ms.
    factor = 1 / speed
    assert 0.04 * factor > 0.09 and 0.04 * (factor - 3 / 16) <= 0.09
    assert e.timing.jitter == 0 and not e.timing.faults and e.timing.seed is None
    assert isinstance(e.__cause__, CollectiveTimeoutError)
    assert e.__cause__.rank != rank and e.__cause__.op == "barrier"
    assert e.schedule == e.token and e.token.startswith("sd1:")
    last = str(e).splitlines()[-1]
    assert last.startswith("replay") and "simddp.simulate(forty_ops_then_barrier" in last
    assert f"timing.with_token({e.token!r})" in last
    assert "Watchdog caught collective operation timeout" in str(e)


def test_the_token_replays_the_straggler_timeout_twice_bitwise():
    e = _explore_barrier()
    errors = []
    for _ in range(2):
        with pytest.raises(CollectiveTimeoutError) as info:
            simddp.simulate(forty_ops_then_barrier, nprocs=4, timing=BARRIER_BASE.with_token(e.token))
        errors.append(info.value)
    a, b = errors
    assert str(a) == str(b) == str(e.__cause__)
    assert (a.rank, a.seq, a.time.hex()) == (b.rank, b.seq, b.time.hex())
    # without the watchdog the same timing runs to the end: identical timelines, bit for bit
    lax = dataclasses.replace(BARRIER_BASE, timeout=None).with_token(e.token)
    runs = [simddp.simulate(forty_ops_then_barrier, nprocs=4, timing=lax) for _ in range(2)]
    assert [t.hex() for t in runs[0].returns] == [t.hex() for t in runs[1].returns]
    assert runs[0].timeline.spans == runs[1].timeline.spans


def test_exploring_twice_with_one_seed_finds_the_same_timing():
    assert _explore_barrier().token == _explore_barrier().token


def test_a_base_timing_that_already_fails_is_reported_with_no_deviation():
    tight = dataclasses.replace(BARRIER_BASE, rank_speed={1: 0.25})
    with pytest.raises(ExplorationError) as info:
        simddp.explore(forty_ops_then_barrier, nprocs=4, timing=tight, runs=5)
    e = info.value
    assert e.deviations == [] and "base timing itself" in str(e)
    assert e.runs == 1 and Timing().with_token(e.token).rank_speed == {1: 0.25}


def test_explore_reports_a_user_check_failing_on_the_result():
    def check(res):
        assert res.timeline.makespan < 0.06, "iteration too slow"

    lax = dataclasses.replace(BARRIER_BASE, timeout=None)
    with pytest.raises(ExplorationError) as info:
        simddp.explore(forty_ops_then_barrier, nprocs=2, timing=lax, runs=40, check=check,
                       max_jitter=None)
    e = info.value
    assert isinstance(e.__cause__, AssertionError) and len(e.deviations) == 1
    assert str(e).splitlines()[-1].startswith("replay") and "check(simddp.simulate(" in str(e)


def test_explore_finds_a_timeout_only_a_slow_link_causes_and_shrinks_it_to_one_link():
    def program(rank):
        dist.all_reduce(torch.ones(1 << 18))  # 1 MiB: ~0.16 ms of ring all_reduce on NET

    base = Timing(network=NET, compute=Compute.constant(1e-6), timeout=0.0003)
    simddp.simulate(program, nprocs=3, timing=base)  # fine under the base timing
    with pytest.raises(ExplorationError) as info:
        simddp.explore(program, nprocs=3, timing=base, runs=60, max_slowdown=1.0,
                       max_jitter=None, max_links=2, max_link_slowdown=4.0)
    e = info.value
    assert isinstance(e.__cause__, CollectiveTimeoutError)
    assert len(e.deviations) == 1 and e.deviations[0].startswith(("link", "rank"))
    [link] = e.timing.faults
    assert isinstance(link, faults.SlowLink) and e.timing.rank_speed == {}
    simddp.simulate(program, nprocs=3, timing=base.with_token(  # a notch less passes
        dataclasses.replace(e.timing, faults=[dataclasses.replace(
            link, factor=link.factor - 3 / 16)]).token()))


# -- explore: no false positives ---------------------------------------------------------------

def ddp_steps(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4)), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def replicas_agree(res):
    for p0, *ps in zip(*res.returns):
        for p in ps:
            assert torch.equal(p0, p), "replicas diverged"


def test_a_correct_ddp_program_explored_reports_no_failure_and_a_summary():
    s = simddp.explore(ddp_steps, nprocs=2, timing=Timing(network=NET), runs=15,
                       check=replicas_agree, max_jitter=0.1, horizon=0.001)
    assert isinstance(s, simddp.ExplorationSummary)
    assert s.runs == 16 and 1 < s.distinct <= 16  # the base timing, then 15 drawn
    assert 0 < s.fastest <= s.slowest and s.slowest_token.startswith("sd1:")
    assert "passed" in str(s)


# -- the strategy -------------------------------------------------------------------------------

STRATEGY_BASE = Timing(jitter=0.01, timeout=5.0)


@settings(max_examples=25, deadline=None, database=None)
@given(simddp.strategies.timings(STRATEGY_BASE, nprocs=4, max_slowdown=3.0,
                                 max_jitter=0.2, max_link_slowdown=5.0, horizon=2.0))
def test_drawn_timings_stay_within_their_bounds_and_round_trip_through_tokens(t):
    assert set(t.rank_speed) <= set(range(4))
    assert all(1 / 3.0 - 1e-12 <= v <= 1.0 for v in t.rank_speed.values())
    assert 0.01 <= t.jitter <= 0.2 and t.timeout == 5.0
    for f in t.faults:
        assert 1.0 < f.factor <= 5.0 and 0.0 <= f.at <= 2.0 and f.until == math.inf
    assert STRATEGY_BASE.with_token(t.token()) == t


# -- faults from a virtual time ------------------------------------------------------------------

def _ops_clock(rank):
    x = torch.ones(2)
    stamps = []
    for _ in range(10):
        x = x + 1
        stamps.append(simddp.now())
    return stamps


def test_slow_rank_slows_only_the_ops_the_rank_starts_from_its_onset():
    t = Timing(compute=Compute.constant(OP))
    res = simddp.simulate(_ops_clock, nprocs=2, timing=t,
                          faults=[faults.slow_rank(1, 3.0, at=0.004)])
    assert res.returns[0] == pytest.approx([OP * k for k in range(2, 12)])
    # torch.ones and three adds at 1 ms (the last ends at 4 ms), then 3 ms each
    assert res.returns[1] == pytest.approx([0.002, 0.003, 0.004] +
                                           [0.004 + 0.003 * k for k in range(1, 8)])


def test_a_slow_rank_window_ends_at_until_and_overlapping_faults_multiply():
    t = Timing(compute=Compute.constant(OP),
               faults=[faults.slow_rank(0, 2.0, at=0.002, until=0.008),
                       faults.slow_rank(0, 1.5, at=0.004, until=0.008)])
    stamps = simddp.simulate(_ops_clock, nprocs=1, timing=t).returns[0]
    steps = [round((b - a) * 1e3, 9) for a, b in zip([0.0] + stamps, stamps)]
    # torch.ones + add (1 ms each), add from 2 ms (x2), two from 4 ms (x3), then 1 ms again
    assert steps == [2, 2, 3, 3, 1, 1, 1, 1, 1, 1]


def test_slow_rank_with_jitter_is_deterministic():
    t = Timing(compute=Compute.constant(OP), jitter=0.2,
               faults=[faults.slow_rank(1, 2.0, at=0.003, until=0.006)])
    a, b = (simddp.simulate(_ops_clock, nprocs=2, timing=t).returns for _ in range(2))
    assert [[x.hex() for x in r] for r in a] == [[x.hex() for x in r] for r in b]
    assert a[0] != a[1]


def _four_all_reduces(rank):
    t = torch.ones(1 << 16)
    ends = []
    for _ in range(4):
        dist.all_reduce(t)
        ends.append(simddp.now())
    return ends


def test_slow_link_slows_collectives_that_start_from_its_onset_over_that_link():
    t = Timing(network=NET, compute=Compute.constant(0.0))
    base = simddp.simulate(_four_all_reduces, nprocs=3, timing=t).returns[0]
    d = base[0]
    assert base == pytest.approx([d, 2 * d, 3 * d, 4 * d])
    slow = simddp.simulate(_four_all_reduces, nprocs=3, timing=t,
                           faults=[faults.slow_link(2, 0, 10.0, at=1.5 * d)]).returns[0]
    assert slow == pytest.approx([d, 2 * d, 12 * d, 22 * d])
    # rank 0's NIC until 1.5 d: only the first all_reduce starts in that window
    g = simddp.simulate(_four_all_reduces, nprocs=3, timing=t,
                        faults=[faults.slow_link(0, None, 2.0, until=1.5 * d)]).returns[0]
    assert g == pytest.approx([2 * d, 3 * d, 4 * d, 5 * d])


def test_slow_link_leaves_groups_that_do_not_hold_both_ends_alone():
    def pair(rank):
        g = dist.new_group([0, 1])
        if rank < 2:
            dist.all_reduce(torch.ones(1 << 16), group=g)
        return simddp.now()

    t = Timing(network=NET, compute=Compute.constant(0.0))
    base = simddp.simulate(pair, nprocs=3, timing=t).returns
    assert simddp.simulate(pair, nprocs=3, timing=t,
                           faults=[faults.slow_link(1, 2, 5.0)]).returns == base
    slow = simddp.simulate(pair, nprocs=3, timing=t, faults=[faults.slow_link(1, 0, 5.0)]).returns
    assert slow[0] == pytest.approx(5 * base[0])


def test_faults_naming_ranks_outside_the_world_or_bad_factors_are_rejected_clearly():
    with pytest.raises(ValueError, match=r"rank 5 .*ranks 0\.\.1 \(nprocs=2\)"):
        simddp.simulate(_ops_clock, nprocs=2, timing=Timing(),
                        faults=[faults.slow_rank(5, 2.0)])
    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        faults.slow_rank(0, 0.0)
    with pytest.raises(ValueError, match="until .* must come after at"):
        faults.slow_link(0, 1, 2.0, at=1.0, until=0.5)
    with pytest.raises(ValueError, match="a link joins two ranks"):
        faults.slow_link(1, 1, 2.0)
    with pytest.raises(TypeError, match="is not a fault"):
        Timing(faults=["slow"])
    with pytest.raises(ValueError, match=r"Timing.faults: .*names rank 3.*nprocs=2"):
        simddp.explore(_ops_clock, nprocs=2, timing=Timing(faults=[faults.slow_link(3, None, 2.0)]))
    with pytest.raises(TypeError, match="fn must be callable"):
        simddp.explore("train", nprocs=2)
    with pytest.raises(ValueError, match="not a simddp timing token"):
        Timing().with_token("fpg1:abc")
    with pytest.raises(ValueError, match="damaged"):
        Timing().with_token("sd1:!!!")


def test_import_simddp_works_without_hypothesis_and_explore_says_what_to_install():
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import simddp\n"
            "try:\n    simddp.explore(lambda r: None, nprocs=1)\n"
            "except ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "pip install hypothesis" in out.stdout


def _zoo_rank_fn(name, **loop):
    from fakepg import zoo
    sc = zoo.get(name)

    def rank_fn(rank, world):
        model = zoo.TrainLoop(**loop)(sc, rank, world)
        return [p.detach().clone() for p in model.parameters()]
    return rank_fn


@pytest.mark.parametrize("name,loop", [
    ("uneven_inputs", {}),  # Join's shadow collectives
    ("rank_dependent_unused", {}),  # find_unused_parameters
    ("mlp", {"comm_hook": "fp16"}),  # a comm hook's future callbacks on the side stream
], ids=["join-uneven-inputs", "unused-parameters", "fp16-comm-hook"])
def test_ddp_scenarios_explored_under_jitter_stragglers_and_slow_links_report_no_failure(name, loop):
    if loop.get("comm_hook") == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        loop = {"comm_hook": default_hooks.fp16_compress_hook}
    s = simddp.explore(_zoo_rank_fn(name, **loop), (2,), nprocs=2,
                       timing=Timing(network=Network.preset("100gbe"),
                                     compute=Compute.roofline("a100")),
                       runs=8, check=replicas_agree, max_jitter=0.1, horizon=1e-3)
    assert s.runs == 9 and s.slowest > s.fastest
