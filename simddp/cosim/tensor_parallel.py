"""Tensor parallelism on the zoo's Llama: torchtitan's Llama 3 plan with torch's real
``parallelize_module`` (DTensor), for captures on the fake cluster.

:func:`apply_tensor_parallel` shards a :class:`models.llama.Llama` — or a pipeline stage of
one, a module that may lack the embeddings, the final norm or the output head — over a 1-D
tensor-parallel ``DeviceMesh`` exactly as torchtitan's ``apply_tp`` (``torchtitan/models/
llama3/infra/parallelize.py``) does:

* per block: ``wq``/``wk``/``wv`` and ``w1``/``w3`` column-wise, ``wo`` and ``w2`` row-wise;
* with ``sequence_parallel`` (torchtitan's default): the norms run on sequence shards
  (``SequenceParallel``), ``attention`` and ``feed_forward`` all-gather their input
  (``PrepareModuleInput`` Shard(1) → Replicate) and ``wo``/``w2`` reduce-scatter their output
  back to sequence shards; the embeddings (row-wise) reduce-scatter into sequence shards and
  the output head (column-wise) all-gathers the sequence in and the vocabulary out. Per block
  and forward: 2 all-gathers and 2 reduce-scatters on the TP group, the same mirrored in
  backward;
* without it: activations stay replicated; ``wo``/``w2`` and the embeddings all-reduce their
  output (2 all-reduces per block and forward, 2 in backward for the column-wise inputs).

Async TP (torchtitan's ``enable_async_tensor_parallel``) is a torch.compile pass
(``torch._inductor.config._micro_pipeline_tp``) that fuses the all-gather/reduce-scatter with
the matmuls through symmetric memory (``torch.distributed._symmetric_memory``), which needs
CUDA devices with peer access and NCCL; neither the fake cluster's CPU ranks nor the meta
device have it, so it is refused here rather than approximated.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_tensor_parallel", "tp_collectives_per_block"]


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"apply_tensor_parallel: {type(model).__name__} has no `layers` (the "
                         f"Llama's transformer blocks, a ModuleList or ModuleDict)")
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def _check_heads(model: torch.nn.Module, tp: int) -> None:
    args = getattr(model, "args", None)
    blocks = _blocks(model)
    att = blocks[0].attention if blocks else None
    heads = getattr(args, "n_heads", getattr(att, "n_heads", None))
    kv = getattr(args, "kv_heads", getattr(att, "n_kv_heads", None))
    for what, n in (("n_heads", heads), ("n_kv_heads", kv)):
        if n is not None and n % tp:
            raise ValueError(f"apply_tensor_parallel: {what} = {n} is not divisible by the "
                             f"tensor-parallel size {tp}: each rank holds whole heads")


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, *,
                          sequence_parallel: bool = True, async_tp: bool = False
                          ) -> torch.nn.Module:
    """Shard ``model`` (a Llama, or a pipeline stage of one) over ``tp_mesh`` (a 1-D torch
    ``DeviceMesh``) with torchtitan's Llama 3 plan (see the module docstring); in place, and
    returned. Submodules the model lacks (a pipeline stage's embeddings, norm, output) are
    skipped. ``async_tp=True`` is refused: see the module docstring."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    if async_tp:
        raise ValueError("apply_tensor_parallel: async TP is a torch.compile pass over "
                         "symmetric memory (torch._inductor.config._micro_pipeline_tp), which "
                         "needs CUDA devices with peer access and NCCL; the fake cluster's "
                         "CPU/meta ranks have neither, so it cannot be captured: capture "
                         "async_tp=False (its collectives are the same all-gathers and "
                         "reduce-scatters, not overlapped with the matmuls)")
    if getattr(tp_mesh, "ndim", 1) != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be a 1-D DeviceMesh (e.g. "
                         f"mesh['tp']), got {tp_mesh.ndim} dimensions")
    tp = tp_mesh.size()
    _check_heads(model, tp)
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in _blocks(model):
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel()}
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                # attention(x, cos, sin, mask): x gathered from sequence shards
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(block, tp_mesh, plan)
    return model


def tp_collectives_per_block(sequence_parallel: bool = True) -> dict[str, dict[str, int]]:
    """What torchtitan's plan issues on the TP group per transformer block, by phase and op:
    with sequence parallelism 2 all-gathers and 2 reduce-scatters each way; without, 2
    all-reduces each way."""
    if sequence_parallel:
        one = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    else:
        one = {"all_reduce": 2}
    return {"forward": dict(one), "backward": dict(one)}
