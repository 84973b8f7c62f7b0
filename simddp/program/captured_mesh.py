"""What a capture of a sharded step holds: FSDP2/HSDP (× TP) steps (:class:`CapturedStep`,
on :class:`ShardedStep`'s fields, which context parallelism's
:class:`~simddp.program.context.CapturedCP` shares) and pipelines (:class:`CapturedPipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .captured_base import MeshCapture

__all__ = ["ShardedStep", "CapturedStep", "CapturedPipeline"]


@dataclass
class ShardedStep(MeshCapture):
    """The fields of one captured step sharded by FSDP2 (optionally with tensor parallelism),
    which :class:`CapturedStep` and context parallelism's
    :class:`~simddp.program.context.CapturedCP` share (see :class:`CapturedStep` for what each
    holds). Not a capture kind itself: a registry that finds a planner by ``isinstance``
    tells the kinds apart by their own classes."""

    name: str
    parallel: str
    world_size: int
    mesh: dict[str, int]
    reshard_after_forward: bool
    param_dtype: str | None
    reduce_dtype: str | None
    profiles: list[dict[str, Any]]
    param_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    network: dict[str, Any] | None = None
    compute: str = ""
    costs: dict[str, float] | None = None
    cosim_iteration_time: float = 0.0
    cosim_exposed_comm: float = 0.0
    recompute_bytes: int = 0  # activation checkpointing: one block's, while backward recomputes it
    activation_checkpointing: bool = False
    # tensor parallelism (a "tp" dimension in mesh): the parameters' bytes one TP rank holds
    # before FSDP2 shards them (0: param_bytes, no TP), and whether the plan was
    # sequence-parallel
    local_param_bytes: int = 0
    sequence_parallel: bool = False

    @property
    def tp_param_bytes(self) -> int:
        """The parameters one TP rank holds before FSDP2 shards them."""
        return int(self.local_param_bytes or self.param_bytes)


@dataclass
class CapturedStep(ShardedStep):
    """One training step of a sharded program (FSDP2, HSDP) as
    :func:`~simddp.cosim.capture_fsdp.capture_fsdp` recorded it; JSON-serialisable.

    ``profiles``: per captured rank, per phase ("forward", "backward", "optimizer")
    ``{"seconds": compute, waits excluded, "events": [{"op", "bytes", "scope", "offset",
    "wait_at"}]}`` — every collective issued in the phase, in issue order, at its compute
    offset, with the offset where the rank waited for it (None: never in that phase) and its
    mesh dimension (``scope``: ``"shard"``, ``"replicate"``, ``"tp"``). ``mesh``: the
    capture's mesh (``{"shard": n}`` or ``{"replicate": r, "shard": s}``, with ``"tp": t``
    innermost under tensor parallelism). Memory facts per rank: ``param_bytes`` (the model's,
    unsharded), ``optimizer_state_bytes`` (this rank's shard), ``activation_bytes`` (saved for
    backward in the step; with ``activation_checkpointing`` the blocks' inputs and what is saved
    outside them) and ``recompute_bytes`` (with activation checkpointing: the largest block's
    activations, live while backward recomputes it)."""

    # the storages counted in activation_bytes, in the order autograd saved them (the
    # allocations the caching allocator model replays; empty: one share per unit)
    activation_sizes: list[int] = field(default_factory=list)
    # the most bytes live at once in a plain forward, loss and backward beyond what is saved,
    # the parameters and their gradients (the loss's fp32 logits gradients, ...)
    temporary_bytes: int = 0


@dataclass
class CapturedPipeline(MeshCapture):
    """One training step of a pipeline-parallel program (``torch.distributed.pipelining``,
    optionally with FSDP2 and/or tensor parallelism inside each stage), as
    :func:`~simddp.cosim.capture_pp.capture_pp` recorded it; JSON-serialisable.

    ``stages``: per stage index (``pp × stages_per_rank`` of them), a dict::

        {"stage": s, "rank": r,                        # r: its rank along "pp"
         "layers": [first, end),                       # the blocks the stage holds
         "param_bytes": int,                           # the stage's parameters, unsharded
         "optimizer_state_bytes": int,                 # one rank's optimizer state
         "activation_bytes": int,                      # saved for backward, one microbatch
         "recompute_bytes": int,                       # activation checkpointing: one block's,
                                                       # live while a backward recomputes it
         "send_bytes": {"F": int, "B": int},           # to the next stage / previous stage
         "actions": {"F": [profile, ...], "B": [...], "I": [...], "W": [...]},
         "unshard": [profile, ...],                    # torch's UNSHARD actions, in order
         "reshard": [profile, ...],                    # and RESHARD (multi-stage + FSDP2)
         "reduce_grad": profile,                       # torch's REDUCE_GRAD action
         "optimizer": profile}

    with one ``profile`` per captured microbatch (index = microbatch) for each action type the
    captured schedule ran (``B`` for full-backward schedules, ``I`` and ``W`` for zero-bubble
    ones; ``None`` for a microbatch whose backward ran as the other kind — DualPipeV mixes
    them), each a phase profile as :class:`CapturedStep` has them: ``{"seconds": compute,
    waits excluded, "events": [{"op", "bytes", "scope", "offset", "wait_at"}]}`` — the
    collectives the action issued inside the stage (tensor parallelism on ``"tp"``, FSDP2 on
    ``"shard"``/``"replicate"``), not the pipeline's sends and receives, which the schedule's
    action list places (``send_bytes``). The last stage's ``F`` includes its loss. ``reduce_grad``:
    the stage's ``perform_reduce_grad`` after its last backward (FSDP2's reduce-scatters, gradient
    scaling by the number of microbatches). ``unshard`` / ``reshard``: with FSDP2 under a
    multi-stage schedule, torch lowers the schedule with UNSHARD / RESHARD actions (the
    stage's all-gathers issued asynchronously: the stage's next ``F`` or ``B`` waits for them,
    so their ``wait_at`` is None); single-stage schedules leave them empty and gather in the
    first ``F``. ``schedule``: the torch schedule class captured;
    ``mesh``: the capture's mesh (``{"pp": p[, "replicate": r][, "shard": s][, "tp": t]}``).
    ``activation_checkpointing``: every block of every stage ran under torch's
    ``checkpoint_wrapper`` (full AC): ``B`` (``I``) recomputes the stage's forward, a stage's
    ``activation_bytes`` are its blocks' inputs and what is saved outside them, and
    ``recompute_bytes`` its largest block's saved activations (0 without AC, or for a stage
    without blocks).
    """

    name: str
    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    microbatch_size: int
    mesh: dict[str, int]
    world_size: int
    stages: list[dict[str, Any]]
    param_bytes: int
    data: str = "none"  # data parallelism inside a stage: "none", "fsdp" or "hsdp"
    reshard_after_forward: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    network: dict[str, Any] | None = None
    compute: str = ""
    costs: dict[str, float] | None = None
    cosim_iteration_time: float = 0.0
    cosim_exposed_comm: float = 0.0
    activation_checkpointing: bool = False
