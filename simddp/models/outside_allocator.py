"""What a training process holds on its GPU outside torch's caching allocator
(:mod:`simddp.models.allocator`): the CUDA context and NCCL's own buffers. Neither is in torch's
reserved bytes; both lower what the allocator can get (the memory verdict adds them:
:func:`~simddp.program.steps.job_memory`)."""

from __future__ import annotations

__all__ = ["CUDA_CONTEXT_BYTES", "NCCL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_LL_BUFFSIZE",
           "NCCL_CHANNELS", "NCCL_P2P_CHANNELS_PER_PEER", "nccl_buffer_bytes"]

# The CUDA context (driver state, the kernels loaded): about 400 MB per process with CUDA >= 11.7's
# lazy module loading, which PyTorch enables (ptrblck, pytorch/pytorch#109888; ~300 MB in #107667).
# It is not in torch's reserved bytes: it lowers what the allocator can get.
CUDA_CONTEXT_BYTES = 400 * 10 ** 6
# NCCL's buffers per connection and protocol (NVIDIA/nccl src/init.cc, DEFAULT_BUFFSIZE,
# DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD (120) × NCCL_LL128_MAX_NTHREADS (640) ×
# NCCL_STEPS (8) × 8 B, DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD (8) × NCCL_LL_MAX_NTHREADS
# (512) × NCCL_STEPS (8) × 16 B), allocated by NCCL itself (cudaMalloc / cuMem), not by torch.
NCCL_BUFFSIZE = 1 << 22  # Simple: NCCL_BUFFSIZE, 4 MiB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # 4,915,200 B
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # 524,288 B
# channels of a collective communicator: NCCL's MAXCHANNELS (32), what it builds on an
# NVSwitch H100 node ("32 coll channels" in NCCL_DEBUG=INFO); p2p channels per peer for
# pipeline sends (NCCL_NCHANNELS_PER_NET_PEER's default, 2)
NCCL_CHANNELS = 32
NCCL_P2P_CHANNELS_PER_PEER = 2


def nccl_buffer_bytes(communicators: int, p2p_peers: int = 0, *,
                      channels: int = NCCL_CHANNELS,
                      p2p_channels_per_peer: int = NCCL_P2P_CHANNELS_PER_PEER) -> int:
    """NCCL's own buffers in one rank's memory: per collective communicator of two or more
    ranks, ``channels`` ring connections, each receiving into one buffer per protocol
    (Simple + LL128 + LL: 9.19 MiB); per pipeline peer, ``p2p_channels_per_peer`` connections
    each way with a Simple buffer. Tree and NVLS buffers are left out (NCCL connects them on
    first use; NVLS's multicast buffers depend on the NVSwitch)."""
    per_connection = NCCL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE
    return communicators * channels * per_connection + \
        p2p_peers * p2p_channels_per_peer * 2 * NCCL_BUFFSIZE
