"""NCCL's algorithms in simddp's cost model: the formulas :class:`simddp.Network` evaluates.

The formulas are NCCL's own performance model (``src/graph/tuning.cc``, ``ncclTopoTuneModel``)
and the bus-bandwidth factors of nccl-tests (``doc/PERFORMANCE.md``), with α = ``latency_us``
per step and bw = ``bandwidth_GBps`` (1 GB/s = 1e9 bytes/s).

Byte convention (that of nccl-tests): ``nbytes`` is the size of the buffer one rank passes,

* all_reduce, broadcast, reduce, send/recv: the tensor (sum of the tensors when coalesced);
* all_gather: the FULL output (nranks × each rank's chunk); reduce_scatter: the FULL input;
* gather / scatter: the full buffer at the root (nranks × chunk);
* all_to_all: one rank's whole input (it keeps 1/nranks of it and sends the rest);
* barrier: ignored.

Flat formulas, n ranks, α seconds per step, bw bytes/s, S = nbytes:

=======================================  ===================  ==================
op                                       latency              bandwidth term
=======================================  ===================  ==================
all_reduce, ring                         2(n−1)·α             2(n−1)/n · S/bw
all_reduce, tree                         2·⌈log2 n⌉·α         2 · S/(0.9·bw)
all_gather, reduce_scatter               (n−1)·α              (n−1)/n · S/bw
all_to_all, gather, scatter              (n−1)·α              (n−1)/n · S/bw
broadcast, reduce (pipelined chain)      (n−1)·α              S/bw
barrier (an all_reduce of ~0 bytes)      as all_reduce        0
send / recv                              α                    S/bw
=======================================  ===================  ==================

Any collective on one rank costs 0. ``algorithm="tree"`` changes only all_reduce and barrier: NCCL
implements trees for all_reduce alone. The tree bandwidth term is NCCL's: tuning.cc gives a
tree 90 % of the link's bus bandwidth (``busBw*.9``; .92 in NCCL ≥ 2.19) and converts bus
bandwidth to algorithm bandwidth with the ratio 0.5 (every byte goes up the tree reduced, then
down it broadcast), where a ring gets n/(2(n−1)). So trees win on latency (log n steps) and rings
on bandwidth, which is why NCCL picks trees for small messages at scale and rings for large ones.

``algorithm="auto"`` (the default of every NCCL preset) does what NCCL's tuner does
(``ncclTopoGetAlgoTime``: the algorithm of least predicted time): each all_reduce / barrier costs
the minimum over ring, tree and, where the network has NVLink SHARP (``nvls_bandwidth_GBps``),
NVLS. :meth:`Network.chosen_algorithm` says which one won. ``algorithm="nvls"`` forces NVLS (only
on a network that has it). Protocols (LL/LL128/Simple) are not modelled separately: α is one
per-step latency, between NCCL's LL and Simple figures.

NVLS (NVLink SHARP, H100/B200 NVSwitch): the switch reduces, each GPU sends S and receives S once,
so the time is ``23 µs + S / nvls_bandwidth_GBps`` inside a node: 23 µs is tuning.cc's
``hwLat[NVLINK][NVLS][Simple]``, ``nvls_bandwidth_GBps`` NVLS's algorithm bandwidth (tuning.cc:
nChannels × per-channel NVLink bandwidth × 5/6). Across nodes (NCCL's NVLS_TREE) it adds
2·⌈log2 N⌉ network steps and is capped by the node's NICs (× 5/6, halved above 2 nodes, as
tuning.cc). Only all_reduce and barrier use NVLS (NCCL's NVLS reduce_scatter/all_gather are
slower than ring, NVIDIA/nccl#1083).

Hierarchy (``gpus_per_node`` = G set and n > G): ranks form N = ⌈n/G⌉ nodes, an intra-node link
of ``intra_bandwidth_GBps`` (bus bandwidth per GPU) / ``intra_latency_us``, and
``nics_per_node`` NICs of ``bandwidth_GBps`` each per node (default: one NIC per GPU, as in a
DGX); B_node = nics_per_node × bandwidth_GBps. α_x = max(α, α_intra) is a step that crosses
nodes. NCCL's rings and trees run through all n ranks at once, pipelined: every NVLink and every
NIC carries its share concurrently, so the bandwidth is that of the slowest resource,
bw_h = min(bw_intra, B_node) (a ring crosses each node boundary once per channel, and the
channels spread over the node's NICs), and the latency counts NCCL's steps (tuning.cc):

* all_reduce, ring: (2(n−1) − 2N)·α_intra + 2N·α_x + 2(n−1)/n · S/bw_h;
* all_reduce, tree: 2(G−1)·α_intra + 2⌈log2 N⌉·α_x + 2·S/(0.9·bw_h) (a chain inside each node,
  a double binary tree across nodes);
* all_reduce, NVLS: see above;
* reduce_scatter, all_gather (ring): (n−N)·α_intra + (N−1)·α_x + (n−1)/n · S/bw_h;
* broadcast / reduce = one pipelined chain through all ranks: (N−1)·α + (n−N)·α_intra
  + S/bw_h;
* all_to_all, gather, scatter: each peer costs one step on its link:
  (G−1)·α_intra + (n−G)·α + (G−1)/n·S/bw_intra + (n−G)/n·S/(B_node/G);
* barrier = all_reduce with 0 bytes;
* send/recv = α + S/bw (the group spans nodes, so the peer may be remote; one flow, one NIC).

Inside one node (n ≤ G) the flat formulas run on the intra link, except that NCCL's tree inside a
node is a chain (2(n−1) steps). With equal intra and per-GPU inter links the bandwidth terms
reduce to the flat ones. A last, partly filled node is treated as full (an approximation).

Placement (``Network.placed(g)``): the formulas above assume a communicator fills nodes, G
members each. A communicator of a strided mesh dimension does not: FSDP's shard group of
``fsdp:32,tp:8`` on 8-GPU nodes has stride 8, one member per node on 32 nodes, and each node
runs 8 such groups at once. A communicator with g < G members per node is costed by the same
formulas on the fabric as it sees it: nodes of g ranks (N = ⌈n/g⌉; n ≤ g is inside one node),
each node's NICs shared by the G/g communicators of that shape that run concurrently, so this
one gets B_node · g/G (g "NICs" of B_node/G), and no NVLS where a node holds one member
(nothing to reduce in the switch; a forced ``algorithm="nvls"`` becomes "auto" there). With
g = 1 a ring is NCCL's ring over N = n nodes on one NIC's share each: tuning.cc's 2N network
steps and 2(n−1) − 2N (= −2) intra steps, exactly as it counts them. g ≥ G is today's
contiguous layout, unchanged. Models that do not know placement (a
:class:`~simddp.models.MeasuredNetwork`) are asked as if contiguous
(:func:`simddp.models.collective_time`).

Tiers (``Network.tiers``, :mod:`simddp.models.placement`): switch tiers above the node, each
with the oversubscription of the uplinks that leave one of its domains. A communicator placed
across D > 1 domains of an oversubscribed tier (``Network.crossing``, set by ``placed``) sends a
share f of its inter-node bytes out of a domain — D/N for rings, trees and chains (its only
crossing hops are the D domain boundaries), 1 − 1/D for all_to_all — and, every node being as
busy as this one, sees B_node / max(1, f · oversubscription) (:func:`node_bandwidth`).

Until this version the hierarchical all_reduce was a sequence intra reduce_scatter → inter
all_reduce of S/G → intra all_gather (times added, latency 2(G−1)+2(N−1) steps). NCCL does not
do that for ring/tree: it under-predicted multi-node bus bandwidth (DGX A100, 8×HDR: 153 GB/s
where rings reach ~190) and over-counted nothing of a ring's 2(n−1) latency steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .network import Network

__all__ = ["NVLS_LATENCY_US", "NVLS_ALGBW_RATIO", "TREE_BUS_BW_FRACTION", "flat_coefficients",
           "flat_time", "all_reduce_time", "other_time", "candidates", "node_bandwidth"]

TREE_BUS_BW_FRACTION = 0.9  # NCCL tuning.cc: `if (a == NCCL_ALGO_TREE) busBw = ... busBw*.9`
# NCCL tuning.cc (2.19-2.2x) hwLat[NCCL_HW_NVLINK][NCCL_ALGO_NVLS][NCCL_PROTO_SIMPLE] = 23 µs
# (25 µs in 2.17/2.18); baseLat for NVLS is 0 and NVLS runs the Simple protocol only.
NVLS_LATENCY_US = 23.0
NVLS_ALGBW_RATIO = 5.0 / 6.0  # tuning.cc: NVLS/NVLS_TREE bus→algorithm bandwidth ratio


def log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def flat_coefficients(kind: str, n: int, algorithm: str) -> tuple[int, float]:
    """(latency steps, byte factor) so that time = steps·α + factor·S/bw on one flat link, n ≥ 2."""
    if kind == "all_reduce":
        if algorithm == "tree":
            return 2 * log2_ceil(n), 2.0 / TREE_BUS_BW_FRACTION
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "barrier":
        return (2 * log2_ceil(n) if algorithm == "tree" else 2 * (n - 1)), 0.0
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return n - 1, (n - 1) / n
    if kind in ("broadcast", "reduce"):
        return n - 1, 1.0
    if kind == "p2p":
        return 1, 1.0
    raise AssertionError(kind)  # pragma: no cover - every ops.COST_KINDS is handled


def flat_time(kind: str, nbytes: float, n: int, alpha: float, bw: float, algorithm: str) -> float:
    if n <= 1 and kind != "p2p":
        return 0.0
    steps, factor = flat_coefficients(kind, n, algorithm)
    return steps * alpha + factor * nbytes / bw


def node_bandwidth(net: "Network", N: int, all_to_all: bool = False) -> float:
    """B_node (bytes/s) as a collective over N nodes sees it through the oversubscribed tiers
    it crosses (``net.crossing``, see "Tiers" above): divided by max(1, f·o) per tier, f the
    share of its inter-node bytes that leave a domain (D/N for rings, trees and chains, whose
    only crossing hops are the D domain boundaries; 1 − 1/D for all_to_all)."""
    B = net.node_bandwidth_Bps
    if not net.crossing:
        return B
    worst = 1.0
    for D, o in net.crossing:
        f = (1.0 - 1.0 / D) if all_to_all else min(1.0, D / max(N, 1))
        worst = max(worst, f * o)
    return B / worst


def candidates(net: "Network") -> tuple[str, ...]:
    """The all_reduce algorithms NCCL's tuner chooses among on ``net`` ("auto")."""
    return ("ring", "tree", "nvls") if net.nvls_bandwidth_GBps is not None else ("ring", "tree")


