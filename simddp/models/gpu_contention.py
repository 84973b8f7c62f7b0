"""GPU contention presets: NCCL's kernels take SMs from compute while they run.

NCCL runs a collective as one CTA per channel, each CTA holding one SM for the collective's
duration; a compute kernel beside it keeps ``SMs − channels`` of the GPU's SMs, so a
compute-bound kernel that fills the GPU slows by ``SMs / (SMs − channels)``
(:meth:`~simddp.models.Contention.sm_share`; an upper bound: memory-bound kernels lose
bandwidth instead, and a kernel in its tail wave may not notice). The channel counts are what
NCCL's topology search builds on each system, from NCCL_DEBUG=INFO logs:

* V100, 8 per node on the NVLink cube-mesh (DGX-1 / p3dn): ``Channel 00/08`` — 8 channels
  (github.com/NVIDIA/nccl/issues/514); 80 SMs (V100 datasheet);
* A100, 8 on NVSwitch (NV12): ``Channel 00/24`` — 24 channels (nccl#578); 108 SMs (A100
  datasheet);
* H100, 8 on NVSwitch: 12 ring channels found, duplicated to 24 (nccl#1367); 132 SMs (H100
  SXM5 datasheet).

Each preset also carries NCCL's per-collective base latency (8.4 µs, tuning.cc baseLat Ring
/ Simple; :data:`~simddp.models.contention.NCCL_BASE_LATENCY_US`) as the fixed compute-stream
cost of issuing a collective: the launch the issuing stream pays.

>>> gpu_contention("v100").slowdown
1.1111111111111112
>>> gpu_contention("a100:8").slowdown                # A100 with 8 channels
1.08

Replay applies it by default on a network that runs NCCL on a GPU named here
(:func:`default_contention`: the dgx1-v100, dgx-a100, dgx-h100, dgx-superpod and llama3-roce
presets); ``gpu_contention="off"`` (``--no-gpu-contention``) switches it off.
"""

from __future__ import annotations

from .contention import NCCL_BASE_LATENCY_US, Contention

__all__ = ["GPU_SMS", "NCCL_CHANNELS", "gpu_contention", "default_contention"]

GPU_SMS = {"v100": 80, "a100": 108, "h100": 132}
NCCL_CHANNELS = {"v100": 8, "a100": 24, "h100": 24}
_SOURCES = {"v100": "nccl#514", "a100": "nccl#578", "h100": "nccl#1367"}


def gpu_contention(spec: str) -> Contention:
    """The contention of ``spec``: a GPU name (``v100``, ``a100``, ``h100``) with NCCL's
    channel count on that system, or ``GPU:CHANNELS``."""
    gpu, _, ch = str(spec).lower().partition(":")
    if gpu not in GPU_SMS:
        raise ValueError(f"gpu_contention: unknown GPU {gpu!r}; known: {', '.join(GPU_SMS)} "
                         f"(optionally GPU:CHANNELS, e.g. a100:16)")
    try:
        channels = int(ch) if ch else NCCL_CHANNELS[gpu]
    except ValueError:
        raise ValueError(f"gpu_contention: channels must be an integer, got {ch!r} "
                         f"(e.g. a100:16)") from None
    src = f"{GPU_SMS[gpu]} SMs, {channels} NCCL channels" + (
        "" if ch else f" ({_SOURCES[gpu]})")
    return Contention.sm_share(GPU_SMS[gpu], channels, per_collective_us=NCCL_BASE_LATENCY_US,
                               source=src)


def default_contention(net: object) -> str | None:
    """The GPU whose contention replay applies by default on ``net``: its ``gpu`` where the
    network runs NCCL (``nccl``) and the GPU's SMs and channels are known here; else None."""
    gpu = getattr(net, "gpu", None)
    if not getattr(net, "nccl", False) or gpu is None:
        return None
    gpu = str(gpu).lower()
    return gpu if gpu in GPU_SMS else None
