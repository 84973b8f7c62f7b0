"""Where a communicator's ranks sit: each collective costed with how many of its members share
a node (a mesh dimension's stride and size), on the network's NCCL formulas seen from that
placement; contiguous layouts cost exactly what they always did."""

import dataclasses

import numpy as np
import pytest
import torch

from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.cosim.capture_fsdp import capture_fsdp
from simddp.models import MeasuredNetwork, collective_time
from simddp.models.nccl_latency import ProtocolLatency
from simddp.program import Knobs, plan
from simddp.program.mesh import DDPMesh, DeviceMesh, Mesh
from simddp.program.parallel import Parallel
from simddp.replay import replay

DGX = Network.preset("dgx-h100")  # 8 GPUs a node, NVLink 370.8 GB/s, 8 NICs of 50 GB/s
# the α–β formulas alone (NCCL's tuning model and the GPU's contention off): the closed forms
PLAIN = dict(protocol_latency=False, gpu_contention="off")
A, A_IN, NIC, NVL = 5e-6, 2e-6, 50e9, 18 * 20.6e9
S = 256 << 20
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
       "all_to_all", "barrier", "send")


class Contiguous:
    """A network model that does not know placement (no ``placed``): the documented
    fallback asks it as if every communicator filled nodes."""

    def __init__(self, inner):
        self.inner, self.name, self.gpus_per_node = inner, inner.name, inner.gpus_per_node

    def collective_time(self, op, nbytes, nranks):
        return self.inner.collective_time(op, nbytes, nranks)

    def describe(self):
        return self.inner.describe()


def _placed_time(mesh, scope, op, nbytes, net=DGX):
    g = mesh.per_node(0, scope, net.gpus_per_node)
    return collective_time(net, op, nbytes, len(mesh.members(0, scope)), g)


# ---- the network model, closed forms ------------------------------------------------------

def test_a_tp_group_of_eight_stays_inside_a_dgx_h100_node_at_nvlink_time():
    mesh = Parallel.parse("fsdp:32,tp:8", 256).mesh()
    assert mesh.per_node(0, "tp", 8) == 8 and list(mesh.members(9, "tp")) == list(range(8, 16))
    assert _placed_time(mesh, "tp", "all_gather_into_tensor", S) == \
        pytest.approx(7 * A_IN + 7 / 8 * S / NVL, rel=1e-12)
    assert _placed_time(mesh, "tp", "reduce_scatter_tensor", S) == \
        pytest.approx(7 * A_IN + 7 / 8 * S / NVL, rel=1e-12)


def test_the_shard_group_of_fsdp32_tp8_is_a_32_node_ring_on_one_nic_each():
    mesh = Parallel.parse("fsdp:32,tp:8", 256).mesh()
    assert mesh.per_node(3, "shard", 8) == 1
    assert list(mesh.members(3, "shard")) == list(range(3, 256, 8))
    # NCCL's ring over 32 nodes: 31 network steps, 31/32 of the bytes at one NIC's 50 GB/s
    ring = 31 * A + 31 / 32 * S / NIC
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        t = _placed_time(mesh, "shard", op, S)
        assert t == pytest.approx(ring, rel=1e-12)
        assert t == pytest.approx(Network(bandwidth_GBps=50, latency_us=5).collective_time(
            op, S, 32), rel=1e-12)  # = a flat 32-rank ring of NICs
        # contiguous (as before): 4 nodes of 8 on NVLink-bound 370.8 GB/s, ~7x less time
        assert DGX.collective_time(op, S, 32) < t / 6


def test_hsdp8_at_64_ranks_all_reduces_replicas_over_8_nodes_on_one_nic_each():
    mesh = Parallel.parse("hsdp:8", 64).mesh()
    assert mesh.per_node(0, "replicate", 8) == 1 and mesh.per_node(0, "shard", 8) == 8
    n = N = 8
    ring = (2 * (n - 1) - 2 * N) * A_IN + 2 * N * A + 2 * (n - 1) / n * S / NIC
    tree = 2 * 3 * A + 2 / 0.9 * S / NIC  # a double binary tree over 8 nodes, no chain inside
    assert _placed_time(mesh, "replicate", "all_reduce", S) == \
        pytest.approx(min(ring, tree), rel=1e-12)
    assert _placed_time(mesh, "replicate", "all_reduce", 1024) == \
        pytest.approx(min(2 * (n - 1 - N) * A_IN + 2 * N * A + 1.75 * 1024 / NIC,
                          6 * A + 2 / 0.9 * 1024 / NIC), rel=1e-12)
    # before: costed as one node's NVLink (NVLS) — placement makes it several times slower
    assert _placed_time(mesh, "replicate", "all_reduce", S) > 5 * DGX.collective_time(
        "all_reduce", S, 8)


