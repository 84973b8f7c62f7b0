"""Communication at scale: NCCL's tuning model (algorithm and protocol by size and scale), the
fabric as tiers with a Placement of each mesh dimension on them, and communicators that share
a node's NICs — each against a closed form from NCCL's tuning.cc or the fabric's layout."""

import pytest

from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.models import collective_time
from simddp.models.nccl_latency import ProtocolLatency, tuned
from simddp.models.placement import Placement, Tier, placement_of, placements_of_codes
from simddp.program.parallel import Parallel
from simddp import capture
from simddp.replay import replay

IB = Network.preset("ib-ndr", gpus_per_node=8)   # NVLink 450 GB/s inside, 8 × 50 GB/s NICs
DGX = Network.preset("dgx-h100")
POD = Network.preset("dgx-superpod")             # DGX H100 nodes, SUs of 32 nodes (256 GPUs)
KIB, GIB = 1 << 10, 1 << 30


# ---- NCCL's tuning model: closed forms from tuning.cc --------------------------------------

def test_a_small_all_reduce_across_two_nodes_is_tree_ll_at_tuning_cc_latency():
    net = ProtocolLatency(IB)
    # N = 2 nodes of ppn = 8: tree latency 6.8 + 2·((8−1)·0.6 + ⌊log2 2⌋·5.0) µs; LL moves
    # the bytes at min(bus/3.8, llMaxBw = 39 GB/s for 2 Intel nodes), ÷ treeCorrection
    # (LL, 1 KiB: log2(1024/64) = 4 → 0.9)
    bus = 0.9 * 400e9  # tree's 0.9 of min(NVLink 450, the node's 8 × 50 GB/s)
    beta = max(3.8 * 2 * KIB / bus, 2 * KIB / 39e9) / 0.9
    assert net.chosen("all_reduce", KIB, 16) == ("tree", "LL")
    assert net.collective_time("all_reduce", KIB, 16) == pytest.approx(
        (6.8 + 2 * (7 * 0.6 + 1 * 5.0)) * 1e-6 + beta, rel=1e-12)


def test_a_large_all_reduce_across_two_nodes_is_ring_simple_with_its_plateau():
    net = ProtocolLatency(IB)
    # ring: 2(n−1) = 30 steps, 2N = 4 across nodes; Simple's 8.4 µs base, inside steps at
    # max(3.4, 3 × 1 µs net overhead), 14 µs a network step, × 1.4 (plateau, Hopper/Ampere)
    lat = (8.4 + (30 - 4) * 3.4 + 4 * 14.0) * 1.4e-6
    assert net.chosen("all_reduce", GIB, 16) == ("ring", "Simple")
    assert net.collective_time("all_reduce", GIB, 16) == pytest.approx(
        lat + 2 * 15 / 16 * GIB / 400e9, rel=1e-12)


def test_the_algorithm_switches_where_tuning_cc_says():
    net = ProtocolLatency(IB)
    # inside one node NCCL's tree is a chain: ring wins even when small
    assert net.chosen("all_reduce", KIB, 8)[0] == "ring"
    # across nodes: tree for small messages (log-depth latency), ring for large
    sizes = [1 << k for k in range(10, 31, 2)]
    algos = [net.chosen("all_reduce", s, 16)[0] for s in sizes]
    assert algos[0] == "tree" and algos[-1] == "ring"
    switch = algos.index("ring")
    assert all(a == "tree" for a in algos[:switch]) and all(a == "ring" for a in algos[switch:])
    # the protocols: LL for the smallest, Simple for the largest
    assert net.chosen("all_reduce", 64, 16)[1] == "LL"
    assert net.chosen("all_reduce", GIB, 16)[1] == "Simple"
    # at scale tree holds on to larger messages: its latency grows with log2 N, the ring's
    # with n
    at = lambda n: max(s for s in sizes if net.chosen("all_reduce", s, n)[0] == "tree")  # noqa
    assert at(1024) > at(16)


