"""Named fabrics: the preset table of :meth:`simddp.Network.preset`, each citing its source.

Intra-node bandwidth = NVLink links per GPU × NCCL's per-link bandwidth (NCCL
``src/graph/topo.h``: SM70_NVLINK_BW 20.0, SM80_NVLINK_BW 20.0, SM90_NVLINK_BW 20.6,
SM100_NVLINK_BW 40.1 GB/s — what NCCL's topology search assigns to one link, ~80 % of the
25 / 25 / 25 / 50 GB/s per-direction line rate, the rest being protocol overhead). These are
NCCL's own constants, not fitted to any benchmark table. NVLS bandwidth = NCCL's NVLS channels
(16; "NVLS multicast support is available on dev N (NVLS_NCHANNELS 16)" in NCCL's INFO log on
H100) × per-link bandwidth × 5/6 (tuning.cc's NVLS bus→algorithm ratio). NICs: line rate of
each NIC, NICs per node from the DGX datasheets. α inside = 2 µs (NVLink ring step, as
"nvlink"), α across = 5 µs (IB, as "ib-hdr").
"""

from __future__ import annotations

from typing import Any, Callable

from .algorithms import NVLS_ALGBW_RATIO as _NVLS_ALGBW_RATIO
from .network import Network
from .placement import Tier

__all__ = ["PRESETS", "preset"]


