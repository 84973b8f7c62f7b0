"""Network cost model: how long one collective takes, α–β style, after NCCL.

A :class:`Network` answers ``collective_time(op, nbytes, nranks)`` in seconds, with α =
``latency_us`` per algorithm step and bw = ``bandwidth_GBps`` (1 GB/s = 1e9 bytes/s)::

    >>> net = Network(bandwidth_GBps=10.0, latency_us=5.0)
    >>> round(net.collective_time("all_reduce", 100_000_000, 4), 6)   # 6·5 µs + 1.5·100 MB/10 GB/s
    0.01503
    >>> Network.preset("ib-hdr", gpus_per_node=8).collective_time("all_reduce", 1 << 20, 64) > 0
    True

The formulas — NCCL's own performance model (ring, tree, NVLS; flat and two-level fabrics; the
byte convention of nccl-tests) — live in :mod:`simddp.models.algorithms`; the named fabrics and
their sources in :mod:`simddp.models.presets`; how communication slows the rank's compute, and
what issuing a collective costs it, in :mod:`simddp.models.contention` (a network's
``contention``); where a communicator sits on the fabric's tiers in
:mod:`simddp.models.placement` (:meth:`Network.placed`). A network that runs NCCL (``nccl``,
every NCCL preset) is costed in replay by NCCL's tuning model on top of these formulas
(:mod:`simddp.models.nccl_latency`); ``collective_time`` itself is the α–β model.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Iterable

import numpy as np

from fakepg import ops
from fakepg.arguments import integer, number

from . import algorithms as _alg
from .algorithms import NVLS_LATENCY_US
from .contention import Contention, as_contention
from .placement import Placement, Tier, as_placement

__all__ = ["Network", "NVLS_LATENCY_US"]

_ALGORITHMS = ("ring", "tree", "nvls", "auto")
_FIT_ALGORITHMS = ("ring", "tree")  # what calibrate() can fit: fixed step/byte coefficients


def _kind(op: str) -> str:
    """The cost formula of ``op`` (fakepg's registry; ValueError naming the known ops)."""
    return ops.cost_kind(op)


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
        the fastest for each size and rank count; see :mod:`simddp.models.algorithms`).
    gpus_per_node: ranks per node; None = one flat fabric.
    intra_bandwidth_GBps, intra_latency_us: the link inside a node; default to the inter values.
        The bandwidth is a GPU's NCCL bus bandwidth inside the node (what nccl-tests reports
        for a large ring all_reduce on one node).
    nics_per_node: NICs per node sharing the node's inter-node traffic; None = one per GPU.
        A 4-NIC node of 8 GPUs has half the inter-node bandwidth of an 8-NIC one.
    nvls_bandwidth_GBps: NVLink SHARP all_reduce algorithm bandwidth inside a node (NVSwitch
        with in-switch reduction: H100, B200); None = no NVLS.
    contention: how this fabric's collectives slow the issuing rank's compute while in flight,
        and the fixed compute-stream cost of issuing one (:class:`~simddp.models.Contention`, or
        a dict of its fields); None = neither. Replay applies it; co-simulation does not yet.
    nccl: the fabric runs NCCL, so replay costs its collectives with NCCL's tuning model
        (:mod:`simddp.models.nccl_latency`: per-collective latency, algorithm and protocol by
        size and scale) unless the ``protocol_latency`` knob says otherwise. NCCL presets set
        it; a ``Network(...)`` you build is the plain α–β model unless you set it.
    gpu: the GPU of the nodes ("v100", "a100", "h100", ...; None = not stated): NCCL's
        tuning constants by generation, and the SM-share contention replay applies by default
        (:mod:`simddp.models.gpu_contention`).
    intra_link: "nvlink" or "pci", the link inside a node (NCCL's hardware latencies).
    collnet: the switches reduce in-network (SHARP), so NCCL's CollNet algorithms are
        candidates for all_reduce across nodes (NCCL_COLLNET_ENABLE=1 with the SHARP plugin).
    tiers: the switch tiers above the node (:class:`~simddp.models.placement.Tier`: a leaf
        group, a pod...), innermost first, each with its uplinks' oversubscription.
    crossing: set by :meth:`placed`: the (domains spanned, oversubscription) of each
        oversubscribed tier the communicator crosses; () for a fabric as a whole.

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
    contention: Contention | None = None
    # simddp.models.measured registers MeasuredNetwork here (it builds on Network, so Network
    # cannot import it): what from_measurements() returns
    measured: ClassVar[Any] = None
    # likewise simddp.models.presets registers its preset() here (its table builds Networks)
    presets: ClassVar[Any] = None
    nccl: bool = False
    gpu: str | None = None
    intra_link: str = "nvlink"
    collnet: bool = False
    tiers: tuple[Tier, ...] = ()
    crossing: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # a capture's JSON (dataclasses.asdict) gives lists and dicts back: restore them
        if not isinstance(self.tiers, tuple) or any(isinstance(t, dict) for t in self.tiers):
            object.__setattr__(self, "tiers", tuple(
                Tier(**t) if isinstance(t, dict) else t for t in self.tiers))
        if not isinstance(self.crossing, tuple) or any(
                not isinstance(c, tuple) for c in self.crossing):
            object.__setattr__(self, "crossing", tuple(
                (int(d), float(o)) for d, o in self.crossing))
        self._check_fabric()
        if self.contention is not None and not isinstance(self.contention, Contention):
            object.__setattr__(self, "contention", as_contention(self.contention, "Network"))
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

    def _check_fabric(self) -> None:
        if self.intra_link not in ("nvlink", "pci"):
            raise ValueError(f"Network.intra_link must be 'nvlink' or 'pci', got "
                             f"{self.intra_link!r}")
        if not self.tiers:
            return
        if self.gpus_per_node is None:
            raise ValueError("Network.tiers describe switches above the node, so they need "
                             "gpus_per_node; pass gpus_per_node=8 (say) as well, or drop tiers")
        inner = self.gpus_per_node
        for t in self.tiers:
            if not isinstance(t, Tier):
                raise TypeError(f"Network.tiers must hold simddp.models.placement.Tier, got "
                                f"{t!r}")
            if t.gpus % inner:
                raise ValueError(f"tier {t.name!r} of {t.gpus} GPUs does not hold whole "
                                 f"domains of the tier below ({inner} GPUs); give a multiple")
            inner = t.gpus

    def describe(self) -> dict[str, Any]:
        """The parameters a sweep table shows (:class:`~simddp.models.NetworkModel`)."""
        return {"network": self.name, "bandwidth_GBps": self.bandwidth_GBps,
                "latency_us": self.latency_us, "gpus_per_node": self.gpus_per_node,
                "algorithm": self.algorithm,
                **(self.contention.describe() if self.contention is not None else {})}

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
                return min(_alg.all_reduce_time(self, a, S, nranks) for a in _alg.candidates(self))
            return _alg.all_reduce_time(self, algorithm, S, nranks)
        return _alg.other_time(self, kind, nbytes, nranks)


    def placed(self, placement: Placement | int) -> Network:
        """The fabric as a communicator placed as ``placement`` sees it (a
        :class:`~simddp.models.placement.Placement`, or a bare count of members per node; see
        :mod:`simddp.models.algorithms`, "Placement"): nodes of ``per_node`` ranks, each with
        ``per_node / gpus_per_node`` of the node's NIC bandwidth (the node runs
        ``gpus_per_node / per_node`` such communicators at once), NVLS only where a node holds
        several members, and the oversubscribed tiers it crosses (``crossing``).
        ``per_node >= gpus_per_node`` (contiguous) crossing no oversubscribed tier, or a flat
        fabric: ``self``. Cached per instance.

        >>> net = Network.preset("dgx-h100")
        >>> one = net.placed(1)                       # one member per node: one NIC each
        >>> one.gpus_per_node, one.node_bandwidth_Bps / 1e9, one.nvls_bandwidth_GBps
        (1, 50.0, None)
        >>> net.placed(8) is net
        True
        """
        G = self.gpus_per_node
        p = as_placement(placement)
        if G is None:
            return self
        crossing = p.crossing(self.tiers)
        per_node = p.per_node
        if per_node >= G and not crossing:
            return self
        cache = self.__dict__.setdefault("_placed", {})
        key = (per_node, crossing) if crossing else per_node
        net = cache.get(key)
        if net is None:
            if per_node >= G:
                net = replace(self, crossing=crossing)
            else:
                # per_node "NICs" of the node's per-GPU NIC share: B_node · per_node / G in all
                nvls = self.nvls_bandwidth_GBps if per_node > 1 else None
                algorithm = "auto" if self.algorithm == "nvls" and nvls is None else \
                    self.algorithm
                net = replace(self, gpus_per_node=per_node, nics_per_node=per_node,
                              bandwidth_GBps=self.node_bandwidth_Bps / G / 1e9,
                              nvls_bandwidth_GBps=nvls, algorithm=algorithm,
                              tiers=(), crossing=crossing)
            cache[key] = net
        return net

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
        return min(_alg.candidates(self), key=lambda a: _alg.all_reduce_time(self, a, S, nranks))


    @property
    def node_bandwidth_Bps(self) -> float:
        """B_node: the inter-node bandwidth of one node, all its NICs together (bytes/s)."""
        nics = self.gpus_per_node if self.nics_per_node is None else self.nics_per_node
        return (nics or 1) * self.bandwidth_Bps

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
            steps, factor = _alg.flat_coefficients(kind, int(nranks), algorithm)
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
        measured = Network.measured
        if measured is None:
            raise RuntimeError("simddp.models.measured is not loaded: import simddp.models")
        if isinstance(rows, (str, os.PathLike)):
            return measured.load(rows, **kw)
        return measured(rows, **kw)


    # ---- presets (simddp.models.presets) ------------------------------------------------------

    @classmethod
    def preset(cls, preset: str, /, **kw: Any) -> Network:
        """A named fabric from the one preset table, :data:`simddp.models.presets.PRESETS` (each
        with its source): links such as "ib-ndr" or "100gbe", whole DGX nodes such as "dgx-h100".

        Keyword arguments override fields, e.g. ``Network.preset("ib-ndr", gpus_per_node=8)``
        (NVLink inside each node, NDR InfiniBand between nodes, one NIC per GPU),
        ``nics_per_node=4`` (4 HCAs shared by the node's GPUs), ``algorithm="ring"``,
        ``contention=Contention(...)`` or ``name="my-fabric"`` (the preset's name is
        positional-only, so ``name`` is a field). NCCL presets default to ``algorithm="auto"``;
        "gloo-loopback" stays "ring" (gloo's).
        """
        if Network.presets is None:
            raise RuntimeError("simddp.models.presets is not loaded: import simddp.models")
        return Network.presets(preset, **kw)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON holds them (lists, not tuples), so a capture that stores its
        network compares equal after a round trip; ``Network(**d)`` rebuilds it."""
        d = asdict(self)
        d["tiers"] = [dict(t) for t in d["tiers"]]
        d["crossing"] = [list(c) for c in d["crossing"]]
        return d

    def with_(self, **changes: Any) -> Network:
        """A copy with some fields changed, e.g. ``net.with_(bandwidth_GBps=net.bandwidth_GBps/2)``
        for a degraded link."""
        return replace(self, **changes)
