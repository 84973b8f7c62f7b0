"""simddp.replay: a captured DDP iteration replayed at any world size on one simpy engine."""

import json
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fakepg import zoo as models  # the scenario zoo, installed as fakepg.zoo
from simddp import Compute, Network, Timing
from simddp.replay import CapturedIteration, replay
from simddp import capture, sweep

NET = Network.preset("100gbe")
TIMING = Timing(network=NET, compute=Compute.roofline("a100"))


@pytest.fixture(scope="module")
def cap() -> CapturedIteration:
    # 6 layers of 64×64 + biases, 20 KiB buckets: three buckets once DDP has rebuilt them
    return capture(models.get("mlp", bucket_cap_mb=0.02), 2, timing=TIMING)


def _bucket_all_reduces(res) -> int:
    """Gradient-bucket collectives of iteration 0 (names dp0/b/<iteration>/<bucket>/<stage>)."""
    return sum(1 for c in res.collectives if "/b/0/" in c["name"])


def _global_bytes(res) -> int:
    return sum(c["bytes"] for c in res.collectives if c["members"] == res.world_size)


@pytest.mark.parametrize("name,world,net", [
    ("mlp", 2, "100gbe"), ("mlp", 4, "gloo-loopback"), ("many_small_few_large", 4, "100gbe"),
    ("transformer_block", 3, "gloo-loopback"), ("buffers", 4, "gloo-loopback"),
    ("rank_dependent_unused", 2, "gloo-loopback"),
])
def test_replay_at_the_captured_world_size_reproduces_the_cosimulated_iteration(name, world, net):
    network = Network.preset(net)
    c = capture(models.get(name), world, timing=Timing(network=network,
                                                        compute=Compute.roofline("cpu")))
    # co-simulation costs the α–β network: NCCL's tuning model (a preset default) off here
    res = replay(c, network=network, protocol_latency=False, gpu_contention="off")
    # Replay issues a bucket at the grad-ready time of its last parameter, measured after the
    # Reducer's hook returned (a few ops after it issued the all_reduce inside that hook), and
    # replays compute per segment (forward, backward, ...) rather than per op; unused
    # parameters count as ready at the start of backward. So the two may differ slightly.
    assert res.iteration_time == pytest.approx(c.cosim_iteration_time, rel=0.05)
    assert res.mean_exposed_comm == pytest.approx(c.cosim_exposed_comm, rel=0.1, abs=1e-6)


@pytest.mark.parametrize("world,speed", [(4, {1: 0.5}), (8, {3: 0.7})])
def test_a_two_rank_capture_predicts_the_cosimulation_at_more_ranks_with_a_straggler(world, speed):
    network = Network.preset("gloo-loopback")
    sc = models.get("many_small_few_large")
    small = capture(sc, 2, timing=Timing(network=network, compute=Compute.roofline("cpu")))
    big = capture(sc, world, timing=Timing(network=network, compute=Compute.roofline("cpu"),
                                           rank_speed=speed))
    res = replay(small, world, network=network, rank_speed=speed)
    # this model's per-rank compute does not depend on the world size, so only the model's
    # approximations (see the test above) separate the two
    assert res.iteration_time == pytest.approx(big.cosim_iteration_time, rel=0.05)


