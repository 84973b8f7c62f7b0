"""NCCL's tuning model: per collective, the algorithm and protocol NCCL picks, and its time.

NCCL costs every (algorithm, protocol) pair of a collective as ``latency + bytes / bandwidth``
and runs the cheapest (``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``, NVIDIA/nccl
``src/graph/tuning.cc``, the 2.19–2.2x version quoted below). :class:`ProtocolLatency` does the
same on top of a :class:`~simddp.Network` (the inner model, placed: nodes of ``gpus_per_node``
ranks, N nodes, ppn = n/N ranks a node):

* **latency** (µs) from tuning.cc's tables, ``baseLat[a][p]`` plus its hardware latency per
  step ``hwLat[hw][a][p]`` (hw = NVLink or PCI inside a node, NET across):

  - ring all_reduce: 2(n−1) steps, 2N of them across nodes (none on one node);
    all_gather / reduce_scatter: n−1 steps, N−1 across; the steps inside a node across
    nodes cost at least NCCL's network post overhead (1 µs; ×3 for Simple); broadcast /
    reduce: one step (NCCL's duplicated channels, ``sameChannels``);
  - tree: 2·((ppn−1)·intra + ⌊log2 N⌋·inter);
  - NVLS (one node): its 23 µs NVLink step; NVLS tree (several nodes): 23 µs +
    2·⌊log2 N⌋ · 14 µs;
  - CollNet (SHARP switches, ``Network.collnet``): Direct 2·(min(1, ppn−1)·intra +
    0.4·(ppn−1)) + 31 µs, Chain 2·(ppn−1)·intra + 30 µs;
  - ring / Simple all_reduce across nodes: × 1.4 (× 1.9 before Ampere) once each rank's
    channel share reaches 64 bytes (NCCL's "plateau effect of ring");

* **bandwidth**: the inner network's α–β bandwidth term for the algorithm (ring, tree, NVLS:
  :mod:`simddp.models.algorithms`, which already holds tree's 0.9 and NVLS's 5/6) at the
  Simple protocol, and tuning.cc's factors for the others: LL carries 8 data bytes in 16
  (ring: ¼ of the bus bandwidth across nodes or for all_reduce, ⅓ otherwise; tree: 1/3.8),
  capped at ``llMaxBw`` (by GPU inside a node, by CPU vendor across); LL128 carries 120 of 128
  (ring: × 0.92, × 0.7 at one rank a node; tree: × 120/128 across nodes, × 7/9 inside);
  tree's measured correction factor by size (``treeCorrectionFactor``). LL128 runs on NVLink
  systems of one GPU generation (Volta, Ampere, Hopper); NVLS and CollNet run Simple only.

The inner network's own per-step α (``latency_us``) is replaced by these latencies: with
NCCL's model on, α is NCCL's. all_to_all, gather, scatter and send/recv do not go through
NCCL's tuner (they are grouped point-to-point): the inner model's time plus Simple's
``baseLat`` 8.4 µs. A model that is not a :class:`~simddp.Network` (a
:class:`~simddp.models.MeasuredNetwork`, whose latency is measured) gets the cheapest
protocol's ``baseLat`` and bandwidth penalty added to its time, as before.

Constants: tuning.cc at NVIDIA/nccl b6475625 (2.19–2.2x): baseLat Tree {LL 6.8, LL128 14.0,
Simple 0}, Ring {6.6, 14.0, 8.4}; hwLat NVLink Tree {.6, 1.25, 28}, Ring {.6, 1.9, 3.4},
NVLS 23, NVLS tree 23, CollNet Direct 3.7, Chain 2.8; PCI Tree {1.0, 1.9, 28}, Ring {1.0,
2.5, 5.7}; NET Tree {5.0, 8.5, 28}, Ring {2.7, 4.0, 14.0}, NVLS 18, NVLS tree 14, CollNet
Direct 31, Chain 30.

>>> from simddp.models import Network
>>> net = ProtocolLatency(Network.preset("dgx-h100"))
>>> [net.chosen("all_reduce", s, 8) for s in (1 << 10, 1 << 30)]          # one node
[('ring', 'LL'), ('nvls', 'Simple')]
>>> [net.chosen("all_reduce", s, 1024) for s in (1 << 10, 1 << 30)]       # 128 nodes
[('tree', 'LL'), ('nvls_tree', 'Simple')]
>>> ib = ProtocolLatency(Network.preset("ib-ndr", gpus_per_node=8))       # no NVLS
>>> [ib.chosen("all_reduce", s, 16) for s in (1 << 10, 1 << 20, 1 << 30)]
[('tree', 'LL'), ('tree', 'LL128'), ('ring', 'Simple')]
"""