def test_several_members_per_node_share_the_nodes_nics_and_keep_nvls():
    mesh = DeviceMesh(64, {"dp": 16, "tp": 4})  # dp: stride 4, 2 members a node, 8 nodes
    assert mesh.per_node(0, "dp", 8) == 2
    placed = DGX.placed(2)
    assert placed.gpus_per_node == 2 and placed.node_bandwidth_Bps == 2 * NIC
    assert placed.nvls_bandwidth_GBps == DGX.nvls_bandwidth_GBps
    n, N = 16, 8
    ring = (2 * (n - 1) - 2 * N) * A_IN + 2 * N * A + 2 * (n - 1) / n * S / (2 * NIC)
    assert placed.collective_time("all_reduce", S, n) <= ring
    assert _placed_time(mesh, "dp", "all_gather_into_tensor", S) == pytest.approx(
        (n - N) * A_IN + (N - 1) * A + (n - 1) / n * S / (2 * NIC), rel=1e-12)
    # 4 NICs for 8 GPUs: each of the 4 concurrent groups gets a quarter of the node's 4 NICs
    four = Network.preset("dgx-h100", nics_per_node=4).placed(2)
    assert four.node_bandwidth_Bps == pytest.approx(NIC)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 5, 8, 16, 64, 256])
def test_contiguous_placement_costs_exactly_what_it_always_did(op, n):
    for net in (DGX, Network.preset("ib-ndr", gpus_per_node=8, nics_per_node=4),
                Network.preset("100gbe", gpus_per_node=4, algorithm="ring")):
        G = net.gpus_per_node
        today = net.collective_time(op, S, n)
        assert collective_time(net, op, S, n, G) == today
        assert collective_time(net, op, S, n, None) == today
        assert collective_time(net, op, S, n, n) == today  # all on one node, whatever G
    assert DGX.placed(8) is DGX and DGX.placed(16) is DGX
    flat = Network(bandwidth_GBps=10, latency_us=5)
    assert flat.placed(1) is flat


def test_the_placed_fabric_is_derived_once_and_keeps_nccls_protocol_latency():
    assert DGX.placed(1) is DGX.placed(1)
    assert DGX.placed(1).algorithm == "auto" and DGX.placed(1).nvls_bandwidth_GBps is None
    assert Network.preset("dgx-h100", algorithm="nvls").placed(1).algorithm == "auto"
    wrapped = ProtocolLatency(DGX)
    assert wrapped.placed(1) is wrapped.placed(1) and wrapped.placed(8) is wrapped
    assert collective_time(wrapped, "all_reduce", S, 8, 1) == \
        ProtocolLatency(DGX.placed(1)).collective_time("all_reduce", S, 8)
    with pytest.raises(ValueError, match="per_node"):
        DGX.placed(0)


def test_a_model_that_does_not_know_placement_is_asked_as_if_contiguous():
    rows = [{"op": "all_reduce", "world_size": 8, "bytes": b, "seconds": s}
            for b, s in [(1 << 10, 1e-4), (1 << 30, 1e-2)]]
    for net in (Contiguous(DGX), MeasuredNetwork(rows, gpus_per_node=8)):
        assert collective_time(net, "all_reduce", S, 8, 1) == \
            net.collective_time("all_reduce", S, 8)


# ---- the mesh ------------------------------------------------------------------------------

@pytest.mark.parametrize("world,dims", [(256, {"shard": 32, "tp": 8}),
                                        (64, {"replicate": 8, "shard": 8}),
                                        (48, {"pp": 4, "shard": 3, "tp": 4}),
                                        (12, {"replicate": 4, "shard": 3})])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 8])
