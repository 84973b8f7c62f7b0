"""Capture of a pipeline-parallel training step: torch's real ``torch.distributed.pipelining``
on the fake cluster, under virtual time, recorded per stage and action for the PP planner.

:func:`capture_pp` cuts the scenario's Llama into ``pp × stages_per_rank`` stages
(:class:`models.llama.LlamaStage`, torchtitan's manual split), places them on the ranks of
the ``"pp"`` dimension of a real ``init_device_mesh`` as the schedule wants them (looped, or
V-shaped for ZBVZeroBubble and DualPipeV: ``torch``'s ``generate_stage_to_rank_mapping``),
parallelizes each stage inside its ``pp`` slice (:func:`parallelize_stage`: tensor parallelism,
then FSDP2), wraps each in torch's ``PipelineStage`` and trains ``iterations`` steps with the
real schedule class (``get_schedule_class(schedule)``) and one optimizer per stage (torchtitan's
per-model-part optimizers, stepped together). The last step is recorded: the stage objects'
``forward_one_chunk`` (with the loss, on the last stage), ``backward_one_chunk`` (``B``, or
``I`` for zero-bubble schedules), ``backward_weight_one_chunk`` (``W``) and
``perform_reduce_grad`` mark the rank's virtual clock, and each rank's collective trace is
sliced into those actions (:func:`~simddp.cosim.capture_fsdp.span_profile`), the pipeline's
own sends and receives left out — their sizes are the stage's ``send_bytes``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import defaultdict
from typing import Any, Callable, Mapping

import torch

from fakepg.arguments import integer
from fakepg.errors import RankFailedError

from ..program.captured import CapturedPipeline
from ..program.mesh import DeviceMesh
from ..timing import Timing
from .capture import rank_batches, saved_bytes, state_bytes
from .checkpointing import checkpointed_modules, is_op, policy_name
from .capture_fsdp import (torch_dtype, checkpoint_blocks, cosim_facts, fsdp_units,
                           outputs_not_modified_in_place, span_profile)
from .meta import (DEVICES, fsdp_on_meta, functional_waits_on_meta, in_meta_scope,
                   pipelining_on_meta)
from .represent import choose, represented, stand_ins
from .simulate import issued, now, simulate
from .tensor_parallel import apply_tensor_parallel

__all__ = ["capture_pp", "parallelize_stage", "schedule_class", "stage_ranks", "SCHEDULES"]

# torch's schedule names (get_schedule_class), less its two abstract bases
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # two stages a rank, placed as a V
_MESH_DIMS = ("replicate", "shard", "tp")  # inside a stage, after "pp" (torchtitan's order)
_P2P = ("send", "recv")


class _ConfigError(ValueError):
    """A pipeline configuration torch refused while building the schedule (raised in a rank,
    re-raised by :func:`capture_pp` as itself)."""


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name`` (case-insensitive), with an error naming the
    accepted ones."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    if not isinstance(name, str) or name.lower() not in {s.lower() for s in SCHEDULES}:
        raise ValueError(f"capture_pp: unknown pipeline schedule {name!r}; torch's schedules "
                         f"are {', '.join(SCHEDULES)}")
    return get_schedule_class(name)


def _canonical(name: str) -> str:
    return next(s for s in SCHEDULES if s.lower() == name.lower())


def stage_ranks(schedule: str, pp: int, stages_per_rank: int) -> dict[int, int]:
    """Stage index → rank along ``"pp"``, as the schedule places its stages (torch's
    ``generate_stage_to_rank_mapping``: looped, or V-shaped)."""
    from ..compat import generate_stage_to_rank_mapping

    style = "v" if _canonical(schedule) in _V_SHAPED else "loop"
    return generate_stage_to_rank_mapping(pp, pp * stages_per_rank, style=style)


def parallelize_stage(module: torch.nn.Module, mesh: Any, *,
                      reshard_after_forward: bool = False, mp_policy: Any = None,
                      sequence_parallel: bool = True, activation_checkpointing: bool = False,
                      device: str = "cpu") -> torch.nn.Module:
    """Parallelize one pipeline stage inside its slice of the device ``mesh`` (a torch
    ``DeviceMesh`` whose dimensions include some of "replicate", "shard", "tp"; None: no
    parallelism inside the stage), as torchtitan does: tensor parallelism on "tp" first
    (torchtitan's Llama 3 plan, :func:`~simddp.cosim.tensor_parallel.apply_tensor_parallel`;
    with ``sequence_parallel`` the hidden states between stages are sequence shards, which the
    stage is told), then with ``activation_checkpointing`` each of the stage's blocks under
    torch's ``checkpoint_wrapper`` (:func:`~simddp.cosim.capture_fsdp.checkpoint_blocks`; a stage
    without blocks has nothing to checkpoint; ``device``: where its parameters are), then
    FSDP2 — ``fully_shard`` on each block (:func:`~simddp.cosim.capture_fsdp.fsdp_units`) and
    on the stage itself, on the data-parallel submesh (HSDP when it has "replicate"),
    ``reshard_after_forward`` False by default (torchtitan's default under pipeline
    parallelism: each microbatch would otherwise gather the parameters again)."""
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" in names:
        apply_tensor_parallel(module, mesh["tp"], sequence_parallel=sequence_parallel)
        if sequence_parallel:  # hidden states travel between stages as sequence shards
            module.sequence_shards = mesh["tp"].size()
    if activation_checkpointing:
        checkpoint_blocks(module.layers, device, activation_checkpointing)
    dp = tuple(d for d in ("replicate", "shard") if d in names)
    if dp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        sub = mesh[dp]
        policy = mp_policy or MixedPrecisionPolicy()
        for unit in fsdp_units(module):
            fully_shard(unit, mesh=sub, reshard_after_forward=reshard_after_forward,
                        mp_policy=policy)
        fully_shard(module, mesh=sub, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    return module


class _StageOptimizers(torch.optim.Optimizer):
    """One optimizer per stage stepped as one (torchtitan's ``OptimizersContainer``): the
    co-simulation ends an iteration at the end of an outermost optimizer step, once a step
    whatever the number of stages; ``timed(stage, fn)`` records each stage's own step."""

    def __init__(self, opts: Mapping[int, torch.optim.Optimizer],
                 timed: Callable[[int, Callable[[], Any]], Any]) -> None:
        self.opts, self.timed = dict(opts), timed
        params = [p for o in self.opts.values() for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # noqa: D102
        for s, opt in self.opts.items():
            self.timed(s, opt.step)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for opt in self.opts.values():
            opt.zero_grad(set_to_none)


def _nbytes(out: Any) -> int:
    """Bytes of the tensors in a stage's output (a tensor or a tuple of them)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def _loss_fn(scenario: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The schedule's ``loss_fn(output, target)`` from the scenario's ``loss(output, batch)``
    (the zoo's losses read the target as ``batch[1]``)."""
    loss = scenario.loss

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss(output, (None, target))
    return loss_fn


def _rank_run(scenario: Any, cfg: Mapping[str, Any]) -> Callable[[int], dict[str, Any]]:
    """The function each fake rank runs: build, place and parallelize its stages, train with
    the schedule, and return its windows per (stage, action, microbatch) of the last step, its
    stages' memory facts and (last stage) the losses."""
    mesh_dims: dict[str, int] = cfg["mesh"]
    pp, spr, m, device = cfg["pp"], cfg["stages_per_rank"], cfg["microbatches"], cfg["device"]
    num_stages = pp * spr
    last = cfg["iterations"] - 1
    placement = stage_ranks(cfg["schedule"], pp, spr)

    def _run(rank: int) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        from fakepg.zoo.llama import LlamaStage

        mesh = init_device_mesh("cpu", tuple(mesh_dims.values()),
                                mesh_dim_names=tuple(mesh_dims))
        coord = dict(zip(mesh_dims, mesh.get_coordinate()))
        dp_rank = coord.get("replicate", 0) * mesh_dims.get("shard", 1) + coord.get("shard", 0)
        dp_size = mesh_dims.get("replicate", 1) * mesh_dims.get("shard", 1)
        with torch.device(device):  # on meta: parameters without storage
            model = scenario.build_model()
        mine = [s for s in range(num_stages) if placement[s] == coord["pp"]]
        inner = mesh[tuple(d for d in mesh_dims if d != "pp")] if len(mesh_dims) > 1 else None
        policy = MixedPrecisionPolicy(param_dtype=torch_dtype(cfg["param_dtype"]),
                                      reduce_dtype=torch_dtype(cfg["reduce_dtype"]))
        facts: dict[int, dict[str, int]] = {}
        stages = []
        for s in mine:
            part = LlamaStage(model, s, num_stages, **cfg["split"])
            facts[s] = {"param_bytes": sum(p.numel() * p.element_size()
                                           for p in part.parameters())}
            parallelize_stage(part, inner, mp_policy=policy,
                              sequence_parallel=cfg["sequence_parallel"],
                              activation_checkpointing=cfg["activation_checkpointing"],
                              device=device)
            shapes = _stage_io(part, cfg["io"])
            stages.append(PipelineStage(part, s, num_stages, torch.device(device),
                                        input_args=shapes[0], output_args=shapes[1],
                                        group=mesh.get_group("pp")))
        cls = schedule_class(cfg["schedule"])
        loss_fn = _loss_fn(scenario)
        try:
            sched = (cls(stages[0], m, loss_fn=loss_fn)
                     if issubclass(cls, PipelineScheduleSingle)
                     else cls(stages, m, loss_fn=loss_fn))
        except ValueError as e:
            raise _ConfigError(f"capture_pp: torch's {cls.__name__} refuses {m} microbatches "
                               f"on {num_stages} stages ({pp} ranks × {spr}): {e}") from None

        windows: dict[tuple, list[tuple]] = defaultdict(list)  # (t0, t1, first, end)
        on = [False]
        previous: list[tuple] = [()]  # the last timed call's key
        occurrences: dict[tuple, int] = defaultdict(int)  # per (stage, kind), this step

        def timed(key: tuple, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
            t0, n0 = now(), issued()
            out = fn(*a, **kw)
            if on[0]:
                windows[key].append((t0, now(), n0, issued()))
            previous[0] = key
            return out

        def occurrence(s: int, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            # an UNSHARD (RESHARD) action calls each FSDP module of the stage in turn: the
            # calls in a row are one action, its k-th of the step
            def call(*a: Any, **kw: Any) -> Any:
                if previous[0][:2] != (s, kind):
                    occurrences[s, kind] += 1
                return timed((s, kind, occurrences[s, kind] - 1), fn, *a, **kw)
            return call

        for st in stages:
            _instrument(st, timed, facts[st.stage_index])
            for mod in st.submod.modules():  # called by the schedule's UNSHARD / RESHARD
                if hasattr(mod, "unshard") and hasattr(mod, "reshard"):
                    mod.unshard = occurrence(st.stage_index, "unshard", mod.unshard)
                    mod.reshard = occurrence(st.stage_index, "reshard", mod.reshard)
        compute_loss = sched._maybe_compute_loss

        def maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb: int,
                               *a: Any, **kw: Any) -> Any:
            # the loss belongs to the last stage's forward of that microbatch
            return timed((stage.stage_index, "F", mb), compute_loss, stage, output,
                         target_mbs, mb, *a, **kw)
        sched._maybe_compute_loss = maybe_compute_loss
        opts = {st.stage_index: scenario.optimizer(st.submod.parameters()) for st in stages}
        opt = _StageOptimizers(opts, lambda s, fn: timed((s, "optimizer", None), fn))
        first, final = 0 in mine, num_stages - 1 in mine
        losses_seen: list[list[float]] = []
        for i, (tokens, targets) in enumerate(rank_batches(scenario, dp_rank, dp_size,
                                                       cfg["iterations"], device)):
            on[0] = i == last
            occurrences.clear()
            opt.zero_grad()
            losses: list[torch.Tensor] = []
            sched.step(*((tokens,) if first else ()),
                       **({"target": targets, "losses": losses} if final else {}))
            opt.step()
            if final and device != "meta":
                losses_seen.append([float(x.detach()) for x in losses])
        for s, o in opts.items():
            facts[s]["optimizer_state_bytes"] = state_bytes(o)
        return {"windows": dict(windows), "facts": facts, "losses": losses_seen}

    return in_meta_scope(device, _run)


def _stage_io(stage: Any, io: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's input and output of one microbatch, as meta tensors: given to
    ``PipelineStage`` so that it knows its shapes up front (torch's static mode, as torchtitan
    runs it) rather than inferring them in the first step by sending pickled metadata."""
    mb, seq, dtype = io["microbatch_size"], io["seq_len"], io["dtype"]
    args, local = stage.args, io["seq_len"] // stage.sequence_shards

    def t(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device="meta")
    # training: hidden states in and out carry gradients (the ones the stages exchange); the
    # logits are whole (tensor parallelism gathers them)
    x = t(mb, seq, dt=torch.int64) if stage.first else t(mb, local, args.dim).requires_grad_()
    return x, (t(mb, seq, args.vocab_size) if stage.last else t(mb, local, args.dim)
               ).requires_grad_()


def _instrument(stage: Any, timed: Callable[..., Any], facts: dict[str, int]) -> None:
    """Mark the virtual clock around the stage object's actions (instance attributes, so
    the schedule's own calls go through them)."""
    s = stage.stage_index

    def bound(name: str) -> tuple[Callable[..., Any], inspect.Signature]:
        fn = getattr(stage, name)
        return fn, inspect.signature(fn)

    fwd, fwd_sig = bound("forward_one_chunk")
    bwd, bwd_sig = bound("backward_one_chunk")
    bw, bw_sig = bound("backward_weight_one_chunk")
    reduce = stage.perform_reduce_grad

    def forward_one_chunk(*a: Any, **kw: Any) -> Any:
        mb = fwd_sig.bind(*a, **kw).arguments["fwd_chunk_id"]
        out = timed((s, "F", mb), fwd, *a, **kw)
        facts["send_F"] = 0 if stage.is_last else _nbytes(out)
        return out

    def backward_one_chunk(*a: Any, **kw: Any) -> Any:
        args = bwd_sig.bind(*a, **kw)
        args.apply_defaults()
        kind = "B" if args.arguments["full_backward"] else "I"
        return timed((s, kind, args.arguments["bwd_chunk_id"]), bwd, *a, **kw)

    def backward_weight_one_chunk(*a: Any, **kw: Any) -> Any:
        mb = bw_sig.bind(*a, **kw).arguments["bwd_chunk_id"]
        return timed((s, "W", mb), bw, *a, **kw)

    def perform_reduce_grad(*a: Any, **kw: Any) -> Any:
        return timed((s, "reduce_grad", None), reduce, *a, **kw)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    stage.perform_reduce_grad = perform_reduce_grad


def _stage_activation_bytes(scenario: Any, num_stages: int, microbatch_size: int,
                            device: str, dtype: torch.dtype | None, tp: int,
                            sequence_parallel: bool, split: Mapping[str, int],
                            checkpointed: Any, represent: bool = False
                            ) -> list[tuple[int, int]]:
    """Per stage, what autograd keeps for backward in one microbatch's forward (and, on the
    last stage, its loss) on one rank, the stage's input included (the pipeline keeps it for
    the backward): (held, recompute) as :func:`~simddp.cosim.capture.saved_bytes` counts them
    — with ``checkpointed`` the stage's blocks' inputs and what is saved outside them, and its
    largest block's recompute (0 for a stage without blocks). Rank 0's first microbatch through
    the stages one after another, each under tensor parallelism over ``tp`` ranks as in the
    capture, on an untimed fake world (saved-tensor hooks add ops a compute model would
    charge); with ``represent`` (on meta) rank 0 alone, its TP peers' collectives answered by
    stand-ins (:mod:`simddp.cosim.represent`)."""
    import fakepg

    from fakepg.zoo.llama import LlamaStage

    def run(rank: int) -> list[tuple[int, int]]:
        from torch.distributed.device_mesh import init_device_mesh

        with torch.device(device):
            model = scenario.build_model()
        if dtype is not None:
            model = model.to(dtype)
        tp_mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)) if tp > 1 else None
        tokens, targets = rank_batches(scenario, 0, 1, 1, device)[0]
        # one microbatch's own tokens and targets (a slice would count the whole batch's
        # storage, which the step holds once, not each microbatch in flight)
        x: torch.Tensor = tokens[:microbatch_size].clone()
        targets = targets[:microbatch_size].clone()
        loss_fn = _loss_fn(scenario)
        out = []
        for s in range(num_stages):
            stage = LlamaStage(model, s, num_stages, **split)
            if tp_mesh is not None:
                parallelize_stage(stage, tp_mesh, sequence_parallel=sequence_parallel)
            if s:
                x = x.detach().requires_grad_()
            y: list[torch.Tensor] = []

            def forward(stage: Any = stage, x: torch.Tensor = x) -> Any:
                y.append(stage(x))
                return loss_fn(y[0], targets) if stage.last else y[0]
            out.append(saved_bytes(forward, device,
                                   checkpointed_modules(list(stage.layers), checkpointed)
                                   if checkpointed else None,
                                   stage.parameters(), op_saved=is_op(checkpointed)))
            x = y[0]
        return out

    # on meta the TP ranks are symmetric: rank 0 runs, its collectives answered for the rest
    fn = represented(run, stand_ins({"tp": tp}) if represent else {})
    return [(int(h), int(r)) for h, r in fakepg.spawn(fn, nprocs=tp).returns[0]]


def capture_pp(scenario: Any, pp: int, *, schedule: str = "1F1B",
               microbatches: int | None = None, stages_per_rank: int = 1,
               mesh: Mapping[str, int] | None = None, timing: Timing | None = None,
               device: str = "cpu", iterations: int = 2, seed: int = 0,
               param_dtype: str | None = None, reduce_dtype: str | None = None,
               sequence_parallel: bool = True, losses: list | None = None,
               input_weight: int = 0, output_weight: int = 0,
               activation_checkpointing: Any = False,
               representatives: bool | None = None) -> CapturedPipeline:
    """Run ``scenario`` (whose model is the zoo's :class:`models.llama.Llama`) pipelined over
    ``pp`` ranks with torch's real ``PipelineStage`` and ``schedule`` (one of
    :data:`SCHEDULES`) under :func:`simddp.simulate`, and record its last step (see the
    module docstring and :class:`~simddp.program.captured.CapturedPipeline`).

    ``microbatches``: per step (default: the batch size, microbatches of one sample, as
    torchtitan); it must divide the scenario's batch. ``stages_per_rank``: 1 for GPipe and
    1F1B, 2 for the V-shaped ZBVZeroBubble and DualPipeV, any for the looped multi-stage ones.
    ``mesh``: the dimensions inside a stage, ``{"shard": s}`` (FSDP2), ``{"replicate": r,
    "shard": s}`` (HSDP), ``{"tp": t}`` or combinations; the world is ``pp`` × their product,
    on a mesh ``pp × replicate × shard × tp``. ``param_dtype`` / ``reduce_dtype``: FSDP2's
    mixed precision ("bf16", "fp16", "fp32"). ``sequence_parallel``: with "tp", torchtitan's
    sequence-parallel plan (its default). ``device="meta"``: at real size without
    arithmetic (:mod:`simddp.cosim.meta`). ``losses``: a list that receives, per iteration,
    the last stage's per-microbatch losses (data-parallel rank 0; not on meta).
    ``input_weight`` / ``output_weight``: how many blocks the embedding and the head count as
    when the blocks are split (:func:`models.llama.stage_layers`: 0 and 0, equal blocks per
    stage; 1 and 1, torchtitan's default uneven split). ``activation_checkpointing``: every
    block of every stage under torch's ``checkpoint_wrapper`` (torchtitan's full AC, after
    tensor parallelism and before FSDP2): a backward recomputes its stage's forward, and a
    microbatch in flight keeps only the blocks' inputs (the stage's ``activation_bytes``) until
    then, plus one block's activations while a backward recomputes it (``recompute_bytes``).
    ``representatives``: inside each stage one rank runs for its FSDP2 / TP peers
    (:mod:`simddp.cosim.represent`; every stage's ranks along ``"pp"`` run): the same capture
    at the cost of ``pp`` ranks; None (the default) where it holds (on meta, with a symmetric
    timing and placement), False: every rank runs, True: refuse where it does not hold."""
    if device not in DEVICES:
        raise ValueError(f"capture_pp: device must be one of {', '.join(DEVICES)}, "
                         f"got {device!r}")
    pp = integer("capture_pp: pp", pp, minimum=1, hint="the pipeline's ranks, e.g. 4")
    cls = schedule_class(schedule)
    name = _canonical(schedule)
    spr = integer("capture_pp: stages_per_rank", stages_per_rank, minimum=1)
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    if issubclass(cls, PipelineScheduleSingle) and spr != 1:
        raise ValueError(f"capture_pp: {name} runs one stage per rank; got stages_per_rank="
                         f"{spr} (multi-stage schedules: "
                         f"{', '.join(s for s in SCHEDULES if s not in ('GPipe', '1F1B'))})")
    if name in _V_SHAPED and spr != 2:
        raise ValueError(f"capture_pp: {name} places exactly 2 stages on each rank (a V); "
                         f"got stages_per_rank={spr}")
    iterations = integer("capture_pp: iterations", iterations, minimum=2,
                         hint="the last step is recorded once the optimizer has its state "
                              "and the stages their shapes")
    inner = dict(mesh or {})
    bad = sorted(set(inner) - set(_MESH_DIMS))
    if bad:
        raise ValueError(f"capture_pp: mesh dimensions {bad} are not accepted inside a stage; "
                         f"give some of {', '.join(_MESH_DIMS)} (pp is the pp argument)")
    for d, v in inner.items():
        integer(f"capture_pp: mesh[{d!r}]", v, minimum=1)
    mesh_dims = {"pp": pp, **{d: int(inner[d]) for d in _MESH_DIMS if d in inner}}
    model = checked_llama(scenario)
    num_stages = pp * spr
    from fakepg.zoo.llama import stage_layers
    split = {"input_weight": integer("capture_pp: input_weight", input_weight, minimum=0),
             "output_weight": integer("capture_pp: output_weight", output_weight, minimum=0)}
    stage_layers(model.args.n_layers, 0, num_stages, **split)  # raises when they do not split
    batch = rank_batches(scenario, 0, 1, 1, "cpu")[0][0]
    batch_size = int(batch.shape[0])
    m = batch_size if microbatches is None else integer("capture_pp: microbatches",
                                                        microbatches, minimum=1)
    if batch_size % m:
        raise ValueError(f"capture_pp: {m} microbatches do not divide the scenario's batch of "
                         f"{batch_size} samples; give a divisor of {batch_size}")
    torch_dtype(param_dtype), torch_dtype(reduce_dtype)
    timing = Timing() if timing is None else timing
    world = math.prod(mesh_dims.values())
    fsdp = any(d in mesh_dims for d in ("replicate", "shard"))
    if param_dtype is not None and not fsdp:
        raise ValueError("capture_pp: param_dtype / reduce_dtype are FSDP2's mixed precision; "
                         "give a mesh with 'shard' (or 'replicate') to use them")
    io = {"microbatch_size": batch_size // m, "seq_len": int(batch.shape[1]),
          "dtype": torch_dtype(param_dtype) or next(model.parameters()).dtype}
    cfg = dict(io=io, mesh=mesh_dims, pp=pp, stages_per_rank=spr, microbatches=m, device=device,
               iterations=iterations, schedule=name, param_dtype=param_dtype,
               reduce_dtype=reduce_dtype, sequence_parallel=bool(sequence_parallel), split=split,
               activation_checkpointing=policy_name(activation_checkpointing) or False)
    stand = choose(mesh_dims, timing, device, representatives, "capture_pp")
    run = _rank_run(scenario, cfg)
    try:
        with (fsdp_on_meta() if device == "meta" and fsdp else contextlib.nullcontext()), \
                (pipelining_on_meta() if device == "meta" else contextlib.nullcontext()), \
                (functional_waits_on_meta() if device == "meta" else contextlib.nullcontext()):
            with outputs_not_modified_in_place():
                res = simulate(represented(run, stand), (), world,
                               timing=timing, seed=seed)
    except RankFailedError as e:
        if isinstance(e.__cause__, _ConfigError):
            raise ValueError(str(e.__cause__)) from None
        raise
    per_stage = world // pp  # ranks of one pp slice; its first holds the recorded profiles
    placement = stage_ranks(name, pp, spr)
    dmesh = DeviceMesh(world, mesh_dims)
    held = _stage_activation_bytes(scenario, num_stages, batch_size // m, device,
                                   torch_dtype(param_dtype), mesh_dims.get("tp", 1),
                                   bool(sequence_parallel), split,
                                   policy_name(activation_checkpointing) or False,
                                   represent=device == "meta" and representatives is not False)
    stages = []
    for s in range(num_stages):
        rank = placement[s] * per_stage
        out = res.returns[rank]
        wins, facts = out["windows"], out["facts"][s]

        def prof(key: tuple) -> dict[str, Any]:
            return span_profile(res, rank, wins.get(key, []), dmesh, skip=_is_p2p)

        kinds = sorted({k[1] for k in wins if k[0] == s and k[1] in ("F", "B", "I", "W")})
        layers = stage_layers(model.args.n_layers, s, num_stages, **split)
        stages.append({
            "stage": s, "rank": placement[s], "layers": [layers.start, layers.stop],
            "param_bytes": facts["param_bytes"],
            "optimizer_state_bytes": facts["optimizer_state_bytes"],
            "activation_bytes": held[s][0], "recompute_bytes": held[s][1],
            "send_bytes": {"F": facts["send_F"], "B": 0},
            # None: the schedule ran that microbatch's backward as another kind (DualPipeV
            # mixes full and split backwards)
            "actions": {k: [prof((s, k, mb)) if (s, k, mb) in wins else None
                            for mb in range(m)] for k in kinds},
            # multi-stage schedules with FSDP2: torch's UNSHARD / RESHARD actions, in order
            **{kind: [prof((s, kind, k)) for k in range(1 + max(
                (key[2] for key in wins if key[:2] == (s, kind)), default=-1))]
               for kind in ("unshard", "reshard")},
            "reduce_grad": prof((s, "reduce_grad", None)),
            "optimizer": prof((s, "optimizer", None))})
    for s in range(1, num_stages):  # the gradient sent back is the activation's shape
        stages[s]["send_bytes"]["B"] = stages[s - 1]["send_bytes"]["F"]
    if losses is not None:
        losses.extend(res.returns[placement[num_stages - 1] * per_stage]["losses"])
    last = iterations - 1
    data = "hsdp" if "replicate" in mesh_dims else "fsdp" if "shard" in mesh_dims else "none"
    return CapturedPipeline(
        name=str(getattr(scenario, "name", "scenario")), schedule=name, pp=pp,
        stages_per_rank=spr, microbatches=m, microbatch_size=batch_size // m,
        mesh=mesh_dims, world_size=world, stages=stages,
        param_bytes=sum(st["param_bytes"] for st in stages), data=data,
        reshard_after_forward=False, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        activation_checkpointing=bool(activation_checkpointing),
        **cosim_facts(timing, res, last))


def _is_p2p(rec: Any) -> bool:
    return rec.op in _P2P


def checked_llama(scenario: Any) -> Any:
    """The scenario's model, built on the meta device (no storage), checked to be a Llama."""
    from fakepg.zoo.llama import Llama

    with torch.device("meta"):
        model = scenario.build_model()
    if not isinstance(model, Llama):
        raise TypeError(f"capture_pp: pipelines the zoo's Llama (models.llama.Llama, e.g. "
                        f"workload llama3-tiny / llama3-8b); scenario "
                        f"{getattr(scenario, 'name', scenario)!r} builds "
                        f"{type(model).__name__}")
    return model
