"""The built-in parallelisms' capture functions, as the registry
(:mod:`simddp.program.registry`) names them: each takes a
:class:`~simddp.program.registry.CaptureRequest` and runs torch's real program for the layout
on the fake cluster (:mod:`simddp.cosim`).

* :func:`capture_ddp` — torch's DDP (``ddp``), the model cast to ``param_dtype`` when given;
* :func:`capture_fsdp2` — FSDP2 ``fully_shard`` (``fsdp``, ``hsdp``, ``dp``, the ZeRO names),
  with TP inside when the layout has it: 2 shards (2 × 2 for HSDP, 2 replicas of one shard for
  ``dp``) times the TP degree replayed;
* :func:`capture_pipeline` — torch's pipelining (``pp``), FSDP2 and TP inside the stages.

A new parallelism's capture takes the same request (the layout is ``request.parallel``, a
:class:`~simddp.program.parallel.Parallel`) and returns its registered captured type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .program.registry import CaptureRequest

__all__ = ["capture_ddp", "capture_fsdp2", "capture_pipeline", "inner_mesh", "cast_scenario",
           "describe"]


def inner_mesh(par: Any) -> dict[str, int]:
    """The mesh a capture runs for layout ``par``, pipeline stages left out: the data flavour's
    smallest mesh that has every communicator the layout replays (2 shards; 2 × 2 for HSDP;
    2 replicas of one shard for ``dp``), then ``tp`` at the degree replayed (each degree has
    its own shapes and TP collectives)."""
    mesh = {"fsdp": {"shard": 2}, "hsdp": {"replicate": 2, "shard": 2}}.get(par.data, {})
    if par.data == "hsdp" and par.shard == 1:
        mesh = {"replicate": 2, "shard": 1}
    if par.tp > 1:
        mesh["tp"] = par.tp
    return mesh


def cast_scenario(scenario: Any, dtype_name: str) -> Any:
    """``scenario`` whose model is built in ``dtype_name`` (bf16, fp16, fp32) and whose floating
    inputs are cast to it: DDP training in low precision (gradients, buckets and all-reduces in
    that dtype), as ``model.to(torch.bfloat16)`` before wrapping does."""
    import torch

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype_name not in names:
        raise ValueError(f"param_dtype {dtype_name!r}: give one of {', '.join(names)}")
    dtype = names[dtype_name]
    build, batches = scenario.model, scenario.batches

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(dtype) if x.is_floating_point() else x
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    return dataclasses.replace(scenario, model=lambda: build().to(dtype),
                               batches=lambda rank, world: cast(batches(rank, world)))


def capture_ddp(req: CaptureRequest) -> Any:
    """torch's DDP on ``capture_ranks`` fake ranks (:func:`simddp.cosim.capture.capture`)."""
    from .cosim.capture import capture

    o = req.options
    if o.activation_checkpointing not in (None, "none"):
        raise ValueError(f"--parallel {req.parallel}: activation checkpointing is captured for "
                         f"FSDP2, tensor and pipeline layouts (fsdp, hsdp:S, dp:N, tp:T, pp:P), "
                         f"not for DDP's")
    sc = req.scenario if o.param_dtype is None else cast_scenario(req.scenario, o.param_dtype)
    return capture(sc, nprocs=o.capture_ranks, timing=req.timing, seed=req.seed,
                   device=req.device)


def capture_fsdp2(req: CaptureRequest) -> Any:
    """torch's FSDP2 (and TP) on :func:`inner_mesh`'s ranks
    (:func:`simddp.cosim.capture_fsdp.capture_fsdp`)."""
    from .cosim.capture_fsdp import capture_fsdp

    o, par = req.options, req.parallel
    mesh = inner_mesh(par)
    nranks = 1
    for v in mesh.values():
        nranks *= v
    raf = o.reshard_after_forward if par.reshard_after_forward is None \
        else par.reshard_after_forward
    return capture_fsdp(req.scenario, nranks, timing=req.timing, mesh=mesh,
                        reshard_after_forward=bool(raf), param_dtype=o.param_dtype,
                        reduce_dtype=o.reduce_dtype, seed=req.seed, device=req.device,
                        activation_checkpointing=_ac(o.activation_checkpointing),
                        sequence_parallel=o.sequence_parallel)


def capture_pipeline(req: CaptureRequest) -> Any:
    """torch's pipelining with ``pp_schedule``, ``microbatches`` of ``microbatch_size``
    (:func:`simddp.cosim.capture_pp.capture_pp`); blocks split over stages as torchtitan
    splits them (the embedding and the head weigh one block each)."""
    from .cosim.deepen import capture_pipeline as capture  # the shallowest pipeline, deepened

    o, par = req.options, req.parallel
    mesh = inner_mesh(par)
    fsdp = bool(mesh.keys() - {"tp"})
    return capture(req.scenario, par.pp, schedule=o.pp_schedule or "1F1B",
                      microbatches=o.microbatches, stages_per_rank=o.stages_per_rank or 1,
                      mesh=mesh, timing=req.timing, device=req.device, input_weight=1,
                      output_weight=1, activation_checkpointing=_ac(o.activation_checkpointing),
                      seed=req.seed, param_dtype=o.param_dtype if fsdp else None,
                      reduce_dtype=o.reduce_dtype if fsdp else None,
                      sequence_parallel=o.sequence_parallel)


def _ac(policy: str | None) -> Any:
    """The activation-checkpointing argument the cosim captures take: False for none, else
    the policy (``"full"`` is what they ran before policies existed)."""
    return False if policy in (None, "none") else policy


def describe(req: CaptureRequest) -> str:
    """One progress line for a capture about to run."""
    par, o, name = req.parallel, req.options, getattr(req.scenario, "name", "workload")
    owner = par.owner()
    if owner.dim == "data" and owner.data == "ddp":
        return f"capturing {name} (torch's DDP) on {o.capture_ranks} fake rank(s)"
    mesh = inner_mesh(par)
    n = 1
    for v in mesh.values():
        n *= v
    tp = f" with tensor parallelism tp={par.tp}" if par.tp > 1 else ""
    if owner.dim == "pp":
        words = {"shard": "FSDP2", "tp": "tensor parallel"}
        inside = [f"{words[k]} {v}" for k, v in mesh.items() if k in words]
        return (f"capturing {name} (torch's pipelining, {o.pp_schedule}, {par.pp} × "
                f"{o.stages_per_rank} stages, {o.microbatches} microbatches of "
                f"{o.microbatch_size}{'; ' + ', '.join(inside) + ' inside' if inside else ''}) "
                f"on {par.pp * n} fake ranks")
    if owner.dim == "data":  # an FSDP2 flavour
        raf = o.reshard_after_forward if par.reshard_after_forward is None \
            else par.reshard_after_forward
        return (f"capturing {name} (torch's FSDP2 fully_shard{tp}, reshard_after_forward="
                f"{raf}) on {n} fake ranks")
    if owner.name == "cp":  # simddp.cosim.context_parallel.capture_request's mesh
        n = par.cp * par.tp * (2 if par.data == "hsdp" else 1)
        return (f"capturing {name} (torch's ring attention cp={par.cp} × FSDP2 over shard × "
                f"cp{tp}) on {n} fake ranks")
    return f"capturing {name} ({owner.name}, {par}) on {n} fake ranks"