def test_the_capture_recomputes_the_reducers_rebuilt_layout_with_torchs_own_bucketing(cap):
    assert cap.bucket_indices == [[11, 10, 9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]  # DDP's logging
    assert cap.buckets() == cap.bucket_indices
    sizes = [sum(cap.params[i].nbytes for i in b) for b in cap.bucket_indices]
    assert sizes == cap.bucket_bytes  # the all_reduce sizes in fakepg's trace
    assert cap.ready_order == [int(x) for x in
                               cap.logging_data["prev_iteration_grad_ready_order_indices"]
                               .split(",")]


def test_bucket_cap_mb_changes_the_number_of_bucket_all_reduces_as_compute_bucket_assignment_says(cap):
    counts = []
    for mb in (0.005, 0.02, 0.05, 25):
        cap_bytes = int(mb * 1024 * 1024)
        tensors = [torch.empty(cap.params[i].shape) for i in cap.ready_order]
        expected, _ = dist._compute_bucket_assignment_by_size(
            tensors, [cap_bytes, cap_bytes], [False] * len(tensors), cap.ready_order)
        res = replay(cap, 8, network=NET, bucket_cap_mb=mb)
        assert res.buckets == [list(b) for b in expected]
        assert _bucket_all_reduces(res) == len(expected)
        counts.append(len(expected))
    assert counts[0] > counts[1] > counts[2] > counts[3] == 1


def test_the_fp16_and_bf16_hooks_halve_the_communicated_bytes(cap):
    plain = replay(cap, 16, network=NET)
    for hook in ("fp16", "bf16"):
        half = replay(cap, 16, network=NET, comm_hook=hook)
        assert half.comm_bytes_per_iteration * 2 == plain.comm_bytes_per_iteration
        assert half.collectives_per_iteration == plain.collectives_per_iteration


def test_powersgd_sends_p_and_q_of_rank_r_per_matrix_and_the_vectors_uncompressed(cap):
    r = 2
    res = replay(cap, 16, network=NET, comm_hook="powersgd", powersgd_rank=r)
    for bucket, (unc, p, q) in zip(res.buckets, res.bucket_bytes):
        mats = [cap.params[i] for i in bucket if len(cap.params[i].shape) == 2]
        vecs = [cap.params[i] for i in bucket if len(cap.params[i].shape) == 1]
        assert unc == sum(v.nbytes for v in vecs)
        assert p == sum(m.shape[0] * r * 4 for m in mats)
        assert q == sum(m.shape[1] * r * 4 for m in mats)
    assert res.collectives_per_iteration == 3 * len(res.buckets)
    assert res.comm_bytes_per_iteration < replay(cap, 16, network=NET).comm_bytes_per_iteration / 4


@pytest.mark.parametrize("p", [2, 4])
def test_localsgd_period_divides_the_global_all_reduce_traffic_by_the_period(cap, p):
    net = Network.preset("100gbe", gpus_per_node=4)
    its = 2 * p
    plain = replay(cap, 16, network=net, iterations=its)
    local = replay(cap, 16, network=net, iterations=its, localsgd_period=p)
    # DDP: every gradient bucket, every iteration; LocalSGD: one average of all parameters
    # (the same bytes as one iteration's buckets) every p iterations; the rest stays in-node
    assert _global_bytes(plain) == its * cap.param_bytes
    assert _global_bytes(local) * p == _global_bytes(plain)
    n_global = sum(1 for c in local.collectives if c["members"] == 16)
    assert n_global == its // p
    assert sum(1 for c in plain.collectives if c["members"] == 16) == its * len(plain.buckets)
    slow = replay(cap, 16, network=net, iterations=its, slowmo_period=p)
    assert _global_bytes(slow) == _global_bytes(local)


@settings(max_examples=12, deadline=None)
@given(world=st.sampled_from([2, 8, 64, 256]), bw=st.floats(0.5, 100.0),
       more=st.floats(1.0, 20.0), mb=st.sampled_from([None, 0.005, 0.05]),
       hook=st.sampled_from([None, "fp16", "powersgd"]))
def test_more_bandwidth_is_never_slower_in_replay(cap, world, bw, more, mb, hook):
    slow = replay(cap, world, network=Network(bandwidth_GBps=bw, latency_us=5.0),
                  bucket_cap_mb=mb, comm_hook=hook)
    fast = replay(cap, world, network=Network(bandwidth_GBps=bw * more, latency_us=5.0),
                  bucket_cap_mb=mb, comm_hook=hook)
    assert fast.iteration_time <= slow.iteration_time * (1 + 1e-12)


def test_powersgd_p_and_q_all_reduces_keep_their_place_before_the_next_bucket(cap):
    # With NCCL the hook's futures complete when their collectives are enqueued, so bucket k's
    # whole then-chain (P and Q all_reduces) is enqueued on the communicator before bucket
    # k + 1's all_reduce, whatever the timing (co-simulation gives the same order). Replay once
    # let bucket 1's all_reduce overtake bucket 0's Q all_reduce when bucket 0's P callback
    # ended after the end of backward (5 GB/s: 596.08 us > 595.70 us) but not at 50 GB/s
    # (595.70 us, a tie), so the faster network was 4.7 us slower (881.25 vs 876.57 us).
    times = []
    for bw in (5.0, 50.0):
        res = replay(cap, 2, network=Network(bandwidth_GBps=bw, latency_us=5.0),
                     bucket_cap_mb=0.05, comm_hook="powersgd")
        names = [c["name"] for c in sorted(res.collectives, key=lambda c: c["seq"])]
        assert names == [f"dp0/b/0/{k}/{j}" for k in range(len(res.buckets)) for j in range(3)]
        starts = [c["start"] for c in sorted(res.collectives, key=lambda c: c["seq"])]
        assert starts == sorted(starts)
        times.append(res.iteration_time)
    assert times[1] <= times[0]


@settings(max_examples=12, deadline=None)
@given(world=st.sampled_from([2, 8, 64]), data=st.data(), factor=st.floats(0.05, 1.0),
       jitter=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 3))
