"""Specification of simddp.models.network: NCCL's α–β cost model, hierarchy, presets, calibration."""

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from fakepg import ops
from simddp.models.network import Network
from simddp.models.presets import PRESETS

# every name fakepg's op registry knows: trace names and their torch/c10d aliases
ALL_OPS = sorted({a for name in ops.names() for a in (name, *ops.get(name).aliases)})
COLLECTIVES = [op for op in ALL_OPS if ops.cost_kind(op) != "p2p"]

bandwidths = st.floats(min_value=0.1, max_value=1000.0)
latencies = st.floats(min_value=0.0, max_value=100.0)
sizes = st.integers(min_value=0, max_value=1 << 34)
ranks = st.integers(min_value=1, max_value=4096)


@st.composite
def networks(draw, hierarchical=None):
    hier = draw(st.booleans()) if hierarchical is None else hierarchical
    kw = {}
    algorithms = ["ring", "tree", "auto"]
    if hier:
        kw = dict(gpus_per_node=draw(st.integers(1, 16)), intra_bandwidth_GBps=draw(bandwidths),
                  intra_latency_us=draw(latencies),
                  nics_per_node=draw(st.none() | st.integers(1, 16)),
                  nvls_bandwidth_GBps=draw(st.none() | bandwidths))
        if kw["nvls_bandwidth_GBps"] is not None:
            algorithms.append("nvls")
    return Network(bandwidth_GBps=draw(bandwidths), latency_us=draw(latencies),
                   algorithm=draw(st.sampled_from(algorithms)), **kw)


# ---- flat formulas ------------------------------------------------------------------------------

@given(n=st.integers(1, 4096), nbytes=sizes, bw=bandwidths, lat=latencies)
def test_ring_allreduce_time_matches_nccl_formula_exactly(n, nbytes, bw, lat):
    net = Network(bandwidth_GBps=bw, latency_us=lat)
    alpha, bw_Bps = lat * 1e-6, bw * 1e9
    expected = 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw_Bps
    assert net.collective_time("all_reduce", nbytes, n) == expected


