"""Benchmark-sized workloads (published DDP figures), registered in ``WORKLOADS``.

Kept apart from ``SCENARIOS``: the feature suite trains every scenario, and one ResNet-50 step
costs seconds on a CPU. :func:`fakepg.zoo.get` reaches both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from . import data, llama, resnet
from .scenario import Scenario, SeededBatches, cross_entropy_loss, ddp_options

__all__ = ["WORKLOADS", "resnet50", "resnet101", "llama3_8b", "llama3_70b", "llama3_tiny"]

WORKLOADS: dict[str, Callable[..., Scenario]] = {}


def _resnet(name: str, depth_fn: Callable[..., nn.Module], batch_size: int, image_size: int,
            iterations: int, seed: int, bucket_cap_mb: float | None) -> Scenario:
    return Scenario(
        name=name,
        model=functools.partial(depth_fn, 1000),
        batches=SeededBatches(data.images, seed, dict(
            iterations=iterations, batch_size=batch_size, image_size=image_size,
            num_classes=1000)),
        loss=cross_entropy_loss,
        ddp_kwargs=ddp_options(bucket_cap_mb),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        iterations=iterations,
        seed=seed,
        description=f"torchvision-equal {name}, batch {batch_size}, {image_size}x{image_size}",
        features=("benchmark", "buffers", "bucketing"),
        reference_ok=False,  # BatchNorm's running stats are per rank under DDP
    )


def resnet50(batch_size: int = 32, image_size: int = 224, iterations: int = 3, seed: int = 0,
             bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's ResNet-50 (25.6 M parameters) on random ImageNet-shaped batches, SGD with
    momentum: the PyTorch DDP paper's benchmark model. In ``WORKLOADS``."""
    return _resnet("resnet50", resnet.resnet50, batch_size, image_size, iterations, seed,
                   bucket_cap_mb)


def resnet101(batch_size: int = 32, image_size: int = 224, iterations: int = 3, seed: int = 0,
              bucket_cap_mb: float | None = None) -> Scenario:
    """torchvision's ResNet-101 (44.5 M parameters), as :func:`resnet50`. In ``WORKLOADS``."""
    return _resnet("resnet101", resnet.resnet101, batch_size, image_size, iterations, seed,
                   bucket_cap_mb)


def _llama3(size: str, batch_size: int, seq_len: int, iterations: int, seed: int,
            bucket_cap_mb: float | None) -> Scenario:
    args = llama.LLAMA3_CONFIGS[size]
    if not 1 <= seq_len <= args.max_seq_len:
        raise ValueError(f"llama3-{size}: seq_len must be in 1..{args.max_seq_len}, got {seq_len}")
    return Scenario(
        name=f"llama3-{size}",
        model=functools.partial(llama.Llama, args),
        batches=SeededBatches(data.token_sequences, seed, dict(
            iterations=iterations, batch_size=batch_size, seq_len=seq_len,
            vocab=args.vocab_size)),
        loss=llama.lm_loss,
        ddp_kwargs=ddp_options(bucket_cap_mb),
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1),
        iterations=iterations,
        seed=seed,
        description=f"Llama 3 {size} decoder ({args.num_params():,} parameters), "
                    f"{batch_size} x {seq_len} tokens per rank, AdamW",
        features=("benchmark", "transformer", "bucketing", "real-size"),
    )


# Per-rank batch defaults follow torchtitan's llama3 training configs: local batch 1 of
# 8192 tokens. These sizes are meant for capture on the meta device (simddp's
# capture_workload): a real 8B step needs ~130 GB of CPU memory.
def llama3_8b(batch_size: int = 1, seq_len: int = 8192, iterations: int = 3, seed: int = 0,
              bucket_cap_mb: float | None = None) -> Scenario:
    """Llama 3 8B (8,030,261,248 parameters; :data:`llama.LLAMA3_8B`) on random token
    sequences, AdamW. In ``WORKLOADS`` as ``llama3-8b``."""
    return _llama3("8b", batch_size, seq_len, iterations, seed, bucket_cap_mb)


def llama3_70b(batch_size: int = 1, seq_len: int = 8192, iterations: int = 3, seed: int = 0,
               bucket_cap_mb: float | None = None) -> Scenario:
    """Llama 3 70B (70,553,706,496 parameters; :data:`llama.LLAMA3_70B`), as
    :func:`llama3_8b`. In ``WORKLOADS`` as ``llama3-70b``."""
    return _llama3("70b", batch_size, seq_len, iterations, seed, bucket_cap_mb)


def llama3_tiny(batch_size: int = 2, seq_len: int = 32, iterations: int = 3, seed: int = 0,
                bucket_cap_mb: float | None = None) -> Scenario:
    """The Llama 3 architecture at test size (:data:`llama.LLAMA3_TINY`): trains on CPU in
    milliseconds. In ``WORKLOADS`` as ``llama3-tiny``."""
    return _llama3("tiny", batch_size, seq_len, iterations, seed, bucket_cap_mb)


WORKLOADS.update({"resnet50": resnet50, "resnet101": resnet101, "llama3-8b": llama3_8b,
                  "llama3-70b": llama3_70b, "llama3-tiny": llama3_tiny})