def preset(name: str, /, **kw: Any) -> Network:
    """The preset ``name`` with fields overridden by ``kw`` (see :meth:`Network.preset`)."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown network preset {name!r}; known presets: "
                         f"{', '.join(PRESETS)} (or build Network(bandwidth_GBps=..., "
                         f"latency_us=...) yourself)") from None
    return factory(**kw)


def nvlink(**kw: Any) -> Network:
    """One node of H100 SXM GPUs on NVLink4/NVSwitch at LINE RATE: 900 GB/s bidirectional per
    GPU, i.e. 450 GB/s each way (NVIDIA H100 datasheet). α = 2 µs: NCCL's tuning.cc puts an
    NVLink ring step at 0.6 (LL) to 3.4 µs (Simple). A generic upper bound: NCCL's rings
    reach ~370 GB/s of it (protocol overhead), so use "dgx-h100" to predict nccl-tests."""
    return _make(dict(bandwidth_GBps=450.0, latency_us=2.0, name="nvlink"), kw, False)


def infiniband_hdr(**kw: Any) -> Network:
    """HDR InfiniBand, 200 Gb/s = 25 GB/s per NIC (IBTA HDR 4x link; ConnectX-6). α = 5 µs:
    tuning.cc's network ring step is 2.7 (LL) to 14 µs (Simple). ``gpus_per_node=8`` adds
    NVLink inside nodes; ``nics_per_node=4`` for nodes with 4 HCAs (default one per GPU)."""
    return _make(dict(bandwidth_GBps=25.0, latency_us=5.0, name="ib-hdr"), kw, True)


def infiniband_ndr(**kw: Any) -> Network:
    """NDR InfiniBand, 400 Gb/s = 50 GB/s per NIC (ConnectX-7), α = 5 µs (as HDR)."""
    return _make(dict(bandwidth_GBps=50.0, latency_us=5.0, name="ib-ndr"), kw, True)


def ethernet_100g(**kw: Any) -> Network:
    """100 Gb/s Ethernet = 12.5 GB/s per NIC. α = 10 µs, a RoCE-class figure; TCP sockets
    are slower (tens of µs): calibrate for those."""
    return _make(dict(bandwidth_GBps=12.5, latency_us=10.0, name="100gbe"), kw, True)


def ethernet_400g(**kw: Any) -> Network:
    """400 Gb/s Ethernet = 50 GB/s per NIC, α = 10 µs (RoCE-class)."""
    return _make(dict(bandwidth_GBps=50.0, latency_us=10.0, name="400gbe"), kw, True)


def gloo_loopback(**kw: Any) -> Network:
    """gloo between processes of one CPU host over loopback TCP: ~3 GB/s, ~30 µs a step.
    A rough figure only: it varies several-fold between machines, so calibrate it
    (:meth:`calibrate`) from a microbenchmark on the host you compare against. gloo runs
    rings (no NCCL tuner), so the algorithm stays "ring"."""
    return _make(dict(bandwidth_GBps=3.0, latency_us=30.0, name="gloo-loopback",
                          algorithm="ring", nccl=False), kw, False)


def dgx1_v100(**kw: Any) -> Network:
    """DGX-1 (V100): 8 GPUs on an NVLink2 hybrid cube-mesh (no NVSwitch, so no NVLS), 4 EDR
    InfiniBand NICs per node. Sources: NVIDIA "DGX-1 with Tesla V100 System Architecture"
    whitepaper (WP-08437-002): 6 NVLink2 links per GPU × 25 GB/s per direction, 4 × 100 Gb/s
    EDR ConnectX-4 per node; NCCL topo.h SM70_NVLINK_BW = 20 GB/s a link, so NCCL's rings
    over the 6 links carry 6 × 20 = 120 GB/s bus bandwidth. (Before this version: 130 GB/s
    inside, an unsourced nccl-tests figure, and 6.25 GB/s per GPU as one NIC per GPU; now
    4 NICs × 12.5 GB/s per node.)"""
    defaults = dict(bandwidth_GBps=12.5, latency_us=5.0, gpus_per_node=8, nics_per_node=4,
                    intra_bandwidth_GBps=6 * 20.0, intra_latency_us=2.0, name="dgx1-v100",
                    algorithm="auto", gpu="v100")
    return _make(defaults, kw, False)


def dgx1_p100(**kw: Any) -> Network:
    """DGX-1 (P100, 2016): 8 Tesla P100 SXM2 on an NVLink 1 hybrid cube-mesh (no NVSwitch, no
    NVLS), 4 NVLink links per GPU at 20 GB/s per direction (160 GB/s bidirectional per GPU), and
    4 Mellanox ConnectX-4 EDR InfiniBand 100 Gb/s (12.5 GB/s) HCAs per node. Sources: NVIDIA
    "NVIDIA DGX-1 System Architecture" whitepaper WP-08437-001_v02 (the P100 edition;
    https://images.nvidia.com/content/pdf/dgx1-system-architecture-whitepaper1.pdf), the Tesla
    P100 whitepaper WP-08019-001 ("four NVLinks", 160 GB/s), and NCCL topo.h SM60_NVLINK_BW =
    18 GB/s a link, so NCCL's rings over the 4 links carry 4 × 18 = 72 GB/s bus bandwidth
    (the convention of "dgx1-v100")."""
    defaults = dict(bandwidth_GBps=12.5, latency_us=5.0, gpus_per_node=8, nics_per_node=4,
                    intra_bandwidth_GBps=4 * 18.0, intra_latency_us=2.0, name="dgx1-p100",
                    algorithm="auto", gpu="p100")
    return _make(defaults, kw, False)


def pcie_server(**kw: Any) -> Network:
    """A PCIe GPU server: 8 GPUs on PCIe 3.0 x16 behind PCIe switches of one root complex, no
    NVLink, one 100 Gb/s Ethernet NIC (RoCE) per node. PCIe 3.0 x16 is 8 GT/s × 16 lanes ×
    128b/130b = 15.75 GB/s per direction (PCI-SIG, PCI Express Base Specification 3.0); NCCL
    assigns a Gen3 x16 path PCI_BW = 12 GB/s (NCCL src/graph/topo.h), the bus bandwidth of its
    rings through the switches. α inside = 3 µs: NCCL tuning.cc's PCI ring step is 1.0 (LL) to
    5.7 µs (Simple). The NIC as "100gbe" (12.5 GB/s, α 10 µs); for 25 GbE pass
    ``bandwidth_GBps=3.125`` (``--network 'pcie-server,nic:Gbps=25'``). Servers whose GPUs sit
    on two CPU sockets cross QPI/UPI in the ring: NCCL's BDW_QPI_BW 6 / SKL_QPI_BW 10 GB/s —
    pass ``intra_bandwidth_GBps`` (``pcie:GBps=``) for those."""
    defaults = dict(bandwidth_GBps=12.5, latency_us=10.0, gpus_per_node=8, nics_per_node=1,
                    intra_bandwidth_GBps=12.0, intra_latency_us=3.0, name="pcie-server",
                    algorithm="auto", intra_link="pci")
    return _make(defaults, kw, False)


def dgx_a100(**kw: Any) -> Network:
    """DGX A100: 8 A100 SXM4 on NVLink3 + NVSwitch (6 second-gen NVSwitches), 12 NVLink3 links
    per GPU = 600 GB/s bidirectional, 300 GB/s each way (NVIDIA A100 datasheet; DGX A100
    datasheet); NCCL: 12 × SM80_NVLINK_BW 20 = 240 GB/s bus bandwidth. 8 single-port
    ConnectX-6 HDR 200 Gb/s (25 GB/s) NICs for compute per node (DGX A100 datasheet; the two
    further ConnectX-6 are for storage). No NVLS (second-gen NVSwitch has no SHARP)."""
    defaults = dict(bandwidth_GBps=25.0, latency_us=5.0, gpus_per_node=8, nics_per_node=8,
                    intra_bandwidth_GBps=12 * 20.0, intra_latency_us=2.0, name="dgx-a100",
                    algorithm="auto", gpu="a100")
    return _make(defaults, kw, False)


def dgx_h100(**kw: Any) -> Network:
    """DGX H100: 8 H100 SXM5 on NVLink4 + 4 third-gen NVSwitches with NVLink SHARP (NVLS),
    18 NVLink4 links per GPU = 900 GB/s bidirectional, 450 GB/s each way (H100 datasheet,
    DGX H100 datasheet); NCCL: 18 × SM90_NVLINK_BW 20.6 = 370.8 GB/s ring bus bandwidth, and
    NVLS 16 channels × 20.6 × 5/6 = 274.7 GB/s algorithm bandwidth. 8 × ConnectX-7 NDR
    400 Gb/s (50 GB/s) NICs per node (DGX H100 datasheet)."""
    defaults = dict(bandwidth_GBps=50.0, latency_us=5.0, gpus_per_node=8, nics_per_node=8,
                    intra_bandwidth_GBps=18 * 20.6, intra_latency_us=2.0,
                    nvls_bandwidth_GBps=16 * 20.6 * _NVLS_ALGBW_RATIO, name="dgx-h100",
                    algorithm="auto", gpu="h100")
    return _make(defaults, kw, False)


def dgx_b200(**kw: Any) -> Network:
    """DGX B200: 8 B200 on NVLink5 + 2 fifth-gen NVSwitches with NVLS, 18 NVLink5 links per
    GPU = 1.8 TB/s bidirectional, 900 GB/s each way (DGX B200 datasheet); NCCL: 18 ×
    SM100_NVLINK_BW 40.1 = 721.8 GB/s ring bus bandwidth; NVLS assumed 16 channels as on
    H100: 16 × 40.1 × 5/6 = 534.7 GB/s (not confirmed for Blackwell: see the validation
    table, it overshoots B300's published NVLS figure by ~11 %). 8 × ConnectX-7 400 Gb/s
    (50 GB/s) NICs per node (DGX B200 datasheet)."""
    defaults = dict(bandwidth_GBps=50.0, latency_us=5.0, gpus_per_node=8, nics_per_node=8,
                    intra_bandwidth_GBps=18 * 40.1, intra_latency_us=2.0,
                    nvls_bandwidth_GBps=16 * 40.1 * _NVLS_ALGBW_RATIO, name="dgx-b200",
                    algorithm="auto", gpu="b200")
    return _make(defaults, kw, False)


def dgx_superpod(**kw: Any) -> Network:
    """DGX H100 SuperPOD: DGX H100 nodes ("dgx-h100": 8 H100, NVLink4 + NVLS, 8 × ConnectX-7
    NDR 400 Gb/s per node) on a rail-optimised NDR InfiniBand compute fabric: scalable units
    (SUs) of 32 nodes (256 GPUs), each node's NIC i on the SU's leaf switch of rail i, SUs
    joined by spine switches; full fat-tree, no oversubscription at either tier. Source:
    NVIDIA DGX SuperPOD Reference Architecture, DGX H100 (RA-11333-001): "32 DGX H100 systems
    per SU", "rail-optimized", "full fat-tree". A communicator of one rank per node stays on
    one rail (one leaf hop inside its SU). For an oversubscribed what-if pass your own
    ``tiers=(Tier("su", 256, 2.0),)``."""
    defaults = dict(name="dgx-superpod", tiers=(Tier("su", 256, 1.0),))
    return dgx_h100(**{**defaults, **kw})


def llama3_roce(**kw: Any) -> Network:
    """The Llama 3 training cluster (Llama 3 paper, "The Llama 3 Herd of Models", 2024,
    §3.3.1 Network): 24K H100 (80 GB HBM3, 700 W) in Grand Teton servers of 8 GPUs on NVLink
    (HGX H100 baseboard: NVSwitch, NVLS, as "dgx-h100"), 400 Gb/s RoCE per GPU; a three-layer
    Clos: a rack of 16 GPUs (2 servers) on one ToR switch; 192 racks (3,072 GPUs) per pod with
    full bisection bandwidth; 8 pods joined by aggregation switches at 1:7 oversubscription.
    α = 10 µs as "400gbe" (RoCE class)."""
    defaults = dict(name="llama3-roce", latency_us=10.0,
                    tiers=(Tier("rack", 16, 1.0), Tier("pod", 3072, 7.0)))
    return dgx_h100(**{**defaults, **kw})


def _make(defaults: dict[str, Any], kw: dict[str, Any], nvlink_inside: bool) -> Network:
    defaults = {"algorithm": "auto", "nccl": True, **defaults}  # NCCL presets: NCCL's tuner
    fields = {**defaults, **kw}
    if nvlink_inside and fields.get("gpus_per_node") is not None:
        fields.setdefault("intra_bandwidth_GBps", 450.0)  # NVLink4, as in nvlink()
        fields.setdefault("intra_latency_us", 2.0)
    try:
        return Network(**fields)
    except TypeError as e:
        raise ValueError(f"bad preset argument ({e}); accepted: bandwidth_GBps, latency_us, "
                         "algorithm, gpus_per_node, intra_bandwidth_GBps, intra_latency_us, "
                         "nics_per_node, nvls_bandwidth_GBps, contention, name, nccl, gpu, "
                         "intra_link, collnet, tiers") from None


PRESETS: dict[str, Callable[..., Network]] = {
    "nvlink": nvlink,
    "ib-hdr": infiniband_hdr,
    "ib-ndr": infiniband_ndr,
    "100gbe": ethernet_100g,
    "400gbe": ethernet_400g,
    "gloo-loopback": gloo_loopback,
    "dgx1-p100": dgx1_p100,
    "dgx1-v100": dgx1_v100,
    "dgx-a100": dgx_a100,
    "dgx-h100": dgx_h100,
    "dgx-b200": dgx_b200,
    "pcie-server": pcie_server,
    "dgx-superpod": dgx_superpod,
    "llama3-roce": llama3_roce,
}


Network.presets = preset  # Network.preset(name) reads the table through this
