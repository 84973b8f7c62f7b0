"""The cost mechanisms of replay (docs/costs.md): each one switched on against a closed form,
in the right direction and by the right amount, on both engines; each off by default."""

import math

import pytest

from fakepg import zoo as models
from simddp import Compute, Network, Timing
from simddp.models.contention import NCCL_BASE_LATENCY_US
from simddp.models.gpu_contention import gpu_contention
from simddp.models.host import HostLoader, core_share_slowdown
from simddp.models.nccl_latency import ProtocolLatency
from simddp.models.syncs import METRIC_BYTES
from simddp.replay import CapturedIteration, replay
from simddp import capture

NET = Network(bandwidth_GBps=1.0, latency_us=20.0, algorithm="ring")
FREE = Network(bandwidth_GBps=1e9, latency_us=0.0, algorithm="ring")  # communication ~ free


@pytest.fixture(scope="module")
def cap() -> CapturedIteration:
    # the mlp at 20 KiB buckets, every op 0.1 ms: three bucket all_reduces per iteration
    return capture(models.get("mlp", bucket_cap_mb=0.02), 1,
                   timing=Timing(network=NET, compute=Compute.constant(1e-4)))


def _it(cap, world=2, net=NET, engine="simpy", **kw) -> float:
    return replay(cap, world, network=net, engine=engine, progress=False, **kw).iteration_time


def _host_spans(res) -> list:
    return [s for s in res.timeline.rank_spans(0) if s.kind == "host"]


ENGINES = ["simpy", "vector"]