@pytest.mark.parametrize("op", ["all_gather", "all_gather_into_tensor", "reduce_scatter",
                                "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                                "gather", "scatter"])
def test_ring_all_gather_reduce_scatter_all_to_all_cost_n_minus_1_steps_and_fraction(op):
    net = Network(bandwidth_GBps=2.0, latency_us=10.0)
    n, S = 8, 8_000_000
    assert net.collective_time(op, S, n) == pytest.approx(7 * 10e-6 + 7 / 8 * S / 2e9, rel=1e-12)


@pytest.mark.parametrize("op", ["broadcast", "reduce"])
def test_broadcast_and_reduce_are_a_pipelined_chain(op):
    net = Network(bandwidth_GBps=4.0, latency_us=3.0)
    assert net.collective_time(op, 10**9, 16) == pytest.approx(15 * 3e-6 + 10**9 / 4e9, rel=1e-12)


def test_tree_allreduce_uses_log_latency_and_nccls_tree_bandwidth():
    net = Network(bandwidth_GBps=10.0, latency_us=5.0, algorithm="tree")
    # ceil(log2 100) = 7 levels, up and down; NCCL: tree busbw = 0.9 link bw, algbw = busbw * 0.5
    assert net.collective_time("all_reduce", 10**8, 100) == pytest.approx(
        2 * 7 * 5e-6 + 2 * 10**8 / (0.9 * 10e9), rel=1e-12)
    assert net.collective_time("all_reduce", 10**8, 2) == pytest.approx(
        2 * 1 * 5e-6 + 2 * 10**8 / (0.9 * 10e9), rel=1e-12)


def test_tree_wins_for_small_messages_at_scale_and_ring_for_large_ones():
    ring, tree = Network(25.0, 5.0), Network(25.0, 5.0, algorithm="tree")
    assert tree.collective_time("all_reduce", 1024, 512) < ring.collective_time("all_reduce", 1024, 512)
    assert ring.collective_time("all_reduce", 1 << 30, 512) < tree.collective_time("all_reduce", 1 << 30, 512)


@pytest.mark.parametrize("op", [op for op in ALL_OPS if ops.cost_kind(op) not in ("all_reduce", "barrier")])
def test_tree_changes_only_all_reduce_and_barrier_as_in_nccl(op):
    ring, tree = Network(25.0, 5.0), Network(25.0, 5.0, algorithm="tree")
    assert tree.collective_time(op, 12345678, 64) == ring.collective_time(op, 12345678, 64)


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("op", ["barrier", "monitored_barrier"])
def test_barrier_is_a_zero_byte_allreduce(op, algorithm):
    net = Network(12.5, 10.0, algorithm=algorithm)
    assert net.collective_time(op, 10**9, 32) == net.collective_time("all_reduce", 0, 32) > 0


@pytest.mark.parametrize("op", ["send", "recv"])
def test_send_and_recv_cost_one_step_and_the_bytes(op):
    net = Network(bandwidth_GBps=5.0, latency_us=7.0)
    assert net.collective_time(op, 5 * 10**9, 2) == pytest.approx(7e-6 + 1.0, rel=1e-12)


def test_send_recv_inside_a_node_uses_the_intra_link_and_across_nodes_the_inter_link():
    net = Network(bandwidth_GBps=10.0, latency_us=5.0, gpus_per_node=8,
                  intra_bandwidth_GBps=100.0, intra_latency_us=1.0)
    assert net.collective_time("send", 10**9, 8) == pytest.approx(1e-6 + 10**9 / 100e9, rel=1e-12)
    assert net.collective_time("send", 10**9, 9) == pytest.approx(5e-6 + 10**9 / 10e9, rel=1e-12)


@given(net=networks(), op=st.sampled_from(COLLECTIVES), nbytes=sizes)
def test_single_rank_collective_costs_nothing(net, op, nbytes):
    assert net.collective_time(op, nbytes, 1) == 0.0


@pytest.mark.parametrize("alias, canonical", [
    ("allreduce", "all_reduce"), ("all_reduce_coalesced", "all_reduce"),
    ("_allgather_base", "all_gather"), ("all_gather_into_tensor", "all_gather"),
    ("_reduce_scatter_base", "reduce_scatter"), ("alltoall_base", "all_to_all"),
    ("isend", "send"), ("irecv", "recv")])
def test_c10d_and_torch_distributed_names_of_one_collective_cost_the_same(alias, canonical):
    net = Network.preset("ib-hdr", gpus_per_node=4)
    for n in (2, 4, 24):
        assert net.collective_time(alias, 3 << 20, n) == net.collective_time(canonical, 3 << 20, n)


# ---- monotonicity (properties) -------------------------------------------------------------------

@settings(max_examples=300)
@given(net=networks(), op=st.sampled_from(ALL_OPS), nbytes=sizes, n=ranks,
       more=st.floats(1.0, 100.0), intra_more=st.floats(1.0, 100.0))
def test_more_bandwidth_is_never_slower(net, op, nbytes, n, more, intra_more):
    faster = net.with_(bandwidth_GBps=net.bandwidth_GBps * more)
    if net.gpus_per_node is not None:
        faster = faster.with_(intra_bandwidth_GBps=net.intra_bandwidth_GBps * intra_more)
    assert faster.collective_time(op, nbytes, n) <= net.collective_time(op, nbytes, n)


@settings(max_examples=300)
@given(net=networks(), op=st.sampled_from(ALL_OPS), nbytes=sizes, n=ranks,
       extra=st.floats(0.0, 100.0))
def test_more_latency_is_never_faster(net, op, nbytes, n, extra):
    slower = net.with_(latency_us=net.latency_us + extra)
    if net.gpus_per_node is not None:
        slower = slower.with_(intra_latency_us=net.intra_latency_us + extra)
    assert slower.collective_time(op, nbytes, n) >= net.collective_time(op, nbytes, n)


@settings(max_examples=300)
@given(net=networks(), op=st.sampled_from(COLLECTIVES), n=ranks, extra=st.integers(0, 4096))
def test_more_ranks_never_reduce_latency_term(net, op, n, extra):
    # with 0 bytes only the latency term is left
    assert net.collective_time(op, 0, n + extra) >= net.collective_time(op, 0, n)


@settings(max_examples=300)
@given(net=networks(), op=st.sampled_from(ALL_OPS), nbytes=sizes, n=ranks, extra=sizes)
def test_more_bytes_are_never_faster(net, op, nbytes, n, extra):
    assert net.collective_time(op, nbytes + extra, n) >= net.collective_time(op, nbytes, n)


# ---- hierarchy ----------------------------------------------------------------------------------

@given(op=st.sampled_from(ALL_OPS), nbytes=sizes, n=st.integers(1, 8),
       inter_bw=bandwidths, inter_lat=latencies)
def test_hierarchical_topology_uses_intra_link_within_a_node(op, nbytes, n, inter_bw, inter_lat):
    hier = Network(bandwidth_GBps=inter_bw, latency_us=inter_lat, gpus_per_node=8,
                   intra_bandwidth_GBps=300.0, intra_latency_us=1.5)
    intra_only = Network(bandwidth_GBps=300.0, latency_us=1.5)
    assert hier.collective_time(op, nbytes, n) == intra_only.collective_time(op, nbytes, n)


def test_hierarchical_allreduce_is_nccls_pipelined_ring_and_tree_through_all_ranks():
    # Changed in the presets/auto work: this used to assert intra reduce_scatter + inter
    # all_reduce of S/g + intra all_gather (times added). NCCL's ring and tree run through all
    # ranks at once, every NVLink and NIC busy together, so the bandwidth is the slowest
    # resource's and the latency counts NCCL's tuning.cc steps.
    net = Network(bandwidth_GBps=25.0, latency_us=5.0, gpus_per_node=8,
                  intra_bandwidth_GBps=450.0, intra_latency_us=2.0)
    S, n, g, N = 1 << 28, 32, 8, 4
    a, b, ai, bi = 5e-6, 25e9, 2e-6, 450e9
    bw = min(bi, g * b)  # 8 NICs of 25 GB/s = 200 GB/s per node < 450 GB/s NVLink
    ring = (2 * (n - 1) - 2 * N) * ai + 2 * N * a + 2 * (n - 1) / n * S / bw
    assert net.collective_time("all_reduce", S, n) == pytest.approx(ring, rel=1e-12)
    assert net.collective_time("reduce_scatter", S, n) == pytest.approx(
        (n - N) * ai + (N - 1) * a + (n - 1) / n * S / bw, rel=1e-12)
    tree = net.with_(algorithm="tree")
    assert tree.collective_time("all_reduce", S, n) == pytest.approx(
        2 * (g - 1) * ai + 2 * 2 * a + 2 * S / (0.9 * bw), rel=1e-12)


def test_hierarchical_all_to_all_charges_each_peer_on_its_own_link():
    net = Network(bandwidth_GBps=10.0, latency_us=5.0, gpus_per_node=4,
                  intra_bandwidth_GBps=100.0, intra_latency_us=1.0)
    S, n = 1 << 24, 16
    assert net.collective_time("all_to_all", S, n) == pytest.approx(
        3 * 1e-6 + 12 * 5e-6 + 3 / 16 * S / 100e9 + 12 / 16 * S / 10e9, rel=1e-12)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                "reduce", "all_to_all", "gather", "scatter"])