def test_device_mesh_placement_from_stride_and_size_matches_counting_members(world, dims, G):
    mesh = DeviceMesh(world, dims)
    for scope in mesh.scopes:
        code, _ = mesh.codes(scope)
        per = [mesh.per_node(r, scope, G) for r in range(world)]
        counted = [max(np.bincount(np.asarray(mesh.members(r, scope)) // G))
                   for r in range(world)]
        assert per == counted
        assert mesh.per_node_codes(scope, G)[code].tolist() == per
        assert Mesh.per_node_codes(mesh, scope, G)[code].tolist() == per


class _Channels(Mesh):
    """Pipeline-style p2p channels (stage s ↔ s+1, 2 members each): a mesh with no placement
    of its own, placed by the defaults from members() and codes()."""

    scopes = ("p2p",)

    def __init__(self, world, stride):
        self.world, self.stride = world, stride

    def members(self, rank, scope):
        lo = rank - rank % (2 * self.stride) + rank % self.stride
        return (lo, lo + self.stride)

    def key(self, rank, scope):
        return ("p2p", self.members(rank, scope)[0])

    def codes(self, scope):
        lows = np.array([self.members(r, scope)[0] for r in range(self.world)])
        uniq, code = np.unique(lows, return_inverse=True)
        return code.reshape(-1), len(uniq)


def test_any_mesh_is_placed_by_counting_its_members_a_channel_across_nodes_is_one_per_node():
    across, inside = _Channels(32, 8), _Channels(32, 2)
    assert across.per_node(0, "p2p", 8) == 1 and inside.per_node(0, "p2p", 8) == 2
    assert across.per_node_codes("p2p", 8).tolist() == [1] * 16
    assert collective_time(DGX, "send", S, 2, 1) == pytest.approx(A + S / NIC, rel=1e-12)


def test_ddp_groups_keep_their_contiguous_costing():
    mesh = DDPMesh(64, groups=4, gpus_per_node=8)
    assert mesh.per_node(1, "dp", 8) == 8
    assert mesh.per_node_codes("dp", 8).tolist() == [8] * 4
    assert mesh.placement_code(8)[1] == 1


def test_ranks_of_a_dimension_that_straddles_nodes_unevenly_are_told_apart():
    mesh = Parallel.parse("hsdp:3", 12).mesh()  # shard groups {6,7,8}: 2 on node 0
    assert mesh.per_node_codes("shard", 8).tolist() == [3, 3, 2, 3]
    code, kinds = mesh.placement_code(8)
    assert kinds > 1 and code[6] != code[0]
    assert mesh.placement_code(None)[1] == 1
    assert Parallel.parse("hsdp:8", 64).mesh().placement_code(8)[1] == 1  # regular: alike


# ---- replay: both engines ------------------------------------------------------------------

@pytest.fixture(scope="module")
def caps():
    sc = dataclasses.replace(zoo.get("transformer_block"),
                             optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    timing = Timing(network=DGX, compute=Compute.roofline("h100"))
    return {"fsdp": capture_fsdp(sc, 2, timing=timing),
            "hsdp": capture_fsdp(sc, 4, timing=timing, mesh={"replicate": 2, "shard": 2})}


def _all_reduces(res, rank=0):
    return [c for c in res.timeline.rank_comms(rank) if c.op == "all_reduce"]


@pytest.mark.parametrize("engine", ["simpy", "vector"])
def test_replay_costs_hsdp_replica_all_reduces_on_one_nic_per_node(caps, engine):
    res = replay(caps["hsdp"], 64, parallel="hsdp:8", network=DGX, engine=engine,
                 progress=False, **PLAIN)
    before = replay(caps["hsdp"], 64, parallel="hsdp:8", network=Contiguous(DGX),
                    engine=engine, progress=False, **PLAIN)
    assert res.engine == engine
    ars = _all_reduces(res)
    assert ars and all(c.group_ranks == tuple(range(0, 64, 8)) for c in ars)
    for c in ars:
        assert c.duration == pytest.approx(DGX.placed(1).collective_time(
            "all_reduce", c.bytes, 8), rel=1e-9)
    # a small model's all_reduces are latency-bound: 16 network steps instead of NVLS's one
    assert sum(c.duration for c in ars) > 1.2 * sum(c.duration for c in _all_reduces(before))
    assert res.iteration_times[-1] >= before.iteration_times[-1]


def test_one_dimensional_fsdp_replays_bitwise_as_before(caps):
    for world in (8, 12, 64):
        a = replay(caps["fsdp"], world, network=DGX, progress=False, **PLAIN)
        b = replay(caps["fsdp"], world, network=Contiguous(DGX), progress=False, **PLAIN)
        assert a.iteration_times == b.iteration_times
        assert a.timeline.rank_comms(world - 1) == b.timeline.rank_comms(world - 1)


@pytest.mark.parametrize("jitter", [0.0, 0.05])
def test_both_engines_agree_where_communicators_of_one_dimension_sit_differently(caps, jitter):
    kw = dict(parallel="hsdp:3", network=DGX, jitter=jitter, seed=5, iterations=2,
              progress=False, **PLAIN)
    fast = replay(caps["hsdp"], 12, engine="vector", **kw)
    slow = replay(caps["hsdp"], 12, engine="simpy", **kw)
    assert fast.engine == "vector" and slow.engine == "simpy"
    assert fast.iteration_times == slow.iteration_times
    for r in (0, 6, 8, 11):
        assert fast.timeline.rank_comms(r) == slow.timeline.rank_comms(r)
    # the shard group {6, 7, 8} spans two nodes: its collectives take longer than {0, 1, 2}'s
    def gathers(r):
        return [c.duration for c in slow.timeline.rank_comms(r) if c.group.startswith("shard")]
    assert sum(gathers(6)) > sum(gathers(0))


# ---- co-simulation: the same placement from a group's ranks --------------------------------

def _strided_and_local(rank):
    import torch.distributed as dist

    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # one per node
    local = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # inside a node
    t = torch.ones(1 << 18)
    dist.all_reduce(t, group=strided)
    dist.all_reduce(t, group=local)


def test_cosimulation_costs_a_group_where_its_ranks_sit():
    import simddp

    net = Network.preset("100gbe", gpus_per_node=2, algorithm="ring")
    res = simddp.simulate(_strided_and_local, (), 4, timing=Timing(network=net), seed=0)
    ars = [r for r in res.trace[0] if r.op == "all_reduce"]
    assert len(ars) == 2
    strided, local = ars  # rank 0: its strided group's all_reduce first
    nbytes = 4 << 18
    assert strided.end - strided.start == pytest.approx(
        net.placed(1).collective_time("all_reduce", nbytes, 2), rel=1e-9)
    assert local.end - local.start == pytest.approx(
        net.collective_time("all_reduce", nbytes, 2), rel=1e-9)
    # a NIC (12.5 GB/s) between nodes, NVLink (450 GB/s) inside one
    assert strided.end - strided.start > 10 * (local.end - local.start)