def all_reduce_time(net: "Network", algorithm: str, S: float, n: int) -> float:
    """Seconds of an all_reduce of S bytes on n ranks of ``net`` with ``algorithm``."""
    if n <= 1:
        return 0.0
    G = net.gpus_per_node
    if G is None:
        return flat_time("all_reduce", S, n, net.alpha_s, net.bandwidth_Bps, algorithm)
    a_in, b_in = net.intra_alpha_s, net.intra_bandwidth_Bps
    if algorithm == "nvls":
        nvls_bw = net.nvls_bandwidth_GBps * 1e9
        lat = NVLS_LATENCY_US * 1e-6
        if n <= G:
            return lat + S / nvls_bw
        N = -(-n // G)
        a_x = max(net.alpha_s, a_in)
        inter = node_bandwidth(net, N) * NVLS_ALGBW_RATIO * (1.0 if N <= 2 else 0.5)
        return lat + 2 * log2_ceil(N) * a_x + S / min(nvls_bw, inter)
    if n <= G:
        if algorithm == "tree":  # NCCL's tree inside one node is a chain
            return 2 * (n - 1) * a_in + 2.0 / TREE_BUS_BW_FRACTION * S / b_in
        return flat_time("all_reduce", S, n, a_in, b_in, algorithm)
    N = -(-n // G)
    a_x = max(net.alpha_s, a_in)
    bw = min(b_in, node_bandwidth(net, N))
    if algorithm == "tree":
        return (2 * (G - 1) * a_in + 2 * log2_ceil(N) * a_x
                + 2.0 / TREE_BUS_BW_FRACTION * S / bw)
    return (2 * (n - 1) - 2 * N) * a_in + 2 * N * a_x + 2 * (n - 1) / n * S / bw


def other_time(net: "Network", kind: str, S: float, n: int) -> float:
    """Seconds of a collective of cost kind ``kind`` (not all_reduce/barrier) on ``net``."""
    G = net.gpus_per_node
    if G is None:
        return flat_time(kind, S, n, net.alpha_s, net.bandwidth_Bps, "ring")
    a_in, b_in = net.intra_alpha_s, net.intra_bandwidth_Bps
    if n <= G:
        return flat_time(kind, S, n, a_in, b_in, "ring")
    a, b = net.alpha_s, net.bandwidth_Bps
    g, N = G, -(-n // G)
    bw = min(b_in, node_bandwidth(net, N))
    if kind in ("reduce_scatter", "all_gather"):
        return (n - N) * a_in + (N - 1) * max(a, a_in) + (n - 1) / n * S / bw
    if kind in ("broadcast", "reduce"):
        return (N - 1) * a + (n - N) * a_in + S / bw
    if kind in ("all_to_all", "gather", "scatter"):
        return ((g - 1) * a_in + (n - g) * a
                + (g - 1) / n * S / b_in + (n - g) / n * S / (node_bandwidth(net, N, True) / g))
    if net.crossing:  # p2p across nodes: one flow on one NIC, through the tiers it crosses
        b = net.bandwidth_Bps * node_bandwidth(net, 2) / net.node_bandwidth_Bps
    return a + S / b  # p2p across nodes: one flow on one NIC