def test_hierarchy_with_equal_links_keeps_the_flat_bandwidth_term(op):
    flat = Network(bandwidth_GBps=10.0, latency_us=0.0)
    hier = flat.with_(gpus_per_node=8)
    assert hier.collective_time(op, 1 << 30, 64) == pytest.approx(
        flat.collective_time(op, 1 << 30, 64), rel=1e-12)


def test_hierarchical_ring_allreduce_latency_counts_nccls_steps():
    # Changed: a hierarchical ring used to cost (7 + 2·7 + 7) steps at 64 ranks (as if it were
    # reduce_scatter / inter-node all_reduce / all_gather). NCCL's ring has 2(n−1) steps, 2N of
    # them crossing nodes (tuning.cc nInterSteps), which is why NCCL switches to trees at scale.
    flat = Network(bandwidth_GBps=10.0, latency_us=5.0)
    hier = flat.with_(gpus_per_node=8, intra_latency_us=1.0)
    assert flat.collective_time("all_reduce", 0, 64) == pytest.approx(2 * 63 * 5e-6)
    assert hier.collective_time("all_reduce", 0, 64) == pytest.approx((126 - 16) * 1e-6 + 16 * 5e-6)
    # the tree: a chain of 7 inside each node, log2(8) = 3 levels across, up and down
    assert hier.with_(algorithm="tree").collective_time("all_reduce", 0, 64) == pytest.approx(
        2 * 7 * 1e-6 + 2 * 3 * 5e-6)