def test_nvls_inside_an_h100_nvlink_domain_and_not_for_one_member_a_node():
    net = ProtocolLatency(DGX)
    assert net.chosen("all_reduce", GIB, 8) == ("nvls", "Simple")
    # NVLS: its 23 µs NVLink step, the bytes at NVLS's algorithm bandwidth
    assert tuned(DGX, "all_reduce", GIB, 8)[0] == pytest.approx(
        23e-6 + GIB / (DGX.nvls_bandwidth_GBps * 1e9), rel=1e-12)
    # two nodes: NVLS tree; one member a node (nothing to reduce in the switch): no NVLS
    assert net.chosen("all_reduce", GIB, 16)[0] == "nvls_tree"
    assert net.placed(1).chosen("all_reduce", GIB, 16)[0] in ("ring", "tree")
    # all_gather / reduce_scatter stay on rings (NCCL's NVLS ones lose, nccl#1083)
    assert net.chosen("all_gather_into_tensor", GIB, 8)[0] == "ring"


def test_collnet_is_a_candidate_only_on_a_sharp_fabric():
    plain = ProtocolLatency(IB)
    sharp = ProtocolLatency(IB.with_(collnet=True))
    algos = lambda net: {net.chosen("all_reduce", 1 << k, 1024)[0] for k in range(10, 31)}  # noqa
    assert not any(a.startswith("collnet") for a in algos(plain))
    assert any(a.startswith("collnet") for a in algos(sharp))
    # never slower with one more candidate
    assert all(sharp.collective_time("all_reduce", 1 << k, 1024)
               <= plain.collective_time("all_reduce", 1 << k, 1024) for k in range(10, 31))


def test_fsdp_all_gathers_grow_latency_bound_with_the_group():
    # a layer's all_gather of a fixed size on ever more ranks: the bandwidth term stays, the
    # steps grow (n−1 ring steps): the time per collective grows with n
    net = ProtocolLatency(Network.preset("dgx-a100"))
    S = 64 << 20
    times = [net.collective_time("all_gather_into_tensor", S, n) for n in (64, 256, 1024, 4096)]
    assert times == sorted(times) and times[-1] > 2 * times[0]


# ---- the fabric as tiers, and the Placement of a mesh dimension on it --------------------

def test_fsdp32_tp8_places_tp_inside_a_node_and_shards_across_32_nodes():
    mesh = Parallel.parse("fsdp:32,tp:8", 256).mesh()
    assert mesh.placement(0, "tp", POD) == Placement(per_node=8, spans=(1,))
    assert mesh.placement(3, "shard", POD) == Placement(per_node=1, spans=(1,))
    assert sorted({p.per_node for p in mesh.placements("shard", POD)}) == [1]
    # 64 × 8 ranks: the shard groups span two scalable units
    big = Parallel.parse("fsdp:64,tp:8", 512).mesh()
    assert big.placement(5, "shard", POD) == Placement(per_node=1, spans=(2,))
    # the vectorised form agrees with the per-communicator one, communicator by communicator
    codes, ncode = big.codes("shard")
    per_code = placements_of_codes(codes, ncode, POD)
    for r in (0, 5, 511):
        assert per_code[codes[r]] == placement_of(big.members(r, "shard"), POD)


def test_oversubscription_slows_traffic_that_crosses_the_spine():
    thin = Network.preset("dgx-superpod", tiers=(Tier("su", 256, 4.0),))
    S = 256 << 20
    inside = Placement(per_node=1, spans=(1,))   # 32 nodes of one SU, one member each
    across = Placement(per_node=1, spans=(32,))  # 32 nodes, one in each of 32 SUs
    for op in ("all_gather_into_tensor", "all_reduce", "all_to_all"):
        t_in = collective_time(thin, op, S, 32, inside)
        t_x = collective_time(thin, op, S, 32, across)
        assert t_x > 2 * t_in
        # with full bisection the same placement costs nothing more
        assert collective_time(POD, op, S, 32, across) == collective_time(POD, op, S, 32, inside)
    # a ring whose only crossing hops are its D = 2 domain boundaries of N = 32 nodes: 2/32 of
    # its bytes leave a domain, × 4 oversubscription < 1: no slower than inside
    two = Placement(per_node=1, spans=(2,))
    assert collective_time(thin, "all_gather_into_tensor", S, 32, two) == \
        collective_time(thin, "all_gather_into_tensor", S, 32, inside)