def test_a_straggler_is_never_faster_in_replay(cap, world, data, factor, jitter, seed):
    rank = data.draw(st.integers(0, world - 1))
    base = replay(cap, world, network=NET, jitter=jitter, seed=seed)
    lag = replay(cap, world, network=NET, jitter=jitter, seed=seed, rank_speed={rank: factor})
    assert lag.iteration_time >= base.iteration_time * (1 - 1e-12)


def test_replay_is_deterministic_and_the_jitter_seed_changes_it(cap):
    kw = dict(network=NET, jitter=0.1, iterations=3, rank_speed={3: 0.7})
    a, b = replay(cap, 32, seed=5, **kw), replay(cap, 32, seed=5, **kw)
    assert a.to_json() == b.to_json()
    c = replay(cap, 32, seed=6, **kw)
    assert c.to_json() != a.to_json()
    assert c.iteration_times != a.iteration_times
    # without jitter the seed does not matter
    assert replay(cap, 32, network=NET, seed=1).iteration_times == \
        replay(cap, 32, network=NET, seed=2).iteration_times


def test_a_4096_rank_replay_runs(cap):
    res = replay(cap, 4096, network=Network.preset("ib-ndr", gpus_per_node=8),
                 comm_hook="fp16", rank_speed={4095: 0.9})
    assert res.world_size == 4096 and len(res.rank_collectives) == 4096
    assert all(n == res.rank_collectives[0] for n in res.rank_collectives)
    assert res.slowest_rank == [4095]
    assert res.iteration_time > replay(cap, 8, network=NET).iteration_time > 0


def test_a_joined_rank_shadows_every_bucket_all_reduce_and_the_join_all_reduce(cap):
    res = replay(cap, 4, network=NET, uneven={1: 1}, iterations=3)
    assert res.rank_collectives[1] == res.rank_collectives[0]  # joined rank 1 takes part in all
    names = [c["name"] for c in res.collectives]
    for it in range(3):
        assert f"dp0/join/{it}" in names
        assert sum(1 for n in names if n.startswith(f"dp0/b/{it}/")) == len(res.buckets)
    assert names[-2:] == ["dp0/join/final", "dp0/final"]
    tl = res.timeline
    bounds = tl.boundaries[1]
    assert not [s for s in tl.rank_spans(1, ("backward", "optimizer")) if s.start >= bounds[0]]


def test_shared_nic_contention_slows_two_groups_in_replay(cap):
    net = Network.preset("100gbe", gpus_per_node=2)
    apart = replay(cap, 16, network=net, groups=2)
    shared = replay(cap, 16, network=net, groups=2, shared_nic=True)
    assert shared.iteration_time > apart.iteration_time