def test_bus_bandwidth_approaches_link_bandwidth_for_large_ring_messages():
    net = Network(bandwidth_GBps=25.0, latency_us=5.0)
    S, n = 1 << 34, 16
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"):
        busbw = Network.bus_bandwidth_factor(op, n) * S / net.collective_time(op, S, n)
        assert busbw == pytest.approx(25e9, rel=1e-3), op
    assert Network.bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert Network.bus_bandwidth_factor("all_gather_into_tensor", 4) == 0.75
    assert Network.bus_bandwidth_factor("broadcast", 4) == 1.0


# ---- calibration --------------------------------------------------------------------------------

@settings(max_examples=50)
@given(bw=st.floats(0.5, 500.0), lat=st.floats(0.5, 100.0),
       algorithm=st.sampled_from(["ring", "tree"]),
       op=st.sampled_from(["all_reduce", "all_gather", "broadcast", "all_to_all", "send"]))
def test_calibrate_recovers_known_parameters(bw, lat, algorithm, op):
    true = Network(bandwidth_GBps=bw, latency_us=lat, algorithm=algorithm)
    data = [(s, n, true.collective_time(op, s, n))
            for s in (0, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28) for n in (2, 4, 8)]
    fit = Network.calibrate(data, op=op, algorithm=algorithm)
    assert fit.bandwidth_GBps == pytest.approx(bw, rel=1e-6)
    assert fit.latency_us == pytest.approx(lat, rel=1e-6)
    assert fit.algorithm == algorithm


def test_calibrate_from_noisy_measurements_is_close():
    true = Network.preset("gloo-loopback")
    rng = random.Random(0)
    data = [(s, n, true.collective_time("all_reduce", s, n) * rng.uniform(0.97, 1.03))
            for s in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 26) for n in (2, 4) for _ in range(3)]
    fit = Network.calibrate(data)
    assert fit.bandwidth_GBps == pytest.approx(true.bandwidth_GBps, rel=0.05)
    assert fit.latency_us == pytest.approx(true.latency_us, rel=0.1)


def test_calibrate_rejects_measurements_that_cannot_separate_latency_from_bandwidth():
    net = Network(10.0, 5.0)
    one_size = [(1 << 20, 4, net.collective_time("all_reduce", 1 << 20, 4))] * 3
    with pytest.raises(ValueError, match="two or more message sizes"):
        Network.calibrate(one_size)
    with pytest.raises(ValueError, match="nranks >= 2"):
        Network.calibrate([(1 << 20, 1, 1e-3), (1 << 22, 1, 2e-3)])
    with pytest.raises(ValueError, match="do not grow with message size"):
        Network.calibrate([(1 << 10, 4, 2e-3), (1 << 26, 4, 1e-3)])


# ---- presets and validation ---------------------------------------------------------------------

def test_unknown_preset_error_lists_known_presets():
    with pytest.raises(ValueError) as err:
        Network.preset("infiniband-xdr")
    for name in ("nvlink", "ib-hdr", "ib-ndr", "100gbe", "400gbe", "gloo-loopback", "dgx1-v100",
                 "dgx-a100", "dgx-h100", "dgx-b200"):
        assert name in str(err.value)


