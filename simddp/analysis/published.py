"""Published nccl-tests bus bandwidths, and what simddp's network presets predict for them.

Every figure below was measured by someone else and published; the presets' parameters come
from hardware datasheets and NCCL's own constants (see :mod:`simddp.models.network`), never from
this table. ``validate()`` returns one row per figure with the relative error, and
``ci/validate_published.py`` prints them.

nccl-tests' busbw for all_reduce is ``2(n−1)/n · bytes / time`` and for reduce_scatter
``(n−1)/n · bytes / time`` (``Network.bus_bandwidth_factor``), so a prediction is
``factor · bytes / Network.collective_time(op, bytes, n)``.

>>> rows = validate()
>>> all(r.published_GBps > 0 and r.predicted_GBps > 0 for r in rows)
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..models.network import Network

__all__ = ["PublishedBusBw", "ValidationRow", "PUBLISHED", "validate", "format_table",
           "DDP_BENCHMARK", "PublishedScaling", "SCALING"]

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class PublishedBusBw:
    """One published nccl-tests figure: ``config`` run as ``preset`` (+ ``overrides``)."""

    config: str
    preset: str
    op: str
    nranks: int
    nbytes: int
    published_GBps: float
    source: str
    overrides: dict[str, Any] = field(default_factory=dict)
    goal: bool = True  # counted against the ≤ 5 % goal (False: a proxy or an ambiguous setup)
    note: str = ""


# Sources (all public; "nccl#N" = github.com/NVIDIA/nccl/issues/N, "nccl-tests#N" likewise):
PUBLISHED: list[PublishedBusBw] = [
    # nccl#1048 (= nccl-tests#175): DGX-class 8×A100 SXM, single node,
    # `all_reduce_perf -b 8 -e 4G -f 2 -g 8` → 232.54 GB/s busbw. (Reference tables such as
    # docs.alayanew.com's nccl-tests guide give 230–250 GB/s for 8×A100 SXM4.)
    PublishedBusBw("8×A100 (DGX A100)", "dgx-a100", "all_reduce", 8, 4 * GiB, 232.54,
                   "nccl#1048"),
    # nccl-tests#212, NCCL maintainer: on 8×H100 NVLS (default since NCCL 2.17) reaches a
    # peak busBw of ~480 GB/s (algbw ~275); with NCCL_ALGO=RING ~370 GB/s, "the effective
    # NVLink bandwidth". nccl#2140 (NCCL 2.30): 8×H100 busbw 370 → 480 GB/s NVLS off → on.
    PublishedBusBw("8×H100 (DGX H100), auto/NVLS", "dgx-h100", "all_reduce", 8, 8 * GiB, 480.0,
                   "nccl-tests#212, nccl#2140"),
    PublishedBusBw("8×H100, NCCL_ALGO=RING", "dgx-h100", "all_reduce", 8, 8 * GiB, 370.0,
                   "nccl-tests#212, nccl#2140", {"algorithm": "ring"}),
    # nccl#1455: 8×H100 SXM, -b 2G -e 4G: RING busbw 365–370 GB/s at 2..8 GPUs; NVLS 365–370
    # at 2..4 GPUs, then 420 / 440 / 460 / 480 GB/s at 5 / 6 / 7 / 8 GPUs.
    PublishedBusBw("2×H100, NCCL_ALGO=RING", "dgx-h100", "all_reduce", 2, 4 * GiB, 367.5,
                   "nccl#1455", {"algorithm": "ring"}),
    PublishedBusBw("4×H100, NCCL_ALGO=NVLS", "dgx-h100", "all_reduce", 4, 4 * GiB, 367.5,
                   "nccl#1455", {"algorithm": "nvls"}),
    PublishedBusBw("5×H100, NCCL_ALGO=NVLS", "dgx-h100", "all_reduce", 5, 4 * GiB, 420.0,
                   "nccl#1455", {"algorithm": "nvls"}),
    PublishedBusBw("6×H100, NCCL_ALGO=NVLS", "dgx-h100", "all_reduce", 6, 4 * GiB, 440.0,
                   "nccl#1455", {"algorithm": "nvls"}),
    PublishedBusBw("7×H100, NCCL_ALGO=NVLS", "dgx-h100", "all_reduce", 7, 4 * GiB, 460.0,
                   "nccl#1455", {"algorithm": "nvls"}),
    # nccl#1047: 8×H100 80GB HBM3 reduce_scatter, ring, 8 GiB: 362.16 GB/s busbw.
    PublishedBusBw("8×H100 reduce_scatter (ring)", "dgx-h100", "reduce_scatter", 8, 8 * GiB,
                   362.16, "nccl#1047"),
    # nccl#2140: 8×B300 (NVLink5 + NVSwitch as B200) busbw 695 (NVLS off) → 845 (NVLS on).
    # A proxy for dgx-b200: no published 8×B200 figure was found; not counted in the goal.
    PublishedBusBw("8×B300 (proxy for B200), ring", "dgx-b200", "all_reduce", 8, 8 * GiB, 695.0,
                   "nccl#2140", {"algorithm": "ring"}, goal=False, note="B300 ≠ B200"),
    PublishedBusBw("8×B300 (proxy for B200), NVLS", "dgx-b200", "all_reduce", 8, 8 * GiB, 845.0,
                   "nccl#2140", goal=False, note="B300 ≠ B200"),
    # nccl-tests#119: 3 servers × 8 A100 SXM4 40GB, 4 HDR InfiniBand HCAs per server
    # (theoretical 4 × 200 Gb/s / 8 GPUs), -e 128M: peak ~96 GB/s busbw (average 84.8).
    PublishedBusBw("3 nodes × 8 A100, 4 HDR HCAs/node", "dgx-a100", "all_reduce", 24, 128 * MiB,
                   96.0, "nccl-tests#119", {"nics_per_node": 4}),
    # nccl#1048: 2 nodes × 8 A100, "IB 200Gb × 4 (dual port)" per node, up to 4 GB: 86 GB/s;
    # the reporter expected 96–100 (4 × 200 Gb/s); a single HCA reached its 24 GB/s.
    PublishedBusBw("2 nodes × 8 A100, 4 HDR HCAs/node", "dgx-a100", "all_reduce", 16, 4 * GiB,
                   86.0, "nccl#1048", {"nics_per_node": 4}),
    # nccl#1221 (NCCL 2.19.3): nodes of 8×H100 with 8 × 400 Gb RoCE NICs, -b 4G -e 8G:
    # 1–2 nodes 330 GB/s with NVLS off, 430 with NVLS on; 4 nodes ~320 GB/s either way.
    # RoCE, not IB (dgx-h100's NICs are NDR IB at the same 400 Gb/s); not counted in the goal.
    PublishedBusBw("2 nodes × 8 H100, 8×400G RoCE, NVLS off", "dgx-h100", "all_reduce", 16,
                   8 * GiB, 330.0, "nccl#1221", {"algorithm": "ring"}, goal=False,
                   note="RoCE"),
    PublishedBusBw("2 nodes × 8 H100, 8×400G RoCE, auto", "dgx-h100", "all_reduce", 16,
                   8 * GiB, 430.0, "nccl#1221", goal=False, note="RoCE"),
    PublishedBusBw("4 nodes × 8 H100, 8×400G RoCE, auto", "dgx-h100", "all_reduce", 32,
                   8 * GiB, 320.0, "nccl#1221", goal=False, note="RoCE"),
]


@dataclass(frozen=True)
class ValidationRow:
    config: str
    op: str
    nranks: int
    nbytes: int
    algorithm: str
    predicted_GBps: float
    published_GBps: float
    error_pct: float  # (predicted − published) / published × 100
    source: str
    goal: bool
    note: str


def predicted_busbw(net: Network, op: str, nbytes: int, nranks: int) -> float:
    """nccl-tests' busbw (GB/s) that ``net`` predicts."""
    t = net.collective_time(op, nbytes, nranks)
    return Network.bus_bandwidth_factor(op, nranks) * nbytes / t / 1e9