def test_the_replay_timeline_agrees_with_the_result(cap, tmp_path):
    res = replay(cap, 8, network=NET, comm_hook="fp16", iterations=2, jitter=0.05)
    tl = res.timeline
    assert tl.iteration_times() == pytest.approx(res.iteration_times, rel=1e-12)
    assert tl.exposed_comm() == pytest.approx(res.exposed_comm, rel=1e-9, abs=1e-15)
    doc = tl.to_chrome_trace(tmp_path / "t.json")
    assert any(e.get("cat") == "comm" for e in doc["traceEvents"])
    assert tl.plot(tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0
    assert "iter" in tl.summary()


def test_a_captured_iteration_round_trips_through_json(cap, tmp_path):
    path = tmp_path / "cap.json"
    cap.save(path)
    again = CapturedIteration.load(path)
    assert again == cap
    assert replay(again, 64, network=NET).to_json() == replay(cap, 64, network=NET).to_json()


def test_sweep_rows_are_the_cartesian_product_of_the_knobs(cap):
    rows = sweep(cap, world_size=[8, 64], network=["100gbe", "ib-hdr"], comm_hook=[None, "fp16"])
    assert len(rows) == 8
    assert {(r["world_size"], r["network"], r["comm_hook"]) for r in rows} == {
        (w, n, h) for w in (8, 64) for n in ("100gbe", "ib-hdr") for h in (None, "fp16")}
    assert all(math.isfinite(r["iteration_time_s"]) and r["iteration_time_s"] > 0 for r in rows)
    res = replay(cap, 8, network=NET, iterations=2)
    assert len(res.to_csv().splitlines()) == 3
    assert json.loads(res.to_json())["iteration_times"] == res.iteration_times


# -- classes of identical ranks: one representative simulated per class ----------------------

IB8 = Network.preset("ib-ndr", gpus_per_node=8)
SLOW_LINKS = Network.preset("100gbe", gpus_per_node=4)  # NICs shared by 4 ranks

CLASS_CONFIGS = [
    pytest.param(64, dict(network=IB8), id="plain-64"),
    pytest.param(256, dict(network=IB8, rank_speed={3: 0.5, 17: 0.8, 200: 0.5}, iterations=2),
                 id="stragglers-256"),
    pytest.param(256, dict(network=NET, rank_speed={0: 1.5, 255: 0.6}), id="fast-and-slow-256"),
    pytest.param(64, dict(network=IB8, jitter=0.05, seed=7, iterations=2), id="noise-seeded-64"),
    pytest.param(128, dict(network=SLOW_LINKS, groups=4, shared_nic=True, rank_speed={6: 0.5}),
                 id="shared-slow-links-groups-128"),
    pytest.param(64, dict(network=SLOW_LINKS, groups=2, shared_nic=True, iterations=2),
                 id="shared-slow-links-64"),
    pytest.param(256, dict(network=IB8, comm_hook="fp16", rank_speed={9: 0.7}, bucket_cap_mb=0.01),
                 id="fp16-256"),
    pytest.param(64, dict(network=IB8, comm_hook="powersgd", powersgd_rank=2,
                          rank_speed={5: 0.7}, iterations=2), id="powersgd-64"),
    pytest.param(128, dict(network=IB8, localsgd_period=2, rank_speed={9: 0.6}, iterations=4),
                 id="localsgd-node-subgroups-128"),
    pytest.param(64, dict(network=IB8, slowmo_period=2, iterations=2), id="slowmo-64"),
    pytest.param(64, dict(network=NET, uneven={3: 1, 40: 2}, iterations=3, rank_speed={1: 0.9}),
                 id="uneven-join-64"),
]


@pytest.mark.parametrize("world,kw", CLASS_CONFIGS)
def test_replay_in_classes_equals_the_per_rank_simulation_exactly(cap, world, kw):
    from simddp.analysis.sweeps import row_figures

    fast = replay(cap, world, progress=False, **kw)
    slow = replay(cap, world, progress=False, per_rank=True, **kw)
    assert len(slow.timeline.class_lanes) == world  # the old path: one lane per rank
    if not kw.get("jitter"):  # noise draws per rank: every rank is a class of its own
        assert len(fast.timeline.class_lanes) < world // 2
    # every figure bit for bit (==, not approx)
    assert fast.iteration_times == slow.iteration_times
    assert fast.exposed_comm == slow.exposed_comm
    assert fast.slowest_rank == slow.slowest_rank
    assert fast.to_json() == slow.to_json()  # knobs, collectives, per-rank counts and bytes
    assert fast.rank_collectives == list(slow.rank_collectives)
    assert list(fast.rank_comm_bytes) == list(slow.rank_comm_bytes)
    a, b = fast.timeline, slow.timeline
    assert a.waits() == b.waits()
    assert [a.exposed_comm(r) for r in range(world)] == [b.exposed_comm(r) for r in range(world)]
    assert [a.iteration_times(r) for r in range(world)] == \
        [b.iteration_times(r) for r in range(world)]
    assert a.breakdown() == b.breakdown()  # per (iteration, rank) stats
    assert list(a.boundaries) == list(b.boundaries) and list(a.end_times) == list(b.end_times)
    assert a.spans == b.spans and a.comms == b.comms
    assert a.notable_ranks() == b.notable_ranks()
    assert a.summary() == b.summary() and a.to_csv() == b.to_csv()
    assert row_figures(a) == row_figures(b)
    assert fast.row() == slow.row()


def test_classes_are_deterministic_and_noise_keeps_per_rank_draws(cap):
    kw = dict(network=IB8, jitter=0.05, iterations=2, rank_speed={3: 0.5}, progress=False)
    a, b = replay(cap, 128, seed=11, **kw), replay(cap, 128, seed=11, **kw)
    assert a.to_json() == b.to_json()
    assert replay(cap, 128, seed=12, **kw).iteration_times != a.iteration_times
    # jitter draws factors per rank and segment (the model): no two ranks alike, no classes
    assert len(a.timeline.class_lanes) == 128
    plain = dict(network=IB8, rank_speed={3: 0.5}, progress=False)
    assert replay(cap, 128, **plain).to_json() == replay(cap, 128, **plain).to_json()


def test_a_million_rank_replay_simulates_a_few_classes_and_keeps_per_rank_views(cap):
    from simddp.analysis import PerRank

    n = 1_000_000
    res = replay(cap, n, network=IB8, rank_speed={17: 0.5, 999_999: 0.8}, progress=False)
    tl = res.timeline
    assert len(tl.class_lanes) == 4  # two captured profiles, two stragglers
    assert tl.classes() == [(0, 500_000), (1, 499_998), (17, 1), (999_999, 1)]  # odd: 2 out
    assert isinstance(res.rank_collectives, PerRank) and len(res.rank_collectives) == n
    assert res.rank_collectives[123_456] == res.rank_collectives[0] > 0
    assert res.slowest_rank == [17]
    assert tl.notable_ranks()[17].startswith("slowest")
    assert 999_999 in tl.notable_ranks()
    assert tl.iteration_times(17) == res.iteration_times
    assert len(tl.boundaries) == n and tl.boundaries[-1] == tl.boundaries[999_999]
    assert res.iteration_time > replay(cap, 4096, network=IB8, progress=False).iteration_time


def test_replay_reports_progress_without_changing_the_result(cap, capsys):
    seen = []
    res = replay(cap, 512, network=IB8, rank_speed={3: 0.5},
                 progress=lambda done, total, what: seen.append((done, total, what)))
    assert seen and seen[-1][0] == seen[-1][1] and "512 ranks as 3 classes" in seen[-1][2]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    shown = replay(cap, 512, network=IB8, rank_speed={3: 0.5}, progress=True)
    assert "replay: 512 ranks" in capsys.readouterr().err  # rich, on stderr
    assert shown.to_json() == res.to_json()
    replay(cap, 512, network=IB8)  # stderr is not a terminal here: no display by default
    assert capsys.readouterr().err == ""
