"""Synthetic captures: what a capture would record for an idealised program, to study schedules
and check closed forms without capturing a model (:func:`uniform_pipeline`)."""

from __future__ import annotations

import math
from typing import Any

from fakepg.arguments import integer, number

from ..models import Network
from .captured import CapturedPipeline
from .schedules import schedule_name

__all__ = ["uniform_pipeline"]


def uniform_pipeline(pp: int, microbatches: int, forward_s: float, backward_s: float, *,
                     weight_s: float | None = None, schedule: str | None = None,
                     stages_per_rank: int = 1, send_bytes: int = 0, param_bytes: int = 0,
                     activation_bytes: int = 0, recompute_bytes: int = 0,
                     optimizer_s: float = 0.0,
                     optimizer_state_bytes: int = 0, tp: int = 1, tp_allreduces: int = 0,
                     tp_bytes: int = 0, shard: int = 1, network: Any = None,
                     name: str | None = None) -> CapturedPipeline:
    """A pipeline of identical stages, as a capture would record it — to study schedules
    without capturing a model.

    Every stage (``pp × stages_per_rank`` of them) takes ``forward_s`` per microbatch forward
    and ``backward_s`` per backward (with ``weight_s``: ``backward_s`` is the input-gradient
    part ``I`` and ``weight_s`` the weight-gradient part ``W``, as zero-bubble schedules split
    it), sends ``send_bytes`` each way per microbatch, holds ``param_bytes`` of parameters
    (all of it, before any sharding), ``optimizer_state_bytes`` per rank and
    ``activation_bytes`` per microbatch in flight (and, with activation checkpointing,
    ``recompute_bytes`` while a backward recomputes a block), and steps its optimizer in
    ``optimizer_s``.
    ``tp > 1``: each forward and backward (``I`` when split) runs ``tp_allreduces`` all-reduces
    of ``tp_bytes`` on the tensor-parallel group, evenly spread and waited for at once.
    ``shard > 1``: FSDP over ``shard`` ranks inside each stage — the first forward all-gathers
    the rank's parameters (bf16), the stage's ``REDUCE_GRAD`` after its last backward
    reduce-scatters their gradients (fp32). ``schedule``: the captured schedule (default 1F1B, or Interleaved1F1B
    with ``stages_per_rank > 1``)."""
    pp = integer("pp", pp, minimum=2, hint="pipeline ranks, e.g. 4")
    m = integer("microbatches", microbatches, minimum=1, hint="e.g. 8")
    v = integer("stages_per_rank", stages_per_rank, minimum=1, hint="1, or 2+ (interleaved)")
    tp = integer("tp", tp, minimum=1, hint="the tensor-parallel size, e.g. 8")
    shard = integer("shard", shard, minimum=1, hint="the FSDP size inside a stage, e.g. 8")
    fs = number("forward_s", forward_s, minimum=0, hint="seconds per stage and microbatch")
    bs = number("backward_s", backward_s, minimum=0, hint="seconds per stage and microbatch")
    ws = None if weight_s is None else number("weight_s", weight_s, minimum=0,
                                               hint="seconds of the weight-gradient part")
    for n, x in (("send_bytes", send_bytes), ("param_bytes", param_bytes),
                 ("activation_bytes", activation_bytes), ("recompute_bytes", recompute_bytes),
                 ("optimizer_state_bytes", optimizer_state_bytes), ("tp_allreduces", tp_allreduces),
                 ("tp_bytes", tp_bytes)):
        integer(n, x, minimum=0)
    number("optimizer_s", optimizer_s, minimum=0, hint="seconds")
    if schedule is None:
        schedule = "1F1B" if v == 1 else "Interleaved1F1B"
    rank_params = param_bytes // tp  # one rank's share of the stage before FSDP

    def tp_events(seconds: float) -> list[dict[str, Any]]:
        if tp == 1 or not tp_allreduces:
            return []
        return [{"op": "all_reduce", "bytes": int(tp_bytes), "scope": "tp",
                 "offset": seconds * (j + 1) / (tp_allreduces + 1),
                 "wait_at": seconds * (j + 1) / (tp_allreduces + 1)}
                for j in range(tp_allreduces)]

    def profiles(seconds: float, tp_side: bool, gather: bool) -> list[dict[str, Any]]:
        out = []
        for i in range(m):
            ev = tp_events(seconds) if tp_side else []
            if gather and shard > 1 and i == 0:
                ev = [{"op": "all_gather_into_tensor", "bytes": rank_params // 2,
                       "scope": "shard", "offset": 0.0, "wait_at": 0.0}] + ev
            out.append({"seconds": seconds, "events": ev})
        return out

    # FSDP's reduce-scatters: torch's REDUCE_GRAD after the stage's last backward
    scatter = [{"op": "reduce_scatter_tensor", "bytes": rank_params, "scope": "shard",
                "offset": 0.0, "wait_at": 0.0}] if shard > 1 else []
    from ..compat import generate_stage_to_rank_mapping

    v_shaped = schedule_name(schedule) in ("ZBVZeroBubble", "DualPipeV")  # torch's placement
    where = generate_stage_to_rank_mapping(pp, pp * v, style="v" if v_shaped else "loop")
    stages = []
    for s in range(pp * v):
        actions = {"F": profiles(fs, True, True)}
        if ws is None:
            actions["B"] = profiles(bs, True, False)
        else:
            actions["I"] = profiles(bs, True, False)
            actions["W"] = profiles(ws, False, False)
        stages.append({"stage": s, "rank": where[s], "layers": [s, s + 1],
                       "param_bytes": int(param_bytes),
                       "optimizer_state_bytes": int(optimizer_state_bytes),
                       "activation_bytes": int(activation_bytes),
                       "recompute_bytes": int(recompute_bytes),
                       "send_bytes": {"F": int(send_bytes), "B": int(send_bytes)},
                       "actions": actions, "unshard": [], "reshard": [],
                       "reduce_grad": {"seconds": 0.0, "events": list(scatter)},
                       "optimizer": {"seconds": float(optimizer_s), "events": []}})
    mesh = {"pp": pp}
    if shard > 1:
        mesh["shard"] = shard
    if tp > 1:
        mesh["tp"] = tp
    net = None
    if network is not None:
        if not isinstance(network, Network):
            raise TypeError(f"network must be a simddp.Network (stored in the capture), got "
                            f"{network!r}")
        net = network.to_dict()
    return CapturedPipeline(
        name=name or f"uniform pp:{pp} × {v} stages, {m} microbatches",
        schedule=schedule_name(schedule), pp=pp,
        stages_per_rank=v, microbatches=m, microbatch_size=1, mesh=mesh,
        world_size=math.prod(mesh.values()), stages=stages, param_bytes=int(param_bytes) * pp * v,
        data="fsdp" if shard > 1 else "none", param_dtype="bf16" if shard > 1 else None,
        network=net, activation_checkpointing=bool(recompute_bytes))