def validate(published: list[PublishedBusBw] | None = None) -> list[ValidationRow]:
    """One :class:`ValidationRow` per published figure."""
    rows = []
    for p in PUBLISHED if published is None else published:
        net = Network.preset(p.preset, **p.overrides)
        pred = predicted_busbw(net, p.op, p.nbytes, p.nranks)
        rows.append(ValidationRow(
            p.config, p.op, p.nranks, p.nbytes, net.chosen_algorithm(p.op, p.nbytes, p.nranks),
            pred, p.published_GBps, (pred - p.published_GBps) / p.published_GBps * 100,
            p.source, p.goal, p.note))
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def format_table(rows: list[ValidationRow], *, goal_pct: float = 5.0) -> str:
    """A plain-text table (fits 100 columns) and a one-line summary."""
    head = (f"{'config':<40} {'n':>3} {'size':>7} {'algo':>5} {'pred':>6} {'publ':>6} "
            f"{'err %':>6}  source")
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "" if r.goal else " (not in goal)"
        lines.append(f"{r.config[:40]:<40} {r.nranks:>3} {_size(r.nbytes):>7} "
                     f"{r.algorithm:>5} {r.predicted_GBps:>6.1f} {r.published_GBps:>6.1f} "
                     f"{r.error_pct:>+6.1f}  {r.source}{mark}")
    counted = [r for r in rows if r.goal]
    ok = [r for r in counted if abs(r.error_pct) <= goal_pct]
    worst = max(counted, key=lambda r: abs(r.error_pct)) if counted else None
    lines.append("-" * len(head))
    lines.append(f"{len(ok)} of {len(counted)} goal rows within ±{goal_pct:g} %"
                 + (f"; worst {worst.config}: {worst.error_pct:+.1f} %" if worst else ""))
    return "\n".join(lines)