@pytest.mark.parametrize("name, GBps", [("nvlink", 450.0), ("ib-hdr", 25.0), ("ib-ndr", 50.0),
                                        ("100gbe", 12.5), ("400gbe", 50.0)])
def test_presets_have_their_fabrics_line_rate(name, GBps):
    net = Network.preset(name)
    assert (net.name, net.bandwidth_GBps, net.gpus_per_node) == (name, GBps, None)


def test_every_preset_is_defined_once_and_builds_a_network_named_after_it():
    # one table (simddp.models.presets.PRESETS); Network.preset(name) is the only way in, so a
    # new preset is one entry there, and the fabrics the docs name stay among them
    for name in PRESETS:
        assert Network.preset(name).name == name
    assert set(PRESETS) >= {"nvlink", "ib-hdr", "ib-ndr", "100gbe", "400gbe", "gloo-loopback",
                            "dgx1-p100", "dgx1-v100", "dgx-a100", "dgx-h100", "dgx-b200",
                            "pcie-server"}
    assert not [f.__name__ for f in PRESETS.values() if hasattr(Network, f.__name__)]  # no second way


@pytest.mark.parametrize("name", ["ib-hdr", "ib-ndr", "100gbe", "400gbe"])
def test_multi_node_preset_with_gpus_per_node_puts_nvlink_inside_nodes(name):
    net = Network.preset(name, gpus_per_node=8)
    nvl = Network.preset("nvlink")
    assert (net.gpus_per_node, net.intra_bandwidth_GBps) == (8, nvl.bandwidth_GBps)
    assert net.collective_time("all_reduce", 1 << 26, 8) == nvl.collective_time("all_reduce", 1 << 26, 8)
    assert net.collective_time("all_reduce", 1 << 26, 16) > nvl.collective_time("all_reduce", 1 << 26, 16)


def test_preset_keywords_override_fields():
    net = Network.preset("100gbe", algorithm="tree", latency_us=30.0, gpus_per_node=4,
                         intra_bandwidth_GBps=64.0)
    assert (net.algorithm, net.latency_us, net.intra_bandwidth_GBps) == ("tree", 30.0, 64.0)
    with pytest.raises(ValueError, match="accepted: bandwidth_GBps"):
        Network.preset("ib-hdr", bandwith_GBps=1.0)


@pytest.mark.parametrize("kw, message", [
    (dict(bandwidth_GBps=0.0, latency_us=1.0), "bandwidth_GBps must be a finite number > 0"),
    (dict(bandwidth_GBps=-1.0, latency_us=1.0), "bandwidth_GBps must be"),
    (dict(bandwidth_GBps=math.inf, latency_us=1.0), "bandwidth_GBps must be"),
    (dict(bandwidth_GBps=1.0, latency_us=-1.0), "latency_us must be a finite number >= 0"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, algorithm="butterfly"), "'ring', 'tree', 'nvls', 'auto'"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, algorithm="nvls"), "needs NVLink SHARP"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, gpus_per_node=8, algorithm="nvls"), "needs NVLink SHARP"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, nics_per_node=4), "pass gpus_per_node"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, gpus_per_node=8, nics_per_node=0), "nics_per_node must be an int"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, gpus_per_node=0), "gpus_per_node must be an int"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, intra_bandwidth_GBps=300.0), "pass gpus_per_node"),
    (dict(bandwidth_GBps=1.0, latency_us=1.0, gpus_per_node=8, intra_bandwidth_GBps=0.0),
     "intra_bandwidth_GBps must be"),
])
def test_invalid_parameters_raise_errors_that_say_what_to_do(kw, message):
    with pytest.raises(ValueError, match=message):
        Network(**kw)


def test_unknown_collective_error_lists_known_ones():
    with pytest.raises(ValueError, match="unknown collective 'allreduce_sum'.*all_reduce"):
        Network(1.0, 1.0).collective_time("allreduce_sum", 1, 2)
    with pytest.raises(ValueError, match="nranks must be an integer >= 1"):
        Network(1.0, 1.0).collective_time("all_reduce", 1, 0)