from __future__ import annotations

from typing import Any

from fakepg import ops

from . import algorithms as _alg
from .network import Network
from .protocols import collective_time, placed

__all__ = ["BASE_LATENCY_US", "HW_LATENCY_US", "PROTOCOL_EFFICIENCY", "ProtocolLatency",
           "base_latency_s", "tuned_time"]

PROTOCOLS = ("LL", "LL128", "Simple")
# tuning.cc baseLat[algorithm][protocol], µs (NVLS, NVLS tree, CollNet: 0)
BASE_LATENCY_US: dict[str, dict[str, float]] = {
    "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 0.0},
    "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
    "nvls": {"Simple": 0.0}, "nvls_tree": {"Simple": 0.0},
    "collnet_direct": {"Simple": 0.0}, "collnet_chain": {"Simple": 0.0},
}
# tuning.cc hwLat[hw][algorithm][protocol], µs
HW_LATENCY_US: dict[str, dict[str, dict[str, float]]] = {
    "nvlink": {"tree": {"LL": 0.6, "LL128": 1.25, "Simple": 28.0},
               "ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
               "collnet_direct": {"Simple": 3.7}, "collnet_chain": {"Simple": 2.8},
               "nvls": {"Simple": 23.0}, "nvls_tree": {"Simple": 23.0}},
    "pci": {"tree": {"LL": 1.0, "LL128": 1.9, "Simple": 28.0},
            "ring": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
            "collnet_direct": {"Simple": 3.7}, "collnet_chain": {"Simple": 2.8},
            "nvls": {"Simple": 0.0}, "nvls_tree": {"Simple": 0.0}},
    "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 28.0},
            "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
            "collnet_direct": {"Simple": 31.0}, "collnet_chain": {"Simple": 30.0},
            "nvls": {"Simple": 18.0}, "nvls_tree": {"Simple": 14.0}},
}
NET_OVERHEAD_US = 1.0  # tuning.cc getNetOverhead: 1 µs on Intel CPUs (2 on AMD), ×3 for Simple
# tuning.cc llMaxBws (GB/s): [GPU generation inside a node | CPU vendor across][1, 2, >2 nodes]
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
             "hopper": (87.7, 22.5, 19.0), "intel": (39.0, 39.0, 20.4),
             "amd": (87.7, 22.5, 19.0)}
# treeCorrectionFactor[protocol][log2(bytes/64)], 64 B .. 256 MB
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9),
}
# GPU → (generation, the host CPU vendor of its preset's node): DGX-1 (P100/V100) Intel Xeon
# E5-2698 v4, DGX A100 2 × AMD EPYC 7742, DGX H100 / B200 2 × Intel Xeon Platinum 8480C /
# 8570 (the DGX datasheets); unknown GPUs: Hopper on Intel
GPU_GENERATION = {"p100": ("volta", "intel"), "v100": ("volta", "intel"),
                  "a100": ("ampere", "amd"), "h100": ("hopper", "intel"),
                  "h200": ("hopper", "intel"), "b200": ("hopper", "intel")}
LL128_GPUS = ("v100", "a100", "h100", "h200")  # tuning.cc: compute capability 70, 80, 90
RING_PLATEAU = {"volta": 1.9, "ampere": 1.4, "hopper": 1.4}
PLATEAU_CHANNELS = 24  # NCCL's channels on an 8-GPU NVSwitch node (gpu_contention's A100/H100)
PROTOCOL_EFFICIENCY = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
_TUNED = ("all_reduce", "barrier", "all_gather", "reduce_scatter", "broadcast", "reduce")


# the additive form's per-collective latency (models whose own latency is measured): NCCL
# 2.19's baseLat with Simple's 8.4 µs for both ring and tree, NVLS's 23 µs step
_ADDITIVE_US = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4},
                "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}, "nvls": {"Simple": 23.0}}


def base_latency_s(algorithm: str, beta_s: float) -> float:
    """NCCL's fixed cost (s) plus the protocol's bandwidth penalty, for the cheapest protocol
    of ``algorithm`` on a collective whose bandwidth term at full efficiency is ``beta_s``
    (the additive form for models whose own latency is measured)."""
    table = _ADDITIVE_US.get(algorithm, _ADDITIVE_US["ring"])
    return min(us * 1e-6 + (1.0 / PROTOCOL_EFFICIENCY[p] - 1.0) * beta_s
               for p, us in table.items())


def _log2i(n: int) -> int:
    return max(n, 1).bit_length() - 1


