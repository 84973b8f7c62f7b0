"""Benchmark-sized workloads (published DDP figures), registered in ``WORKLOADS``.

Kept apart from ``SCENARIOS``: the feature suite trains every scenario, and one ResNet-50 step
costs seconds on a CPU. :func:`fakepg.zoo.get` reaches both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from . import data, resnet
from .scenario import Scenario, SeededBatches, cross_entropy_loss, ddp_options

__all__ = ["WORKLOADS", "resnet50", "resnet101"]

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


WORKLOADS.update(resnet50=resnet50, resnet101=resnet101)
