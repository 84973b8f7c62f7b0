"""A model's repeated blocks: the units FSDP2 wraps one by one before the root (and that a
capture's activation accounting walks), found the same way for every capture."""

from __future__ import annotations

import torch

__all__ = ["fsdp_units"]


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``fully_shard`` wraps before the root: the elements of the model's first
    ``nn.ModuleList`` (transformer blocks, residual stages), else each child with
    parameters."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m):
            return list(m)
    return [c for c in model.children() if any(True for _ in c.parameters())]
