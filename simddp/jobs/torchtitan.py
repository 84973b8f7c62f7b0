"""torchtitan's job TOML as a :class:`~simddp.jobs.job.Job`: :func:`read_torchtitan`.

Reads both forms torchtitan's ``train_configs`` have had: the older (``training.batch_size``,
``training.compile``, ``[float8]``) and the newer (``training.local_batch_size`` /
``global_batch_size``, ``[compile] enable``, ``[quantize.linear.float8]``). Defaults are
torchtitan's ``JobConfig`` defaults (``torchtitan/config/job_config.py`` at 238fa9953e4a):
local batch 8, seq_len 2048, mixed precision bf16 parameters / fp32 reduction, data-parallel
shard degree -1 (the ranks left over), pipeline schedule 1F1B with microbatches of 1,
activation checkpointing "selective" with option "2".

Every key is accounted for: read into the job, listed in ``Job.not_modelled`` with why, or —
for keys that change nothing in a training step's time or memory (logging, paths, learning
rates) — named on one ``not_modelled`` line of their own.
"""

from __future__ import annotations

import math
import os
import tomllib
from typing import Any

from .job import Job
from .models import TORCHTITAN_LLAMA3, resolve_model

__all__ = ["read_torchtitan"]

# keys with no effect on a step's time or memory (a section name: all its keys)
_NO_EFFECT = ("job", "metrics", "lr_scheduler", "comm", "fault_tolerance",
              "model.hf_assets_path", "model.tokenizer_path", "model.print_after_conversion",
              "model.name", "model.flavor",
              "optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.beta1",
              "optimizer.beta2", "optimizer.implementation", "optimizer.early_step_in_backward",
              "training.steps", "training.dataset", "training.dataset_path", "training.seed",
              "training.deterministic", "training.gc_freq", "training.gc_debug",
              "profiling.save_traces_folder", "profiling.profile_freq",
              "profiling.save_memory_snapshot_folder", "checkpoint.folder",
              "checkpoint.interval", "checkpoint.last_save_model_only",
              "checkpoint.model_weights_only", "checkpoint.export_dtype",
              "checkpoint.async_mode", "checkpoint.initial_load_path",
              "checkpoint.initial_load_model_only", "checkpoint.initial_load_in_hf",
              "checkpoint.last_save_in_hf", "checkpoint.keep_latest_k",
              "checkpoint.load_step", "checkpoint.exclude_from_loading",
              "validation.dataset", "validation.dataset_path", "validation.freq",
              "validation.steps", "validation.local_batch_size", "validation.seq_len",
              "activation_checkpoint.preserve_rng_state",
              "activation_checkpoint.determinism_check", "activation_checkpoint.debug",
              "activation_checkpoint.early_stop", "compile.components")
_FLOAT8_SECTIONS = ("float8", "quantize.linear.float8")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _dtype(name: str, key: str) -> str:
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "bf16": "bf16",
             "fp32": "fp32", "fp16": "fp16"}
    if name not in short:
        raise ValueError(f"{key} = {name!r}: give bfloat16, float16 or float32")
    return short[name]