def test_the_llama3_cluster_is_oversubscribed_one_to_seven_between_pods():
    net = Network.preset("llama3-roce")
    assert [(t.name, t.gpus, t.oversubscription) for t in net.tiers] == \
        [("rack", 16, 1.0), ("pod", 3072, 7.0)]
    one_per_pod = range(0, 8 * 3072, 3072)                  # 8 ranks, one in each pod
    p = placement_of(one_per_pod, net)
    assert p == Placement(per_node=1, spans=(8, 8))
    placed = net.placed(p)
    assert placed.crossing == ((8, 7.0),)
    # its ring's every hop leaves a pod: the NIC's 50 GB/s at 1/7
    S = 1 << 30
    t = placed.collective_time("all_gather_into_tensor", S, 8)
    assert t == pytest.approx(7 * 10e-6 + 7 / 8 * S / (50e9 / 7), rel=1e-12)


def test_two_communicators_on_one_node_share_its_nics():
    # one member a node: 8 such communicators run at once on a DGX H100 node, each on one
    # NIC's share; two members a node: half as many, each on two NICs
    one, two = DGX.placed(1), DGX.placed(2)
    assert one.node_bandwidth_Bps == 50e9 and two.node_bandwidth_Bps == 100e9
    S = 1 << 30
    # a ring over 32 nodes: (n − N) NVLink steps of 2 µs, N − 1 network steps of 5 µs, the
    # bytes at the communicator's share of the node's NICs
    assert one.collective_time("all_gather_into_tensor", S, 32) == pytest.approx(
        31 * 5e-6 + 31 / 32 * S / 50e9, rel=1e-12)
    assert two.collective_time("all_gather_into_tensor", S, 64) == pytest.approx(
        32 * 2e-6 + 31 * 5e-6 + 63 / 64 * S / 100e9, rel=1e-12)


@pytest.fixture(scope="module")
def ddp_cap():
    return capture(zoo.get("mlp", bucket_cap_mb=0.02), 1,
                   timing=Timing(network=IB, compute=Compute.constant(1e-4)))


def test_two_ddp_groups_contend_for_the_nics_they_share(ddp_cap):
    # two DDP groups interleaved over the same 4 nodes: with shared NICs a group's
    # collective waits while the other's holds them
    kw = dict(network=IB, groups=2, progress=False, engine="simpy", protocol_latency=False)
    free = replay(ddp_cap, 32, **kw)
    shared = replay(ddp_cap, 32, shared_nic=True, **kw)
    spans = sorted((c["start"], c["end"], c["group"]) for c in shared.collectives)
    for (s0, e0, g0), (s1, e1, g1) in zip(spans, spans[1:]):
        assert s1 >= e0 or g0 == g1  # never two groups on the NICs at once
    assert shared.iteration_time > free.iteration_time


@pytest.mark.parametrize("jitter", [0.0])
def test_both_engines_cost_a_tiered_placement_alike(jitter):
    from simddp.cosim.capture_fsdp import capture_fsdp
    thin = Network.preset("dgx-superpod", tiers=(Tier("su", 16, 4.0),))
    cap = capture_fsdp(zoo.get("transformer_block"), 2,
                       timing=Timing(network=thin, compute=Compute.roofline("h100")))
    kw = dict(parallel="fsdp", network=thin, protocol_latency=False, gpu_contention="off",
              progress=False, jitter=jitter)
    fast = replay(cap, 64, engine="vector", **kw)
    slow = replay(cap, 64, engine="simpy", **kw)
    assert fast.iteration_times == slow.iteration_times
    # the tiers cost something: the same collectives on a non-blocking fabric are faster
    flat = replay(cap, 64, engine="vector", **{**kw, "network": POD})
    comm = lambda res: sum(c["end"] - c["start"] for c in res.collectives)  # noqa: E731
    assert comm(fast) > comm(flat)