def test_the_capture_knows_its_batch_size(cap):
    assert cap.batch_size == models.get("mlp").inputs(0, 1)[0][0].shape[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_loader_slower_than_the_step_paces_the_iteration_at_its_batch_period(cap, engine):
    base = _it(cap, engine=engine)
    b = cap.batch_size
    # per sample so that 2 workers deliver a batch every 3 × the step
    per_sample_us = 3 * base * 2 / b * 1e6
    res = replay(cap, 2, network=NET, engine=engine, progress=False,
                 host_per_sample_us=per_sample_us, loader_workers=2)
    assert res.iteration_time == pytest.approx(b * per_sample_us * 1e-6 / 2, rel=1e-12)
    assert res.iteration_time == pytest.approx(3 * base, rel=1e-12)
    [span] = _host_spans(res)
    assert span.name == "data loading (waiting for the loader)"
    assert span.end - span.start == pytest.approx(2 * base, rel=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_loader_faster_than_the_step_costs_nothing(cap, engine):
    base = _it(cap, engine=engine)
    assert _it(cap, engine=engine, host_per_sample_us=1.0, loader_workers=8) == base


def test_main_process_loading_adds_the_batch_to_every_iteration(cap):
    base = _it(cap)
    b = cap.batch_size
    assert _it(cap, host_per_sample_us=500.0) == pytest.approx(base + b * 500e-6, rel=1e-12)


def test_loaders_of_ranks_sharing_a_nodes_cores_run_on_their_share():
    # 8 ranks, 4 workers each, on 16 cores: 2 cores per rank, so a batch every B·c/2
    loader = HostLoader(per_sample_us=100.0, workers=4, host_cores=16, ranks_per_host=8)
    assert loader.period(32) == pytest.approx(32 * 100e-6 / 2)
    assert HostLoader(per_sample_us=100.0, workers=4).period(32) == pytest.approx(32 * 100e-6 / 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_four_single_threaded_ranks_on_two_cores_compute_at_half_speed(cap, engine):
    base = _it(cap, 4, FREE, engine)
    shared = _it(cap, 4, FREE, engine, host_cores=2, ranks_per_host=4, rank_threads=1.0)
    assert shared == pytest.approx(2 * base, rel=1e-6)
    # two ranks on two cores: each has its core
    assert _it(cap, 2, FREE, engine, host_cores=2, ranks_per_host=4, rank_threads=1.0) == \
        _it(cap, 2, FREE, engine)
    assert core_share_slowdown(4, 1.0, 2) == 2.0


@pytest.mark.parametrize("engine", ENGINES)
def test_each_host_sync_adds_its_cost(cap, engine):
    base = _it(cap, engine=engine)
    assert _it(cap, engine=engine, sync_points=3, sync_us=40.0) == pytest.approx(
        base + 3 * 40e-6, rel=1e-12)
    # the default: 10 µs
    assert _it(cap, engine=engine, sync_points=1) == pytest.approx(base + 10e-6, rel=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_metric_all_reduce_adds_one_latency_bound_collective(cap, engine):
    base = _it(cap, engine=engine)
    one = NET.collective_time("all_reduce", METRIC_BYTES, 2)
    assert _it(cap, engine=engine, metric_allreduces=2) == pytest.approx(base + 2 * one,
                                                                          rel=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_without_overlap_every_bucket_waits_for_the_end_of_backward(cap, engine):
    res = replay(cap, 2, network=NET, engine=engine, progress=False)
    flat = replay(cap, 2, network=NET, engine=engine, progress=False, overlap=False)
    assert flat.iteration_time > res.iteration_time
    # closed form: the step's compute, then the buckets' all_reduces back to back
    comm = sum(NET.collective_time("all_reduce", sum(b), 2) for b in flat.bucket_bytes)
    compute = replay(cap, 1, network=NET, progress=False).iteration_time
    assert flat.iteration_time == pytest.approx(compute + comm, rel=1e-9)
    assert flat.exposed_comm[0] == pytest.approx(comm, rel=1e-9)


def test_nccl_tuning_model_is_ll_for_small_and_simple_for_large_messages():
    # a flat fabric: every rank its own node (N = n = 8, one rank a node), NCCL's ring
    inner = Network(bandwidth_GBps=10.0, latency_us=5.0, algorithm="ring")
    net = ProtocolLatency(inner)
    beta = lambda s: 2 * 7 / 8 * s / 10e9  # noqa: E731 - the ring's bandwidth term
    # tuning.cc: 2(n-1) = 14 steps, 2N = 16 across nodes (-2 inside, NCCL's own count); LL:
    # baseLat 6.6, the inside steps at the 1 µs net overhead, 2.7 µs a network step, 1/4 of
    # the bus bandwidth
    assert net.chosen("all_reduce", 64, 8) == ("ring", "LL")
    assert net.collective_time("all_reduce", 64, 8) == pytest.approx(
        (6.6 - 2 * 1.0 + 16 * 2.7) * 1e-6 + 4 * beta(64), rel=1e-12)
    # Simple: 8.4 + (-2)·max(3.4, 3·1) + 16·14 µs, × 1.4 (the ring's plateau) once each rank's
    # share of a channel is 64 bytes; the full bandwidth
    big = 1 << 28
    assert net.chosen("all_reduce", big, 8) == ("ring", "Simple")
    assert net.collective_time("all_reduce", big, 8) == pytest.approx(
        (8.4 - 2 * 3.4 + 16 * 14.0) * 1.4e-6 + beta(big), rel=1e-12)
    assert net.collective_time("all_reduce", 1 << 20, 1) == 0.0  # one rank: nothing


def test_a_measured_model_gets_nccls_base_latency_added():
    from simddp.models import MeasuredNetwork
    rows = [{"op": "all_reduce", "world_size": 8, "bytes": b, "seconds": s}
            for b, s in [(1 << 10, 1e-4), (1 << 30, 1e-2)]]
    inner = MeasuredNetwork(rows)
    net = ProtocolLatency(inner)
    # measured times hold their own latency: only NCCL's fixed cost of the cheapest protocol
    assert net.collective_time("all_reduce", 1 << 30, 8) == pytest.approx(
        inner.collective_time("all_reduce", 1 << 30, 8) + 8.4e-6, rel=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_protocol_latency_costs_each_bucket_with_nccls_tuning_model(cap, engine):
    base = replay(cap, 2, network=NET, engine=engine, progress=False, overlap=False)
    more = replay(cap, 2, network=NET, engine=engine, progress=False, overlap=False,
                  protocol_latency=True)
    # per bucket, back to back after backward: NCCL's time for it instead of the α–β one
    tuned = ProtocolLatency(NET)
    extra = [tuned.collective_time("all_reduce", sum(b), 2)
             - NET.collective_time("all_reduce", sum(b), 2) for b in base.bucket_bytes]
    # 2 ranks on 2 "nodes": LL128 (14 - 2·1.9 + 4·4.0 = 26.2 µs, 0.7 of the bandwidth at one
    # rank a node) beats Simple (8.4 - 2·3.4 + 4·14 = 57.6 µs) on these 20 KiB buckets
    assert {tuned.chosen("all_reduce", sum(b), 2) for b in base.bucket_bytes} == \
        {("ring", "LL128")}
    assert more.iteration_time - base.iteration_time == pytest.approx(sum(extra), rel=1e-9)


def test_gpu_contention_presets_are_the_sm_share_of_ncclcs_channels():
    assert gpu_contention("v100").slowdown == pytest.approx(80 / (80 - 8))
    assert gpu_contention("a100").slowdown == pytest.approx(108 / (108 - 24))
    assert gpu_contention("h100").slowdown == pytest.approx(132 / (132 - 24))
    assert gpu_contention("a100:8").slowdown == pytest.approx(108 / 100)
    with pytest.raises(ValueError, match="unknown GPU 'tpu'.*v100, a100, h100"):
        gpu_contention("tpu")


def test_gpu_contention_without_overlap_costs_the_launch_of_each_collective(cap):
    # no collective overlaps compute, so only the launches on the compute stream cost: the
    # buckets are issued back to back after backward, each launch after the previous one;
    # the first delays the all_reduces, the others hide behind the one running (each longer
    # than a launch)
    base = replay(cap, 2, network=NET, progress=False, overlap=False)
    cont = replay(cap, 2, network=NET, progress=False, overlap=False, gpu_contention="v100")
    launch = NCCL_BASE_LATENCY_US * 1e-6
    assert all(c["end"] - c["start"] > launch for c in base.collectives)
    assert cont.iteration_time - base.iteration_time == pytest.approx(launch, rel=1e-9)
    # with overlap, compute beside communication slows: never faster than without contention
    assert replay(cap, 2, network=NET, progress=False, gpu_contention="v100").iteration_time \
        > replay(cap, 2, network=NET, progress=False).iteration_time


def test_the_host_mechanisms_are_off_by_default_and_bad_values_are_named(cap):
    from simddp.program import Knobs
    k = Knobs()
    assert (k.overlap, k.host_per_sample_us, k.sync_points, k.metric_allreduces,
            k.protocol_latency, k.gpu_contention, k.rank_threads) == \
        (True, 0.0, 0, 0, None, None, None)
    with pytest.raises(ValueError, match="loader_workers"):
        replay(cap, 2, network=NET, progress=False, host_per_sample_us=1.0, loader_workers=-1)
    with pytest.raises(ValueError, match="rank_threads needs host_cores"):
        replay(cap, 2, network=NET, progress=False, rank_threads=1.0)
    with pytest.raises(ValueError, match="sync_points"):
        replay(cap, 2, network=NET, progress=False, sync_points=-1)


def test_nccl_and_the_gpus_contention_are_on_by_default_on_a_gpu_preset():
    from simddp.program import Knobs
    dgx = Network.preset("dgx-h100")
    on = Knobs().checked(16, dgx).network
    assert isinstance(on, ProtocolLatency)
    assert on.contention == gpu_contention("h100")  # SM share and launch cost of NCCL on H100
    off = Knobs(protocol_latency=False, gpu_contention="off").checked(16, dgx).network
    assert off is dgx
    # a NIC preset runs NCCL (its tuning model) but names no GPU (no SM share); gloo, neither
    ib = Knobs().checked(16, Network.preset("ib-ndr", gpus_per_node=8)).network
    assert isinstance(ib, ProtocolLatency) and ib.contention is None
    gloo = Network.preset("gloo-loopback")
    assert Knobs().checked(4, gloo).network is gloo
    assert Knobs().checked(4, NET).network is NET  # a Network you build: α–β as written


def test_the_mechanisms_switched_on_are_columns_of_the_row(cap):
    res = replay(cap, 2, network=NET, progress=False, sync_points=1, overlap=False)
    assert res.knobs["sync_points"] == 1 and res.knobs["overlap"] is False
    assert "host_per_sample_us" not in replay(cap, 2, network=NET, progress=False).knobs
    assert math.isfinite(res.iteration_time)


def test_the_cost_flags_of_simddp_replay_reach_the_rows(cap, tmp_path):
    import json

    from simddp.cli import main

    path = tmp_path / "capture.json"
    cap.save(path)
    out = tmp_path / "rows.json"
    assert main(["replay", str(path), "--world-size", "2", "--network", "100gbe",
                 "--no-overlap", "--sync-points", "2", "--sync-us", "5", "--protocol-latency",
                 "--no-progress", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert (row["overlap"], row["sync_points"], row["sync_us"], row["protocol_latency"]) == \
        (False, 2, 5.0, True)
    plain = replay(cap, 2, network="100gbe", progress=False, overlap=False, sync_points=2,
                   sync_us=5.0, protocol_latency=True)
    assert row["iteration_time_s"] == plain.iteration_time
