"""simddp replay's vectorised engine: every rank a slot of numpy arrays, the same answers as
the per-rank simpy engine."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakepg import zoo as models  # the scenario zoo, installed as fakepg.zoo
from simddp import Compute, Network, Timing
from simddp.analysis.arrays import ArrayTimeline
from simddp.replay import replay
from simddp import capture

NET = Network.preset("100gbe")
IB8 = Network.preset("ib-ndr", gpus_per_node=8)
IB4 = Network.preset("ib-ndr", gpus_per_node=4)
CPU = Timing(network=Network.preset("gloo-loopback"), compute=Compute.roofline("cpu"))


@pytest.fixture(scope="module")
def caps() -> dict:
    return {
        # 6 layers of 64×64 + biases, 20 KiB buckets: three buckets
        "mlp": capture(models.get("mlp", bucket_cap_mb=0.02), 2,
                       timing=Timing(network=NET, compute=Compute.roofline("a100"))),
        # broadcast_buffers: two forward collectives, one of them waited on
        "buffers": capture(models.get("buffers"), 2, timing=CPU),
        # an all_reduce after backward (unused parameters), and two different profiles
        "unused": capture(models.get("rank_dependent_unused"), 2, timing=CPU),
    }


CONFIGS = [
    pytest.param("mlp", 64, dict(network=IB8, jitter=0.05, seed=7, iterations=2), id="jitter-64"),
    pytest.param("mlp", 48, dict(network=IB8, jitter=0.02, rank_speed={3: 0.5, 40: 0.8},
                                 iterations=3), id="stragglers-48"),
    pytest.param("mlp", 32, dict(network=IB8, jitter=0.05, comm_hook="fp16",
                                 bucket_cap_mb=0.01), id="fp16-bucket-cap-32"),
    pytest.param("mlp", 32, dict(network=IB8, jitter=0.05, comm_hook="powersgd",
                                 powersgd_rank=2, iterations=2, rank_speed={5: 0.7}),
                 id="powersgd-32"),
    pytest.param("mlp", 64, dict(network=IB8, jitter=0.05, localsgd_period=2, iterations=4,
                                 rank_speed={9: 0.6}), id="localsgd-node-subgroups-64"),
    pytest.param("mlp", 24, dict(network=IB4, jitter=0.05, slowmo_period=2, iterations=3),
                 id="slowmo-partial-node-24"),
    pytest.param("mlp", 32, dict(network=IB8, jitter=0.05, groups=4, iterations=2),
                 id="groups-32"),
    pytest.param("mlp", 64, dict(network=IB4, jitter=0.05, groups=2, localsgd_period=2,
                                 iterations=3), id="groups-localsgd-64"),
    pytest.param("mlp", 16, dict(network=IB8, jitter=0.05, shared_nic=True), id="one-group-nic"),
    pytest.param("mlp", 16, dict(network=NET, engine="vector", rank_speed={1: 0.7}),
                 id="no-jitter-forced-16"),
    pytest.param("buffers", 16, dict(network=IB8, jitter=0.05, iterations=3),
                 id="forward-collectives-16"),
    pytest.param("buffers", 32, dict(network=IB8, jitter=0.05, localsgd_period=2,
                                     groups=2, iterations=3), id="forward-collectives-localsgd"),
    pytest.param("unused", 16, dict(network=IB8, jitter=0.05, comm_hook="powersgd",
                                    iterations=2), id="backward-collective-powersgd-16"),
]


def _close(a, b):
    """Equal to float rounding: the vectorised engine sums the same intervals in another
    order (compute, waits, comm, exposed comm); 1e-9 relative, 1e-15 s absolute."""
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-15) for x, y in zip(a, b))


@pytest.mark.parametrize("name,world,kw", CONFIGS)
def test_the_vectorised_engine_gives_the_per_rank_simpy_engines_answer(caps, name, world, kw):
    cap = caps[name]
    fast = replay(cap, world, progress=False, **kw)
    slow = replay(cap, world, progress=False, per_rank=True,
                  **{**kw, "engine": "simpy"})
    a, b = fast.timeline, slow.timeline
    assert isinstance(a, ArrayTimeline) and not isinstance(b, ArrayTimeline)
    # iteration ends: the same float operations in the same order, so bit for bit
    assert list(a.boundaries) == list(b.boundaries)
    assert fast.iteration_times == slow.iteration_times
    assert [a.iteration_times(r) for r in range(world)] == \
        [b.iteration_times(r) for r in range(world)]
    assert a.end_times == list(b.end_times) and a.makespan == b.makespan
    assert fast.slowest_rank == slow.slowest_rank
    # every collective, its start and end, in the simpy engine's creation order (which is the
    # order network noise is drawn in: same seed, same draws)
    assert fast.collectives == slow.collectives
    assert list(fast.rank_collectives) == list(slow.rank_collectives)
    assert list(fast.rank_comm_bytes) == list(slow.rank_comm_bytes)
    # per-iteration sums of intervals: equal to float rounding
    for r in range(world):
        assert _close(a.exposed_comm(r), b.exposed_comm(r))
        assert _close(a.waits(r), b.waits(r))
    assert _close(fast.exposed_comm, slow.exposed_comm) and _close(a.waits(), b.waits())
    fields = ("start", "end", "forward", "backward", "optimizer", "wait", "comm", "overlap")
    rows_a, rows_b = a.breakdown(), b.breakdown()
    assert [(x.iteration, x.rank) for x in rows_a] == [(y.iteration, y.rank) for y in rows_b]
    for x, y in zip(rows_a, rows_b):
        assert _close([getattr(x, f) for f in fields], [getattr(y, f) for f in fields])
    # a rank's spans and collectives, materialised on demand
    def key(s):
        return (s.start, s.end, s.kind, s.name)
    for r in sorted({0, 1, world // 2, world - 1}):
        assert sorted(a.rank_spans(r), key=key) == sorted(b.rank_spans(r), key=key)
        assert a.rank_comms(r) == b.rank_comms(r)
    assert sorted(a.spans, key=lambda s: (s.rank, *key(s))) == \
        sorted(b.spans, key=lambda s: (s.rank, *key(s)))
    assert a.comms == b.comms
    assert a.notable_ranks(6) == b.notable_ranks(6)
    assert a.summary() == b.summary()


@settings(max_examples=15, deadline=None)
@given(world=st.sampled_from([2, 3, 8, 12, 24]),
       jitter=st.one_of(st.just(0.0), st.floats(1e-3, 0.1)),
       seed=st.integers(0, 2**16), hook=st.sampled_from([None, "fp16", "powersgd"]),
       period=st.sampled_from([None, 1, 2]), groups=st.sampled_from([1, 2, 3]),
       straggler=st.floats(0.3, 1.0), gpn=st.sampled_from([2, 4, 8]))
def test_the_vectorised_engine_agrees_with_simpy_on_random_replays(caps, world, jitter, seed,
                                                                    hook, period, groups,
                                                                    straggler, gpn):
    if world % groups:
        groups = 1
    if period is not None:
        hook = None
    kw = dict(network=Network.preset("ib-ndr", gpus_per_node=gpn), jitter=jitter, seed=seed,
              comm_hook=hook, localsgd_period=period, groups=groups,
              rank_speed={world - 1: straggler}, iterations=3, progress=False)
    fast = replay(caps["mlp"], world, engine="vector", **kw)
    slow = replay(caps["mlp"], world, engine="simpy", per_rank=True, **kw)
    assert list(fast.timeline.boundaries) == list(slow.timeline.boundaries)
    if jitter > 0:  # creation order decides which collective draws which noise factor
        assert fast.collectives == slow.collectives
    else:  # no draws; collectives created at one instant on two communicators (after a
        # wait that released their ranks at once) are listed in simpy's wake-up order there.
        # (Only with no or vanishing jitter — ~1e-16 — can such instants coincide.)
        assert sorted(fast.collectives, key=lambda c: c["name"]) == \
            sorted(slow.collectives, key=lambda c: c["name"])
    for r in range(world):
        assert _close(fast.timeline.exposed_comm(r), slow.timeline.exposed_comm(r))


def test_replay_runs_the_simpy_engine_where_the_vectorised_one_does_not_model_and_says_why(caps):
    from simddp.program import Knobs, plan
    from simddp.replay.vector_engine import unsupported

    cap = caps["mlp"]
    kw = dict(network=IB8, jitter=0.05, iterations=3, progress=False)
    # Join's shadow iterations: ranks run different plans
    joined = replay(cap, 16, uneven={3: 1}, **kw)
    assert not isinstance(joined.timeline, ArrayTimeline)
    assert joined.engine == "simpy" and "uneven inputs" in joined.engine_reason
    assert joined.to_json() == replay(cap, 16, uneven={3: 1}, per_rank=True, **kw).to_json()
    with pytest.raises(ValueError, match="uneven inputs"):
        replay(cap, 16, uneven={3: 1}, engine="vector", **kw)
    # NICs two DDP groups contend for couple their communicators in time
    shared = replay(cap, 32, groups=2, shared_nic=True, **{**kw, "network": IB4})
    assert not isinstance(shared.timeline, ArrayTimeline)
    with pytest.raises(ValueError, match="engine must be one of"):
        replay(cap, 16, engine="fast", **kw)
    # one predicate decides, on the program; a knob replay does not know is an error
    checked = Knobs(jitter=0.05).checked(16, IB8)
    assert unsupported(plan(cap, checked), checked) is None
    assert replay(cap, 16, **kw).engine == "vector"
    with pytest.raises(TypeError, match="unknown replay knob.*contention.*the knobs are"):
        replay(cap, 16, contention=0.3, **kw)
    # a network carrying an active Contention: the simpy engine, which models it
    from dataclasses import replace as with_field

    from simddp.models.contention import Contention

    busy = with_field(IB8, contention=Contention(slowdown=1.5, per_collective_us=20.0))
    checked = Knobs(jitter=0.05).checked(16, busy)
    assert "Contention" in unsupported(plan(cap, checked), checked)
    slowed = replay(cap, 16, **{**kw, "network": busy})
    assert not isinstance(slowed.timeline, ArrayTimeline)
    assert slowed.to_json() == replay(cap, 16, per_rank=True, **{**kw, "network": busy}).to_json()
    assert slowed.iteration_time > replay(cap, 16, **kw).iteration_time


def test_a_million_jittered_ranks_replay_vectorised_with_per_rank_figures(caps):
    n = 1_000_000
    res = replay(caps["mlp"], n, network=IB8, jitter=0.02, rank_speed={17: 0.5},
                 progress=False)
    tl = res.timeline
    assert isinstance(tl, ArrayTimeline) and tl.nranks == n
    assert res.slowest_rank == [17]
    assert tl.iteration_times(17) == res.iteration_times
    assert tl.notable_ranks()[17].startswith("slowest")
    assert len(tl.boundaries) == n and tl.boundaries[999_999] != tl.boundaries[999_998]
    assert res.rank_collectives[999_999] == res.rank_collectives[0] > 0
    spans = tl.rank_spans(17)  # materialised for this rank alone
    assert {s.kind for s in spans} >= {"forward", "backward", "optimizer"}
    assert "1000000 ranks" in tl.summary()


def test_the_vectorised_replay_reports_progress_without_changing_the_result(caps):
    seen = []
    kw = dict(network=IB8, jitter=0.05, rank_speed={3: 0.5})
    res = replay(caps["mlp"], 512, progress=lambda d, t, w: seen.append((d, t, w)), **kw)
    assert seen and seen[-1][0] == seen[-1][1] and "512 ranks, vectorised" in seen[-1][2]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert res.to_json() == replay(caps["mlp"], 512, progress=False, **kw).to_json()


def test_an_array_timeline_plots_and_exports_the_ranks_asked_for(caps, tmp_path):
    res = replay(caps["mlp"], 64, network=IB8, jitter=0.05, rank_speed={9: 0.5},
                 progress=False)
    tl = res.timeline
    path = tl.plot(tmp_path / "t.png")  # the notable ranks of 64
    assert (tmp_path / "t.png").stat().st_size > 0 and path.endswith("t.png")
    assert 9 in tl.notable_ranks()
    sub = tl.subset([9, 0])
    assert sub.nranks == 2 and sub.rank_spans(0)[0].rank == 0
    assert sub.iteration_times() == [max(a, b) for a, b in zip(tl.iteration_times(9),
                                                               tl.iteration_times(0))]
    doc = tl.subset(range(4)).to_chrome_trace()
    assert doc["traceEvents"]
    assert tl.to_csv().count("\n") == 1 + 64 * res.iterations