def _shape(net: Any, n: int) -> tuple[int, int]:
    """(nodes, ranks per node) of n ranks of the placed ``net`` (flat: a node per rank)."""
    G = net.gpus_per_node
    if G is None:
        return n, 1
    N = -(-n // G) if n > G else 1
    return N, max(1, n // N)


def _algorithms(net: Any, kind: str, N: int, ppn: int) -> tuple[str, ...]:
    if kind in ("all_gather", "reduce_scatter", "broadcast", "reduce"):
        return ("ring",)  # NVLS all_gather/reduce_scatter lose to ring (nccl#1083)
    forced = net.algorithm
    if forced in ("ring", "tree"):
        return (forced,)
    out = ["ring", "tree"]
    nvls = net.nvls_bandwidth_GBps is not None and ppn > 1
    if nvls:
        out.append("nvls" if N == 1 else "nvls_tree")
    if forced == "nvls" and nvls:
        return (out[-1],)
    if getattr(net, "collnet", False) and N > 1:
        out += ["collnet_direct", "collnet_chain"]
    return tuple(out)


def _latency_us(net: Any, kind: str, a: str, p: str, n: int, N: int, ppn: int) -> float:
    intra_hw = getattr(net, "intra_link", "nvlink")
    base = BASE_LATENCY_US[a][p]
    intra = HW_LATENCY_US[intra_hw][a][p]
    inter = HW_LATENCY_US["net"][a][p]
    if a == "ring":
        if kind in ("broadcast", "reduce"):
            return base + HW_LATENCY_US[intra_hw if N == 1 else "net"][a][p]
        if kind == "all_reduce":
            steps, x = 2 * (n - 1), (2 * N if N > 1 else 0)
        else:
            steps, x = n - 1, N - 1
        if N > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if p == "Simple" else 1))
        return base + (steps - x) * intra + x * inter
    if a == "tree":
        return base + 2 * ((ppn - 1) * intra + _log2i(N) * inter)
    if a == "nvls":
        return intra
    if a == "nvls_tree":
        return base + intra + 2 * _log2i(N) * inter
    if a == "collnet_direct":
        return base + 2 * (min(1, ppn - 1) * intra + (ppn - 1) * 0.4) + inter
    return base + 2 * (ppn - 1) * intra + inter  # collnet_chain


def _beta(net: Any, kind: str, a: str, S: float, n: int, N: int) -> float:
    """The inner model's bandwidth term (s) for algorithm ``a`` at the Simple protocol."""
    if kind == "all_reduce":
        if a in ("collnet_direct", "collnet_chain"):
            # in-switch reduction: a node sends S and receives S over its NICs, like NVLS
            # tree; tuning.cc: × 0.9 bus → algorithm, × 0.85 on Hopper (Direct)
            bw = min(net.intra_bandwidth_Bps, _alg.node_bandwidth(net, N)) * 0.5 * 0.9
            return S / bw
        algo = "nvls" if a == "nvls_tree" else a
        return _alg.all_reduce_time(net, algo, S, n) - _alg.all_reduce_time(net, algo, 0, n)
    return _alg.other_time(net, kind, S, n) - _alg.other_time(net, kind, 0, n)


def _bus_factor(kind: str, n: int) -> float:
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    return (n - 1) / n if kind in ("all_gather", "reduce_scatter") else 1.0


def _protocol_beta(net: Any, kind: str, a: str, p: str, beta: float, S: float, n: int,
                   N: int, ppn: int) -> float:
    gen, cpu = GPU_GENERATION.get(getattr(net, "gpu", None) or "", ("hopper", "intel"))
    ll_max = LL_MAX_BW[gen if N == 1 else cpu][min(N, 3) - 1] * 1e9
    if a == "ring":
        if p == "LL":
            share = 4.0 if (N > 1 or kind in ("all_reduce", "reduce")) else 3.0
            return max(beta * share, _bus_factor(kind, n) * S / ll_max)
        if p == "LL128":
            return beta / (0.7 if ppn < 2 else 0.92)
        return beta
    if a == "tree":
        b = beta
        if p == "LL":
            b = max(beta * 3.8, 2 * S / ll_max)
        elif p == "LL128":
            b = beta / (7 / 9 if N == 1 else 120 / 128)
        log_size = _log2i(int(S) >> 6) if S >= 64 else 0
        if log_size < 23:
            b /= TREE_CORRECTION[p][log_size]
        return b
    return beta