def read_torchtitan(path: str | os.PathLike, world_size: int | None = None) -> Job:
    """The job torchtitan's TOML ``path`` describes (``world_size`` fills a degree left at -1;
    without it the spec keeps that dimension unsized)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"torchtitan job config {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not TOML ({e})") from None
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    cfg = _flatten(raw)
    used: set[str] = set()

    def get(key: str, default: Any = None) -> Any:
        used.add(key)
        return cfg.get(key, default)

    not_modelled: list[str] = []
    knobs: dict[str, Any] = {}

    # the model
    name = get("model.name", "llama3")
    flavor = get("model.flavor", "debugmodel")
    if name != "llama3":
        raise ValueError(f"{path}: model.name = {name!r}: simddp models torchtitan's llama3 "
                         f"(flavors {', '.join(TORCHTITAN_LLAMA3)}); give the model as a "
                         f"shape or Hugging Face config instead")
    seq_len = int(get("training.seq_len", 2048))
    old_batch = get("training.batch_size")
    local = int(get("training.local_batch_size", old_batch if old_batch is not None else 8))
    global_batch = int(get("training.global_batch_size", -1))
    model_spec = f"llama3:{flavor}"

    # the layout: torchtitan's ParallelDims (dp_shard -1: the ranks left over)
    r = int(get("parallelism.data_parallel_replicate_degree", 1))
    s = int(get("parallelism.data_parallel_shard_degree", -1))
    tp = int(get("parallelism.tensor_parallel_degree", 1))
    pp = int(get("parallelism.pipeline_parallel_degree", 1))
    cp = int(get("parallelism.context_parallel_degree", 1))
    for key, v in (("data_parallel_replicate_degree", r), ("tensor_parallel_degree", tp),
                   ("pipeline_parallel_degree", pp), ("context_parallel_degree", cp)):
        if v < 1:
            raise ValueError(f"{path}: parallelism.{key} = {v}: a degree is >= 1 (only "
                             f"data_parallel_shard_degree may be -1)")
    if s == -1 and world_size is not None:
        rest = r * tp * pp * cp
        if world_size % rest:
            raise ValueError(f"{path}: world size {world_size} is not a multiple of the other "
                             f"degrees' product {rest} (replicate {r} × cp {cp} × tp {tp} × pp "
                             f"{pp}), so data_parallel_shard_degree = -1 has no value")
        s = world_size // rest
    elif s < 1 and s != -1:
        raise ValueError(f"{path}: parallelism.data_parallel_shard_degree = {s}: give -1 or "
                         f">= 1")
    if s != -1:
        total = r * s * tp * pp * cp
        if world_size is not None and total != world_size:
            raise ValueError(f"{path}: the degrees lay out {total} ranks (replicate {r} × shard "
                             f"{s} × cp {cp} × tp {tp} × pp {pp}), not world size {world_size}")
        world_size = total
    parts = [f"pp:{pp}"] if pp > 1 else []
    if s == -1:
        if r > 1:
            raise ValueError(f"{path}: data_parallel_replicate_degree {r} with shard degree -1 "
                             f"needs the world size to size the shards: give world_size "
                             f"(--world-size)")
        parts.append("fsdp")
    elif r > 1 and s > 1:
        parts.append(f"hsdp:{s}")
    elif s > 1:
        parts.append(f"fsdp:{s}")
    elif r > 1:
        parts.append(f"ddp:{r}")
    if cp > 1:
        parts.append(f"cp:{cp}")
    if tp > 1:
        parts.append(f"tp:{tp}")
    if not parts:
        parts.append("fsdp:1")
    parallel = ",".join(parts)
    dp = r * s if s != -1 else None

    # batch: local_batch_size per data-parallel rank per step; pipeline microbatches of
    # pipeline_parallel_microbatch_size; the global batch over local × dp is accumulation
    schedule = get("parallelism.pipeline_parallel_schedule", "1F1B")
    mbs = int(get("parallelism.pipeline_parallel_microbatch_size", 1))
    if pp > 1:
        if local % mbs:
            raise ValueError(f"{path}: local batch {local} is not a multiple of "
                             f"pipeline_parallel_microbatch_size {mbs}")
        knobs["pp_schedule"] = schedule
        knobs["microbatches"] = local // mbs
        layers_per_stage = get("parallelism.pipeline_parallel_layers_per_stage")
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        from ..program.schedules import schedule_class

        single = issubclass(schedule_class(schedule), PipelineScheduleSingle)
        if layers_per_stage:
            n_layers = TORCHTITAN_LLAMA3.get(flavor, {}).get("n_layers")
            if n_layers:  # torchtitan counts the embedding and the head as a layer each
                stages = math.ceil((n_layers + 2) / layers_per_stage)
                knobs["stages_per_rank"] = max(1, stages // pp)
        else:
            knobs["stages_per_rank"] = 1 if single else 2
        per_rank = mbs
    else:
        for key in ("pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_layers_per_stage"):
            used.add(f"parallelism.{key}")  # no pipeline: no effect
        per_rank = local
    if global_batch == -1:
        global_batch_out = local * dp if dp is not None else None
        knobs["grad_accum"] = 1
    else:
        global_batch_out = global_batch
        if dp is not None:
            if global_batch % (local * dp):
                raise ValueError(f"{path}: global_batch_size {global_batch} is not a multiple "
                                 f"of local_batch_size {local} × data-parallel degree {dp}")
            knobs["grad_accum"] = global_batch // (local * dp)
        else:
            not_modelled.append(f"training.global_batch_size={global_batch}: its gradient "
                                f"accumulation steps need the world size (give world_size)")

    # activation checkpointing
    mode = get("activation_checkpoint.mode", "selective")
    option = str(get("activation_checkpoint.selective_ac_option", "2"))
    if mode == "selective":
        if option == "op":
            knobs["activation_checkpointing"] = "selective-op"
        elif option.isdigit() and int(option) >= 1:
            knobs["activation_checkpointing"] = ("full" if option == "1"
                                                 else f"selective-layer:{option}")
        else:
            raise ValueError(f"{path}: activation_checkpoint.selective_ac_option = {option!r}: "
                             f"give 'op' or a positive int")
    elif mode in ("full", "none"):
        knobs["activation_checkpointing"] = mode
    else:
        knobs["activation_checkpointing"] = "none"
        not_modelled.append(f"activation_checkpoint.mode={mode}: not modelled (full, "
                            f"selective and none are); run without activation checkpointing")
    for key in ("memory_budget", "visualize_memory_budget_pareto", "per_op_sac_force_recompute_mm_shapes_by_fqns"):
        if f"activation_checkpoint.{key}" in cfg:
            used.add(f"activation_checkpoint.{key}")
            if mode == "memory_budget":
                not_modelled.append(f"activation_checkpoint.{key}: the memory-budget policy is "
                                    f"not modelled")

    # precision, compile, float8, async TP, FSDP2 resharding
    knobs["param_dtype"] = _dtype(get("training.mixed_precision_param", "bfloat16"),
                                  "training.mixed_precision_param")
    knobs["reduce_dtype"] = _dtype(get("training.mixed_precision_reduce", "float32"),
                                   "training.mixed_precision_reduce")
    knobs["sequence_parallel"] = tp > 1
    knobs["compile"] = bool(get("compile.enable", get("training.compile", False)))
    converters = get("model.converters", [])
    converters = [converters] if isinstance(converters, str) else list(converters)
    knobs["float8"] = "float8" in converters
    for c in converters:
        if c != "float8":
            not_modelled.append(f"model.converters={c}: not modelled (float8 is a knob)")
    for key in list(cfg):
        if key.startswith(tuple(f"{s}." for s in _FLOAT8_SECTIONS)):
            used.add(key)
            if knobs["float8"] and cfg[key] not in (False, [], None):
                not_modelled.append(f"{key}={cfg[key]}: Float8 details are not modelled")
    knobs["async_tp"] = bool(get("parallelism.enable_async_tensor_parallel", False)) and tp > 1
    raf = get("parallelism.fsdp_reshard_after_forward", "default")
    if raf not in ("default", "always", "never"):
        raise ValueError(f"{path}: parallelism.fsdp_reshard_after_forward = {raf!r}: give "
                         f"default, always or never")
    knobs["reshard_after_forward"] = {"always": True, "never": False}.get(raf, pp == 1)
    if tp > 1 and not get("parallelism.disable_loss_parallel", False):
        not_modelled.append("parallelism.disable_loss_parallel=false (loss parallel, "
                            "torchtitan's default with TP): the output head's vocabulary "
                            "shards are all-gathered before the loss instead")
    if cp > 1:
        for key in ("context_parallel_load_balancer", "context_parallel_rotate_method"):
            if f"parallelism.{key}" in cfg:
                used.add(f"parallelism.{key}")
                not_modelled.append(f"parallelism.{key}={cfg[f'parallelism.{key}']}: how CP "
                                    f"balances and rotates is torch's default here")

    # what changes a step but is not modelled, when turned on
    flags = {
        "training.max_norm": "gradient-norm clipping (a norm and its all-reduce per step)",
        "training.enable_cpu_offload": "FSDP2 CPU offload",
        "checkpoint.enable": "saving checkpoints", "checkpoint.enable_checkpoint":
        "saving checkpoints", "validation.enable": "validation steps",
        "profiling.enable_profiling": "profiler overhead",
        "profiling.enable_memory_snapshot": "memory-snapshot overhead",
        "parallelism.expert_parallel_degree": "expert parallelism (llama3 has no experts)",
        "compile.enable_compiled_autograd": "compiled autograd",
    }
    for key, what in flags.items():
        if key in cfg:
            used.add(key)
            v = cfg[key]
            on = v > 1 if key == "parallelism.expert_parallel_degree" else \
                bool(v) if key == "training.max_norm" else v is True
            if on:
                not_modelled.append(f"{key}={v}: {what} is not modelled")
    optimizer = get("optimizer.name", "AdamW")
    if optimizer not in ("AdamW", "Adam"):
        not_modelled.append(f"optimizer.name={optimizer}: modelled as AdamW (the zoo's "
                            f"optimizer); its own state and step are not")
    no_effect = sorted(k for k in cfg if k not in used and (
        k in _NO_EFFECT or k.split(".")[0] in _NO_EFFECT))
    used.update(no_effect)
    unknown = sorted(k for k in cfg if k not in used)
    not_modelled += [f"{k}={cfg[k]}: unknown to simddp's torchtitan reader" for k in unknown]
    if no_effect:
        not_modelled.append("no effect on a step's time or memory: " + ", ".join(no_effect))

    model = resolve_model(model_spec, seq_len=seq_len, local_batch=per_rank)
    return Job(model=model, model_name=model.name, seq_len=seq_len, local_batch=per_rank,
               global_batch=global_batch_out, parallel=parallel, world_size=world_size,
               knobs=knobs, not_modelled=tuple(not_modelled), source=f"torchtitan {path}",
               model_spec=model_spec)