# PyTorch's DDP benchmark (pytorch/pytorch, benchmarks/distributed/ddp/README.md): seconds per
# iteration (p50) at batch size 32 on DGX-1 machines (8×V100, NVLink hybrid cube-mesh, 4×100 Gb
# InfiniBand per machine), NCCL, default 25 MB buckets; 16 GPUs = 2 machines. "no ddp" is the
# one-GPU step without DDP — the only figure a prediction may be calibrated on. The same
# README's diff table gives 1 MB buckets against 25 MB (p75): slower by the percentages below.
DDP_BENCHMARK: dict[str, dict[str, Any]] = {
    "resnet50": {"no_ddp_s": 0.097,
                 "iteration_s": {1: 0.100, 2: 0.103, 4: 0.103, 8: 0.104, 16: 0.104},
                 "cap1_vs_cap25_pct": {1: -0.3, 2: -1.0, 4: -1.6, 8: -2.6, 16: -3.8}},
    "resnet101": {"no_ddp_s": 0.162,
                  "iteration_s": {1: 0.171, 2: 0.176, 4: 0.176, 8: 0.179, 16: 0.179},
                  "cap1_vs_cap25_pct": {1: -1.2, 2: -2.1, 4: -2.6, 8: -3.5, 16: -0.1}},
}


@dataclass(frozen=True)
class PublishedScaling:
    """One published data-parallel scaling figure: ``workload`` (a zoo name) at ``batch``
    samples per GPU, ``throughput_1`` on one GPU and ``throughput_n`` on ``gpus`` GPUs of
    ``preset`` (samples/s). ``knobs``: what the source's training loop does each step
    (replay knobs, from its code, not fitted). Published efficiency =
    throughput_n / (gpus · throughput_1)."""

    config: str
    workload: str
    preset: str
    gpu: str
    batch: int
    gpus: int
    throughput_1: float
    throughput_n: float
    source: str
    knobs: dict[str, Any] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        return self.throughput_n / (self.gpus * self.throughput_1)

    @property
    def step_s(self) -> float:
        """The one-GPU step: batch / throughput_1 (what ``--step-time`` is given)."""
        return self.batch / self.throughput_1


# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance" (pytorch-21.03 NGC container; 1 vs 8 GPUs of one node). Batch per
# GPU from the same directory's configs.yml (DGX1V: FP32 112, AMP 256; DGXA100: 256). Its
# training loop (image_classification/training.py) all_reduces the loss and reads it back
# with .item() every step (print_freq 1 in benchmark_training): one metric all_reduce and one
# host sync per step. Data: the PyTorch DataLoader (data_backend pytorch), 8 (DGX-1) / 16
# (DGX A100) workers per GPU — the per-sample decode cost is not published, so the host
# loader is not modelled here.
_DLE = "NVIDIA DeepLearningExamples RN50 v1.5 PyTorch README (21.03)"
_DLE_LOOP = {"sync_points": 1, "metric_allreduces": 1}
SCALING: list[PublishedScaling] = [
    PublishedScaling("RN50 TF32, DGX A100", "resnet50", "dgx-a100", "a100", 256, 8,
                     938, 7248, _DLE, _DLE_LOOP),
    PublishedScaling("RN50 AMP, DGX A100", "resnet50", "dgx-a100", "a100", 256, 8,
                     2470, 16621, _DLE, _DLE_LOOP),
    PublishedScaling("RN50 FP32, DGX-1 16GB", "resnet50", "dgx1-v100", "v100", 112, 8,
                     367, 2855, _DLE, _DLE_LOOP),
    PublishedScaling("RN50 AMP, DGX-1 16GB", "resnet50", "dgx1-v100", "v100", 256, 8,
                     1200, 8322, _DLE, _DLE_LOOP),
    PublishedScaling("RN50 FP32, DGX-1 32GB", "resnet50", "dgx1-v100", "v100", 112, 8,
                     356, 2766, _DLE, _DLE_LOOP),
    PublishedScaling("RN50 AMP, DGX-1 32GB", "resnet50", "dgx1-v100", "v100", 256, 8,
                     1156, 8056, _DLE, _DLE_LOOP),
]
