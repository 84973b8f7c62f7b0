"""Network cost model: how long one collective takes, α–β style, after NCCL.

A :class:`Network` answers ``collective_time(op, nbytes, nranks)`` in seconds. The formulas are
NCCL's own performance model (``src/graph/tuning.cc``, ``ncclTopoTuneModel``) and the bus-bandwidth
factors of nccl-tests (``doc/PERFORMANCE.md``), with α = ``latency_us`` per step and
bw = ``bandwidth_GBps`` (1 GB/s = 1e9 bytes/s)::

    >>> net = Network(bandwidth_GBps=10.0, latency_us=5.0)
    >>> round(net.collective_time("all_reduce", 100_000_000, 4), 6)   # 6·5 µs + 1.5·100 MB/10 GB/s
    0.01503
    >>> Network.preset("ib-hdr", gpus_per_node=8).collective_time("all_reduce", 1 << 20, 64) > 0
    True

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

Until this version the hierarchical all_reduce was a sequence intra reduce_scatter → inter
all_reduce of S/G → intra all_gather (times added, latency 2(G−1)+2(N−1) steps). NCCL does not
do that for ring/tree: it under-predicted multi-node bus bandwidth (DGX A100, 8×HDR: 153 GB/s
where rings reach ~190) and over-counted nothing of a ring's 2(n−1) latency steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import numpy as np

from fakepg import ops
from fakepg.arguments import integer, number

__all__ = ["Network", "PRESETS", "NVLS_LATENCY_US"]

_ALGORITHMS = ("ring", "tree", "nvls", "auto")
_FIT_ALGORITHMS = ("ring", "tree")  # what calibrate() can fit: fixed step/byte coefficients
_TREE_BUS_BW_FRACTION = 0.9  # NCCL tuning.cc: `if (a == NCCL_ALGO_TREE) busBw = ... busBw*.9`
# NCCL tuning.cc (2.19-2.2x) hwLat[NCCL_HW_NVLINK][NCCL_ALGO_NVLS][NCCL_PROTO_SIMPLE] = 23 µs
# (25 µs in 2.17/2.18); baseLat for NVLS is 0 and NVLS runs the Simple protocol only.
NVLS_LATENCY_US = 23.0
_NVLS_ALGBW_RATIO = 5.0 / 6.0  # tuning.cc: NVLS/NVLS_TREE bus→algorithm bandwidth ratio


def _kind(op: str) -> str:
    """The cost formula of ``op`` (fakepg's registry; ValueError naming the known ops)."""
    return ops.cost_kind(op)


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def _flat_coefficients(kind: str, n: int, algorithm: str) -> tuple[int, float]:
    """(latency steps, byte factor) so that time = steps·α + factor·S/bw on one flat link, n ≥ 2."""
    if kind == "all_reduce":
        if algorithm == "tree":
            return 2 * _log2_ceil(n), 2.0 / _TREE_BUS_BW_FRACTION
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "barrier":
        return (2 * _log2_ceil(n) if algorithm == "tree" else 2 * (n - 1)), 0.0
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return n - 1, (n - 1) / n
    if kind in ("broadcast", "reduce"):
        return n - 1, 1.0
    if kind == "p2p":
        return 1, 1.0
    raise AssertionError(kind)  # pragma: no cover - every ops.COST_KINDS is handled


def _flat_time(kind: str, nbytes: float, n: int, alpha: float, bw: float, algorithm: str) -> float:
    if n <= 1 and kind != "p2p":
        return 0.0
    steps, factor = _flat_coefficients(kind, n, algorithm)
    return steps * alpha + factor * nbytes / bw


def _check_number(field: str, value: Any, *, allow_zero: bool, hint: str) -> None:
    if allow_zero:
        number(f"Network.{field}", value, minimum=0, hint=hint)
    else:
        number(f"Network.{field}", value, positive=True, hint=hint)


@dataclass(frozen=True)
class Network:
    """An α–β model of one fabric, optionally two-level (NVLink inside a node, a NIC per GPU).

    bandwidth_GBps: inter-node bandwidth per NIC, GB/s = 1e9 bytes/s, one direction (on a flat
        fabric: per rank).
    latency_us: α, the latency of one algorithm step on that link.
    algorithm: "ring", "tree", "nvls" (all_reduce's algorithm, forced) or "auto" (NCCL's choice:
        the fastest for each size and rank count; see the module docstring).
    gpus_per_node: ranks per node; None = one flat fabric.
    intra_bandwidth_GBps, intra_latency_us: the link inside a node; default to the inter values.
        The bandwidth is a GPU's NCCL bus bandwidth inside the node (what nccl-tests reports
        for a large ring all_reduce on one node).
    nics_per_node: NICs per node sharing the node's inter-node traffic; None = one per GPU.
        A 4-NIC node of 8 GPUs has half the inter-node bandwidth of an 8-NIC one.
    nvls_bandwidth_GBps: NVLink SHARP all_reduce algorithm bandwidth inside a node (NVSwitch
        with in-switch reduction: H100, B200); None = no NVLS.

    ``alpha_s = latency_us * 1e-6`` and ``bandwidth_Bps = bandwidth_GBps * 1e9`` are what the
    formulas use. Frozen: derive variants with ``dataclasses.replace(net, bandwidth_GBps=...)``.
    """

    bandwidth_GBps: float
    latency_us: float
    algorithm: str = "ring"
    gpus_per_node: int | None = None
    intra_bandwidth_GBps: float | None = None
    intra_latency_us: float | None = None
    name: str = "custom"
    nics_per_node: int | None = None
    nvls_bandwidth_GBps: float | None = None

    def __post_init__(self) -> None:
        _check_number("bandwidth_GBps", self.bandwidth_GBps, allow_zero=False,
                      hint="give the link bandwidth in GB/s, e.g. 12.5 for 100 Gb/s Ethernet")
        _check_number("latency_us", self.latency_us, allow_zero=True,
                      hint="give the per-step latency in microseconds, e.g. 5.0")
        if self.algorithm not in _ALGORITHMS:
            raise ValueError(f"Network.algorithm must be one of {_ALGORITHMS}, "
                             f"got {self.algorithm!r}")
        if self.gpus_per_node is None:
            for field in ("intra_bandwidth_GBps", "intra_latency_us", "nics_per_node",
                          "nvls_bandwidth_GBps"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"Network.{field} describes the link inside a node, so it needs "
                        f"gpus_per_node; pass gpus_per_node=8 (say) as well, or drop {field}")
            if self.algorithm == "nvls":
                raise ValueError("Network.algorithm='nvls' needs NVLink SHARP inside a node: "
                                 "set gpus_per_node and nvls_bandwidth_GBps, use a preset that "
                                 "has it (dgx-h100, dgx-b200), or use algorithm='auto'")
            return
        integer("Network.gpus_per_node", self.gpus_per_node, minimum=1,
                hint="ranks per node, or None for one flat fabric")
        if self.intra_bandwidth_GBps is not None:
            _check_number("intra_bandwidth_GBps", self.intra_bandwidth_GBps, allow_zero=False,
                          hint="give the intra-node bandwidth in GB/s, e.g. 450 for NVLink4, "
                               "or None to use bandwidth_GBps")
        if self.intra_latency_us is not None:
            _check_number("intra_latency_us", self.intra_latency_us, allow_zero=True,
                          hint="give the intra-node per-step latency in µs, or None to use "
                               "latency_us")
        if self.nics_per_node is not None:
            integer("Network.nics_per_node", self.nics_per_node, minimum=1,
                    hint="NICs per node, e.g. 4 for 4 HCAs shared by 8 GPUs, or None for one "
                         "NIC per GPU")
        if self.nvls_bandwidth_GBps is not None:
            _check_number("nvls_bandwidth_GBps", self.nvls_bandwidth_GBps, allow_zero=False,
                          hint="give NVLS's all_reduce algorithm bandwidth in GB/s, e.g. 274.7 "
                               "for H100, or None for no NVLink SHARP")
        if self.algorithm == "nvls" and self.nvls_bandwidth_GBps is None:
            raise ValueError("Network.algorithm='nvls' needs NVLink SHARP, which this network "
                             "does not have (nvls_bandwidth_GBps is None); use a preset that has "
                             "it (dgx-h100, dgx-b200), set nvls_bandwidth_GBps, or use "
                             "algorithm='auto'")

    def describe(self) -> dict[str, Any]:
        """The parameters a sweep table shows (:class:`~simddp.models.NetworkModel`)."""
        return {"network": self.name, "bandwidth_GBps": self.bandwidth_GBps,
                "latency_us": self.latency_us, "gpus_per_node": self.gpus_per_node,
                "algorithm": self.algorithm}

    # ---- derived parameters -------------------------------------------------------------------

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6

    @property
    def bandwidth_Bps(self) -> float:
        return self.bandwidth_GBps * 1e9

    @property
    def intra_alpha_s(self) -> float:
        lat = self.latency_us if self.intra_latency_us is None else self.intra_latency_us
        return lat * 1e-6

    @property
    def intra_bandwidth_Bps(self) -> float:
        bw = self.bandwidth_GBps if self.intra_bandwidth_GBps is None else self.intra_bandwidth_GBps
        return bw * 1e9

    # ---- the model ----------------------------------------------------------------------------

    def collective_time(self, op: str, nbytes: int, nranks: int) -> float:
        """Seconds that collective ``op`` over ``nranks`` ranks takes, ``nbytes`` per the module
        docstring's convention (all_gather/reduce_scatter: the full nranks × chunk buffer).

        >>> Network(bandwidth_GBps=1.0, latency_us=0.0).collective_time("all_gather", 4e9, 4)
        3.0
        """
        kind = _kind(op)
        if nranks.__class__ is not int or nranks < 1:  # the common case checked cheaply
            nranks = integer("nranks", nranks, minimum=1)
        if not nbytes >= 0:
            number("nbytes", nbytes, minimum=0)
        if kind in ("all_reduce", "barrier"):
            S = 0 if kind == "barrier" else nbytes
            algorithm = self.algorithm
            if algorithm == "auto":
                return min(self._all_reduce_time(a, S, nranks) for a in self._candidates())
            return self._all_reduce_time(algorithm, S, nranks)
        return self._other_time(kind, nbytes, nranks)

    def chosen_algorithm(self, op: str, nbytes: int, nranks: int) -> str:
        """The algorithm ``collective_time`` uses for this call: ``algorithm`` when forced; under
        "auto" the fastest of ring, tree and (where the network has it) NVLS for all_reduce and
        barrier, and "ring" for every other op (NCCL has one algorithm for those here).

        >>> net = Network.preset("ib-ndr")
        >>> net.chosen_algorithm("all_reduce", 1 << 30, 8), net.chosen_algorithm("all_reduce", 1024, 65536)
        ('ring', 'tree')
        """
        kind = _kind(op)
        if kind not in ("all_reduce", "barrier"):
            return "ring"
        if self.algorithm != "auto":
            return self.algorithm
        S = 0 if kind == "barrier" else nbytes
        return min(self._candidates(), key=lambda a: self._all_reduce_time(a, S, nranks))

    def _candidates(self) -> tuple[str, ...]:
        return ("ring", "tree", "nvls") if self.nvls_bandwidth_GBps is not None else ("ring", "tree")

    @property
    def node_bandwidth_Bps(self) -> float:
        """B_node: the inter-node bandwidth of one node, all its NICs together (bytes/s)."""
        nics = self.gpus_per_node if self.nics_per_node is None else self.nics_per_node
        return (nics or 1) * self.bandwidth_Bps

    def _all_reduce_time(self, algorithm: str, S: float, n: int) -> float:
        if n <= 1:
            return 0.0
        G = self.gpus_per_node
        if G is None:
            return _flat_time("all_reduce", S, n, self.alpha_s, self.bandwidth_Bps, algorithm)
        a_in, b_in = self.intra_alpha_s, self.intra_bandwidth_Bps
        if algorithm == "nvls":
            nvls_bw = self.nvls_bandwidth_GBps * 1e9
            lat = NVLS_LATENCY_US * 1e-6
            if n <= G:
                return lat + S / nvls_bw
            N = -(-n // G)
            a_x = max(self.alpha_s, a_in)
            inter = self.node_bandwidth_Bps * _NVLS_ALGBW_RATIO * (1.0 if N <= 2 else 0.5)
            return lat + 2 * _log2_ceil(N) * a_x + S / min(nvls_bw, inter)
        if n <= G:
            if algorithm == "tree":  # NCCL's tree inside one node is a chain
                return 2 * (n - 1) * a_in + 2.0 / _TREE_BUS_BW_FRACTION * S / b_in
            return _flat_time("all_reduce", S, n, a_in, b_in, algorithm)
        N = -(-n // G)
        a_x = max(self.alpha_s, a_in)
        bw = min(b_in, self.node_bandwidth_Bps)
        if algorithm == "tree":
            return (2 * (G - 1) * a_in + 2 * _log2_ceil(N) * a_x
                    + 2.0 / _TREE_BUS_BW_FRACTION * S / bw)
        return (2 * (n - 1) - 2 * N) * a_in + 2 * N * a_x + 2 * (n - 1) / n * S / bw

    def _other_time(self, kind: str, S: float, n: int) -> float:
        G = self.gpus_per_node
        if G is None:
            return _flat_time(kind, S, n, self.alpha_s, self.bandwidth_Bps, "ring")
        a_in, b_in = self.intra_alpha_s, self.intra_bandwidth_Bps
        if n <= G:
            return _flat_time(kind, S, n, a_in, b_in, "ring")
        a, b = self.alpha_s, self.bandwidth_Bps
        g, N = G, -(-n // G)
        bw = min(b_in, self.node_bandwidth_Bps)
        if kind in ("reduce_scatter", "all_gather"):
            return (n - N) * a_in + (N - 1) * max(a, a_in) + (n - 1) / n * S / bw
        if kind in ("broadcast", "reduce"):
            return (N - 1) * a + (n - N) * a_in + S / bw
        if kind in ("all_to_all", "gather", "scatter"):
            return ((g - 1) * a_in + (n - g) * a
                    + (g - 1) / n * S / b_in + (n - g) / n * S / (self.node_bandwidth_Bps / g))
        return a + S / b  # p2p across nodes: one flow on one NIC

    @staticmethod
    def bus_bandwidth_factor(op: str, nranks: int) -> float:
        """nccl-tests' busbw/algbw factor: 2(n−1)/n for all_reduce; (n−1)/n for all_gather,
        reduce_scatter, all_to_all, gather, scatter; 1 for broadcast, reduce, send/recv; 0 barrier.

        busbw = factor · nbytes / time is comparable with the link bandwidth across n.
        """
        kind, n = _kind(op), nranks
        if kind == "all_reduce":
            return 2 * (n - 1) / n
        if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
            return (n - 1) / n
        return 0.0 if kind == "barrier" else 1.0

    # ---- calibration --------------------------------------------------------------------------

    @classmethod
    def calibrate(cls, measurements: Iterable[tuple[int, int, float]], op: str = "all_reduce",
                  algorithm: str = "ring", *, name: str = "calibrated") -> Network:
        """Fit α and bandwidth of a flat network to ``(nbytes, nranks, seconds)`` measurements.

        Weighted least squares on time = steps·α + factor·S/bw, each row divided by its measured
        time so small (latency-bound) and large (bandwidth-bound) messages count alike. A negative
        α fit is clamped to 0 and the bandwidth refitted. To calibrate the inter-node link of a
        hierarchical fabric, measure with one rank per node.

        >>> true = Network(bandwidth_GBps=3.0, latency_us=40.0)
        >>> data = [(s, 4, true.collective_time("all_reduce", s, 4)) for s in (1e3, 1e6, 1e8)]
        >>> fit = Network.calibrate(data)
        >>> round(fit.bandwidth_GBps, 6), round(fit.latency_us, 6)
        (3.0, 40.0)
        """
        kind = _kind(op)
        if algorithm not in _FIT_ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_FIT_ALGORITHMS} (calibrate fits one "
                             f"fixed formula), got {algorithm!r}")
        if kind == "barrier":
            raise ValueError("a barrier moves no data, so it cannot calibrate a bandwidth; "
                             "measure all_reduce over several message sizes instead")
        rows, times = [], []
        for nbytes, nranks, seconds in measurements:
            if nranks < 2 and kind != "p2p":
                raise ValueError(f"measurement {(nbytes, nranks, seconds)!r}: a collective on "
                                 f"{nranks} rank costs nothing in the model, so it says nothing "
                                 f"about the network; measure with nranks >= 2")
            if not seconds > 0:
                raise ValueError(f"measurement {(nbytes, nranks, seconds)!r}: time must be > 0 s")
            steps, factor = _flat_coefficients(kind, int(nranks), algorithm)
            rows.append((steps, factor * nbytes))
            times.append(seconds)
        A, t = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
        if len(t) < 2 or np.linalg.matrix_rank(A) < 2:
            raise ValueError("calibration needs measurements at two or more message sizes "
                             f"(or rank counts), got {len(t)} measurement(s) that cannot "
                             "separate latency from bandwidth")
        w = 1.0 / t
        (alpha, inv_bw), *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
        if alpha < 0:  # latency too small to resolve: fit the bandwidth alone
            x = A[:, 1] * w
            alpha, inv_bw = 0.0, float(x @ (t * w) / (x @ x))
        if not inv_bw > 0:
            raise ValueError("the measured times do not grow with message size, so no bandwidth "
                             "can be fitted; include larger messages (MBs to GBs)")
        return cls(bandwidth_GBps=float(1.0 / inv_bw) / 1e9, latency_us=float(alpha) * 1e6,
                   algorithm=algorithm, name=name)

    @staticmethod
    def from_measurements(rows: Any, **kw: Any) -> Any:
        """A :class:`~simddp.models.MeasuredNetwork`: collective times interpolated (piecewise in
        log-size) from ``rows`` of ``{op, world_size, bytes, seconds}`` or the path of a
        ``simddp calibrate --json`` file, with an α–β fit as the fallback."""
        from .measured import MeasuredNetwork

        if isinstance(rows, (str, os.PathLike)):
            return MeasuredNetwork.load(rows, **kw)
        return MeasuredNetwork(rows, **kw)

    # ---- presets ------------------------------------------------------------------------------

    @classmethod
    def preset(cls, preset: str, /, **kw: Any) -> Network:
        """A named fabric: "nvlink", "ib-hdr", "ib-ndr", "100gbe", "400gbe", "gloo-loopback",
        and whole DGX nodes "dgx1-v100", "dgx-a100", "dgx-h100", "dgx-b200".

        Keyword arguments override fields, e.g. ``Network.preset("ib-ndr", gpus_per_node=8)``
        (NVLink inside each node, NDR InfiniBand between nodes, one NIC per GPU),
        ``nics_per_node=4`` (4 HCAs shared by the node's GPUs), ``algorithm="ring"`` or
        ``name="my-fabric"`` (the preset's name is positional-only, so ``name`` is a field).
        NCCL presets default to ``algorithm="auto"``; "gloo-loopback" stays "ring" (gloo's).
        """
        try:
            factory = PRESETS[preset]
        except KeyError:
            raise ValueError(f"unknown network preset {preset!r}; known presets: "
                             f"{', '.join(PRESETS)} (or build Network(bandwidth_GBps=..., "
                             f"latency_us=...) yourself)") from None
        return factory(**kw)

    @classmethod
    def nvlink(cls, **kw: Any) -> Network:
        """One node of H100 SXM GPUs on NVLink4/NVSwitch at LINE RATE: 900 GB/s bidirectional per
        GPU, i.e. 450 GB/s each way (NVIDIA H100 datasheet). α = 2 µs: NCCL's tuning.cc puts an
        NVLink ring step at 0.6 (LL) to 3.4 µs (Simple). A generic upper bound: NCCL's rings
        reach ~370 GB/s of it (protocol overhead), so use "dgx-h100" to predict nccl-tests."""
        return cls._make(dict(bandwidth_GBps=450.0, latency_us=2.0, name="nvlink"), kw, False)

    @classmethod
    def infiniband_hdr(cls, **kw: Any) -> Network:
        """HDR InfiniBand, 200 Gb/s = 25 GB/s per NIC (IBTA HDR 4x link; ConnectX-6). α = 5 µs:
        tuning.cc's network ring step is 2.7 (LL) to 14 µs (Simple). ``gpus_per_node=8`` adds
        NVLink inside nodes; ``nics_per_node=4`` for nodes with 4 HCAs (default one per GPU)."""
        return cls._make(dict(bandwidth_GBps=25.0, latency_us=5.0, name="ib-hdr"), kw, True)

    @classmethod
    def infiniband_ndr(cls, **kw: Any) -> Network:
        """NDR InfiniBand, 400 Gb/s = 50 GB/s per NIC (ConnectX-7), α = 5 µs (as HDR)."""
        return cls._make(dict(bandwidth_GBps=50.0, latency_us=5.0, name="ib-ndr"), kw, True)

    @classmethod
    def ethernet_100g(cls, **kw: Any) -> Network:
        """100 Gb/s Ethernet = 12.5 GB/s per NIC. α = 10 µs, a RoCE-class figure; TCP sockets
        are slower (tens of µs): calibrate for those."""
        return cls._make(dict(bandwidth_GBps=12.5, latency_us=10.0, name="100gbe"), kw, True)

    @classmethod
    def ethernet_400g(cls, **kw: Any) -> Network:
        """400 Gb/s Ethernet = 50 GB/s per NIC, α = 10 µs (RoCE-class)."""
        return cls._make(dict(bandwidth_GBps=50.0, latency_us=10.0, name="400gbe"), kw, True)

    @classmethod
    def gloo_loopback(cls, **kw: Any) -> Network:
        """gloo between processes of one CPU host over loopback TCP: ~3 GB/s, ~30 µs a step.
        A rough figure only: it varies several-fold between machines, so calibrate it
        (:meth:`calibrate`) from a microbenchmark on the host you compare against. gloo runs
        rings (no NCCL tuner), so the algorithm stays "ring"."""
        return cls._make(dict(bandwidth_GBps=3.0, latency_us=30.0, name="gloo-loopback",
                              algorithm="ring"), kw, False)

    # ---- whole DGX nodes ----------------------------------------------------------------------
    # Intra-node bandwidth = NVLink links per GPU × NCCL's per-link bandwidth (NCCL
    # src/graph/topo.h: SM70_NVLINK_BW 20.0, SM80_NVLINK_BW 20.0, SM90_NVLINK_BW 20.6,
    # SM100_NVLINK_BW 40.1 GB/s — what NCCL's topology search assigns to one link, ~80 % of the
    # 25 / 25 / 25 / 50 GB/s per-direction line rate, the rest being protocol overhead). These
    # are NCCL's own constants, not fitted to any benchmark table. NVLS bandwidth = NCCL's NVLS
    # channels (16; "NVLS multicast support is available on dev N (NVLS_NCHANNELS 16)" in NCCL's
    # INFO log on H100) × per-link bandwidth × 5/6 (tuning.cc's NVLS bus→algorithm ratio).
    # NICs: line rate of each NIC, NICs per node from the DGX datasheets. α inside = 2 µs
    # (NVLink ring step, as "nvlink"), α across = 5 µs (IB, as "ib-hdr").

    @classmethod
    def dgx1_v100(cls, **kw: Any) -> Network:
        """DGX-1 (V100): 8 GPUs on an NVLink2 hybrid cube-mesh (no NVSwitch, so no NVLS), 4 EDR
        InfiniBand NICs per node. Sources: NVIDIA "DGX-1 with Tesla V100 System Architecture"
        whitepaper (WP-08437-002): 6 NVLink2 links per GPU × 25 GB/s per direction, 4 × 100 Gb/s
        EDR ConnectX-4 per node; NCCL topo.h SM70_NVLINK_BW = 20 GB/s a link, so NCCL's rings
        over the 6 links carry 6 × 20 = 120 GB/s bus bandwidth. (Before this version: 130 GB/s
        inside, an unsourced nccl-tests figure, and 6.25 GB/s per GPU as one NIC per GPU; now
        4 NICs × 12.5 GB/s per node.)"""
        defaults = dict(bandwidth_GBps=12.5, latency_us=5.0, gpus_per_node=8, nics_per_node=4,
                        intra_bandwidth_GBps=6 * 20.0, intra_latency_us=2.0, name="dgx1-v100",
                        algorithm="auto")
        return cls._make(defaults, kw, False)

    @classmethod
    def dgx_a100(cls, **kw: Any) -> Network:
        """DGX A100: 8 A100 SXM4 on NVLink3 + NVSwitch (6 second-gen NVSwitches), 12 NVLink3 links
        per GPU = 600 GB/s bidirectional, 300 GB/s each way (NVIDIA A100 datasheet; DGX A100
        datasheet); NCCL: 12 × SM80_NVLINK_BW 20 = 240 GB/s bus bandwidth. 8 single-port
        ConnectX-6 HDR 200 Gb/s (25 GB/s) NICs for compute per node (DGX A100 datasheet; the two
        further ConnectX-6 are for storage). No NVLS (second-gen NVSwitch has no SHARP)."""
        defaults = dict(bandwidth_GBps=25.0, latency_us=5.0, gpus_per_node=8, nics_per_node=8,
                        intra_bandwidth_GBps=12 * 20.0, intra_latency_us=2.0, name="dgx-a100",
                        algorithm="auto")
        return cls._make(defaults, kw, False)

    @classmethod
    def dgx_h100(cls, **kw: Any) -> Network:
        """DGX H100: 8 H100 SXM5 on NVLink4 + 4 third-gen NVSwitches with NVLink SHARP (NVLS),
        18 NVLink4 links per GPU = 900 GB/s bidirectional, 450 GB/s each way (H100 datasheet,
        DGX H100 datasheet); NCCL: 18 × SM90_NVLINK_BW 20.6 = 370.8 GB/s ring bus bandwidth, and
        NVLS 16 channels × 20.6 × 5/6 = 274.7 GB/s algorithm bandwidth. 8 × ConnectX-7 NDR
        400 Gb/s (50 GB/s) NICs per node (DGX H100 datasheet)."""
        defaults = dict(bandwidth_GBps=50.0, latency_us=5.0, gpus_per_node=8, nics_per_node=8,
                        intra_bandwidth_GBps=18 * 20.6, intra_latency_us=2.0,
                        nvls_bandwidth_GBps=16 * 20.6 * _NVLS_ALGBW_RATIO, name="dgx-h100",
                        algorithm="auto")
        return cls._make(defaults, kw, False)

    @classmethod
    def dgx_b200(cls, **kw: Any) -> Network:
        """DGX B200: 8 B200 on NVLink5 + 2 fifth-gen NVSwitches with NVLS, 18 NVLink5 links per
        GPU = 1.8 TB/s bidirectional, 900 GB/s each way (DGX B200 datasheet); NCCL: 18 ×
        SM100_NVLINK_BW 40.1 = 721.8 GB/s ring bus bandwidth; NVLS assumed 16 channels as on
        H100: 16 × 40.1 × 5/6 = 534.7 GB/s (not confirmed for Blackwell: see the validation
        table, it overshoots B300's published NVLS figure by ~11 %). 8 × ConnectX-7 400 Gb/s
        (50 GB/s) NICs per node (DGX B200 datasheet)."""
        defaults = dict(bandwidth_GBps=50.0, latency_us=5.0, gpus_per_node=8, nics_per_node=8,
                        intra_bandwidth_GBps=18 * 40.1, intra_latency_us=2.0,
                        nvls_bandwidth_GBps=16 * 40.1 * _NVLS_ALGBW_RATIO, name="dgx-b200",
                        algorithm="auto")
        return cls._make(defaults, kw, False)

    @classmethod
    def _make(cls, defaults: dict[str, Any], kw: dict[str, Any], nvlink_inside: bool) -> Network:
        defaults = {"algorithm": "auto", **defaults}  # NCCL presets: NCCL's tuner picks
        fields = {**defaults, **kw}
        if nvlink_inside and fields.get("gpus_per_node") is not None:
            fields.setdefault("intra_bandwidth_GBps", 450.0)  # NVLink4, as in nvlink()
            fields.setdefault("intra_latency_us", 2.0)
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"bad preset argument ({e}); accepted: bandwidth_GBps, latency_us, "
                             "algorithm, gpus_per_node, intra_bandwidth_GBps, intra_latency_us, "
                             "nics_per_node, nvls_bandwidth_GBps, name") from None

    def with_(self, **changes: Any) -> Network:
        """A copy with some fields changed, e.g. ``net.with_(bandwidth_GBps=net.bandwidth_GBps/2)``
        for a degraded link."""
        return replace(self, **changes)


PRESETS: dict[str, Callable[..., Network]] = {
    "nvlink": Network.nvlink,
    "ib-hdr": Network.infiniband_hdr,
    "ib-ndr": Network.infiniband_ndr,
    "100gbe": Network.ethernet_100g,
    "400gbe": Network.ethernet_400g,
    "gloo-loopback": Network.gloo_loopback,
    "dgx1-v100": Network.dgx1_v100,
    "dgx-a100": Network.dgx_a100,
    "dgx-h100": Network.dgx_h100,
    "dgx-b200": Network.dgx_b200,
}
