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
tree 90 % of the link's bus bandwidth (``busBw*.9``) and converts bus bandwidth to algorithm
bandwidth with the ratio 0.5 (every byte goes up the tree reduced, then down it broadcast), where
a ring gets n/(2(n−1)). So trees win on latency (log n steps) and rings on bandwidth, which is
why NCCL picks trees for small messages at scale and rings for large ones.

Hierarchy (``gpus_per_node`` = G set and n > G): ranks form N = ⌈n/G⌉ nodes of g = G ranks, each
GPU with its own NIC of ``bandwidth_GBps`` (one NIC per GPU, as in a DGX) and an intra-node link of
``intra_bandwidth_GBps`` / ``intra_latency_us``. Phases run one after another (times add):

* all_reduce = intra reduce_scatter(S, g) + inter all_reduce(S/g, N; ``algorithm``)
  + intra all_gather(S, g) — each local rank all-reduces its shard over its own rail;
* reduce_scatter = intra reduce_scatter(S, g) + inter reduce_scatter(S/g, N); all_gather mirrors it;
* broadcast / reduce = one pipelined chain through all ranks: (N−1)·α + (n−N)·α_intra
  + S/min(bw_intra, g·bw) (NCCL spreads the chain's channels over the node's g NICs);
* all_to_all, gather, scatter: each peer costs one step on its link:
  (g−1)·α_intra + (n−g)·α + (g−1)/n·S/bw_intra + (n−g)/n·S/bw;
* barrier = the all_reduce decomposition with 0 bytes;
* send/recv = α + S/bw (the group spans nodes, so the peer may be remote).