def _protocols(net: Any, a: str) -> tuple[str, ...]:
    if a not in ("ring", "tree"):
        return ("Simple",)
    gpu = getattr(net, "gpu", None)
    ll128 = getattr(net, "intra_link", "nvlink") == "nvlink" and (gpu is None or
                                                                  gpu in LL128_GPUS)
    return PROTOCOLS if ll128 else ("LL", "Simple")


def tuned(net: Any, op: str, nbytes: float, n: int) -> tuple[float, str, str]:
    """(seconds, algorithm, protocol) NCCL's tuner picks for ``op`` on the (placed) Network
    ``net``; n ≥ 2 and an op NCCL tunes (all_reduce, barrier, all_gather, reduce_scatter,
    broadcast, reduce)."""
    kind = ops.cost_kind(op)
    S = 0.0 if kind == "barrier" else float(nbytes)
    if kind == "barrier":
        kind = "all_reduce"
    N, ppn = _shape(net, n)
    gen = GPU_GENERATION.get(getattr(net, "gpu", None) or "", ("hopper", "intel"))[0]
    best = (float("inf"), "ring", "Simple")
    for a in _algorithms(net, kind, N, ppn):
        beta = _beta(net, kind, a, S, n, N)
        for p in _protocols(net, a):
            lat = _latency_us(net, kind, a, p, n, N, ppn)
            if (a == "ring" and p == "Simple" and kind == "all_reduce" and N > 1
                    and S / (PLATEAU_CHANNELS * n) >= 64):
                lat *= RING_PLATEAU[gen]
            t = lat * 1e-6 + _protocol_beta(net, kind, a, p, beta, S, n, N, ppn)
            if t < best[0]:
                best = (t, a, p)
    return best


def tuned_time(net: Any, op: str, nbytes: float, n: int) -> float:
    """Seconds of ``op`` on the (placed) Network ``net`` under NCCL's tuning model."""
    return tuned(net, op, nbytes, n)[0]


class ProtocolLatency:
    """``inner`` (a :class:`~simddp.models.NetworkModel`) under NCCL's tuning model (see the
    module docstring); every other attribute is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def gpus_per_node(self) -> int | None:
        return self.inner.gpus_per_node

    def placed(self, placement: Any) -> ProtocolLatency:
        """``inner`` placed (:meth:`simddp.Network.placed`), under the same model."""
        inner = placed(self.inner, placement)
        if inner is self.inner:
            return self
        cache = self.__dict__.setdefault("_placed", {})
        net = cache.get(id(inner))
        if net is None or net.inner is not inner:
            net = cache[id(inner)] = ProtocolLatency(inner)
        return net

    def _tunes(self) -> bool:
        return isinstance(self.inner, Network)  # the class whose formulas the tuner reads

    def chosen(self, op: str, nbytes: int, nranks: int) -> tuple[str, str]:
        """(algorithm, protocol) of this call: NCCL's choice on a Network; on another model
        ("ring" or its own choice, and the cheapest protocol's name is not known: "Simple")."""
        try:
            kind = ops.cost_kind(op)
        except ValueError:
            op, kind = "all_reduce", "all_reduce"
        if self._tunes() and kind in _TUNED and nranks > 1:
            _, a, p = tuned(self.inner, op, nbytes, nranks)
            return a, p
        chosen = getattr(self.inner, "chosen_algorithm", None)
        return (chosen(op, nbytes, nranks) if chosen is not None else "ring"), "Simple"

    def collective_time(self, op: str, nbytes: int, nranks: int) -> float:
        if nranks <= 1:
            return collective_time(self.inner, op, nbytes, nranks)
        cache = self.__dict__.setdefault("_times", {})
        key = (op, nbytes, nranks)
        hit = cache.get(key)
        if hit is not None:
            return hit
        try:
            kind = ops.cost_kind(op)
        except ValueError:
            op, kind = "all_reduce", "all_reduce"
        if self._tunes() and kind in _TUNED:
            out = tuned(self.inner, op, nbytes, nranks)[0]
        elif self._tunes():  # grouped point-to-point: NCCL's fixed cost on the model's time
            out = (collective_time(self.inner, op, nbytes, nranks)
                   + BASE_LATENCY_US["ring"]["Simple"] * 1e-6)
        else:
            t = collective_time(self.inner, op, nbytes, nranks)
            beta = max(0.0, t - collective_time(self.inner, op, 0, nranks))
            chosen = getattr(self.inner, "chosen_algorithm", None)
            algo = chosen(op, nbytes, nranks) if chosen is not None else "ring"
            out = t + base_latency_s(str(algo), beta)
        if len(cache) < 65536:
            cache[key] = out
        return out

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "protocol_latency": True}