With equal intra and inter links the bandwidth terms reduce to the flat ones. When all n ranks fit
in one node (n ≤ G) the flat formulas run on the intra link. A last, partly filled node is
treated as full (an approximation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import numpy as np

from fakepg import ops
from fakepg.arguments import integer, number

__all__ = ["Network", "PRESETS"]

_ALGORITHMS = ("ring", "tree")
_TREE_BUS_BW_FRACTION = 0.9  # NCCL tuning.cc: `if (a == NCCL_ALGO_TREE) busBw = ... busBw*.9`


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

    bandwidth_GBps: inter-node bandwidth per rank (per NIC), GB/s = 1e9 bytes/s, one direction.
    latency_us: α, the latency of one algorithm step on that link.
    algorithm: "ring" or "tree" (NCCL's two all_reduce algorithms).
    gpus_per_node: ranks per node; None = one flat fabric.
    intra_bandwidth_GBps, intra_latency_us: the link inside a node; default to the inter values.

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

    def __post_init__(self) -> None:
        _check_number("bandwidth_GBps", self.bandwidth_GBps, allow_zero=False,
                      hint="give the link bandwidth in GB/s, e.g. 12.5 for 100 Gb/s Ethernet")
        _check_number("latency_us", self.latency_us, allow_zero=True,
                      hint="give the per-step latency in microseconds, e.g. 5.0")
        if self.algorithm not in _ALGORITHMS:
            raise ValueError(f"Network.algorithm must be one of {_ALGORITHMS}, "
                             f"got {self.algorithm!r}")
        if self.gpus_per_node is None:
            for field in ("intra_bandwidth_GBps", "intra_latency_us"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"Network.{field} describes the link inside a node, so it needs "
                        f"gpus_per_node; pass gpus_per_node=8 (say) as well, or drop {field}")
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
        n, S = nranks, nbytes
        G = self.gpus_per_node
        if G is None:
            return _flat_time(kind, S, n, self.alpha_s, self.bandwidth_Bps, self.algorithm)
        a_in, b_in = self.intra_alpha_s, self.intra_bandwidth_Bps
        if n <= G:
            return _flat_time(kind, S, n, a_in, b_in, self.algorithm)

        a, b = self.alpha_s, self.bandwidth_Bps
        g, N = G, -(-n // G)
        if kind in ("all_reduce", "barrier"):
            S = 0 if kind == "barrier" else S
            return (_flat_time("reduce_scatter", S, g, a_in, b_in, "ring")
                    + _flat_time(kind, S / g, N, a, b, self.algorithm)
                    + _flat_time("all_gather", S, g, a_in, b_in, "ring"))
        if kind in ("reduce_scatter", "all_gather"):
            return (_flat_time(kind, S, g, a_in, b_in, "ring")
                    + _flat_time(kind, S / g, N, a, b, "ring"))
        if kind in ("broadcast", "reduce"):
            return (N - 1) * a + (n - N) * a_in + S / min(b_in, g * b)
        if kind in ("all_to_all", "gather", "scatter"):
            return ((g - 1) * a_in + (n - g) * a
                    + (g - 1) / n * S / b_in + (n - g) / n * S / b)
        return a + S / b  # p2p across nodes

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
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
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
        "dgx1-v100".

        Keyword arguments override fields, e.g. ``Network.preset("ib-ndr", gpus_per_node=8)``
        (NVLink inside each node, NDR InfiniBand between nodes), ``algorithm="tree"`` or
        ``name="my-fabric"`` (the preset's name is positional-only, so ``name`` is a field).
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
        """One node of H100 SXM GPUs on NVLink4/NVSwitch: 900 GB/s bidirectional per GPU, i.e.
        450 GB/s each way (NVIDIA H100 datasheet). α = 2 µs: NCCL's tuning.cc puts an NVLink ring
        step at 0.47 (LL) to 3.4 µs (Simple)."""
        return cls._make(dict(bandwidth_GBps=450.0, latency_us=2.0, name="nvlink"), kw, False)

    @classmethod
    def infiniband_hdr(cls, **kw: Any) -> Network:
        """HDR InfiniBand, 200 Gb/s = 25 GB/s per NIC. α = 5 µs: tuning.cc's network ring step
        is 2.7 (LL) to 9.6 µs (Simple). ``gpus_per_node=8`` adds NVLink inside nodes."""
        return cls._make(dict(bandwidth_GBps=25.0, latency_us=5.0, name="ib-hdr"), kw, True)

    @classmethod
    def infiniband_ndr(cls, **kw: Any) -> Network:
        """NDR InfiniBand, 400 Gb/s = 50 GB/s per NIC, α = 5 µs (as HDR)."""
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
        (:meth:`calibrate`) from a microbenchmark on the host you compare against."""
        return cls._make(dict(bandwidth_GBps=3.0, latency_us=30.0, name="gloo-loopback"),
                         kw, False)

    @classmethod
    def dgx1_v100(cls, **kw: Any) -> Network:
        """DGX-1 (V100): 8 GPUs per node on an NVLink2 hybrid cube-mesh, 4 EDR InfiniBand NICs
        per node. MINIMAL ENTRY added for ``simddp whatif --network dgx1-v100`` (the cost
        models' presets may replace it). Sources: NVIDIA "DGX-1 with Tesla V100 System
        Architecture" whitepaper (WP-08437-002): 6 NVLink2 links × 25 GB/s per direction per
        GPU; NCCL rings over the cube-mesh reach ~130 GB/s all_reduce busbw (nccl-tests on
        DGX-1V); 4 × 100 Gb/s EDR = 50 GB/s per node shared by 8 GPUs, i.e. 6.25 GB/s per
        GPU (this model has one NIC per GPU)."""
        defaults = dict(bandwidth_GBps=6.25, latency_us=5.0, gpus_per_node=8,
                        intra_bandwidth_GBps=130.0, intra_latency_us=2.0, name="dgx1-v100")
        return cls._make(defaults, kw, False)

    @classmethod
    def _make(cls, defaults: dict[str, Any], kw: dict[str, Any], nvlink_inside: bool) -> Network:
        fields = {**defaults, **kw}
        if nvlink_inside and fields.get("gpus_per_node") is not None:
            fields.setdefault("intra_bandwidth_GBps", 450.0)  # NVLink4, as in nvlink()
            fields.setdefault("intra_latency_us", 2.0)
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"bad preset argument ({e}); accepted: bandwidth_GBps, latency_us, "
                             "algorithm, gpus_per_node, intra_bandwidth_GBps, intra_latency_us, "
                             "name") from None

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
    "dgx1-v100": Network.dgx1_v100,  # minimal entry (cli branch); see Network.dgx1_v100
}
