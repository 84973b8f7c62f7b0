"""What ``simddp whatif`` does with a model or job config (``--torchtitan``, ``--megatron``,
``--seq-len``, ``--local-batch``, ``--global-batch``, a model that is not a zoo name): the
parsed arguments are filled from the :class:`~simddp.jobs.job.Job` (a flag the user gave wins)
and the workload resolved; what is not modelled is printed. The logic lives here so the CLI's
own edit stays a few lines."""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any, Callable, TextIO

from .job import Job

__all__ = ["apply_job", "job_from_args", "accumulation"]


def _one_world(args: argparse.Namespace) -> int | None:
    sizes = getattr(args, "world_size", None)
    return sizes[0] if sizes and len(sizes) == 1 else None


def job_from_args(args: argparse.Namespace) -> Job | None:
    """The job ``--torchtitan`` or ``--megatron`` names (None: neither was given)."""
    tt, mg = getattr(args, "torchtitan", None), getattr(args, "megatron", None)
    if tt and mg:
        raise ValueError("give --torchtitan or --megatron, not both")
    if (tt or mg) and getattr(args, "workload", None):
        raise ValueError(f"a job config names its model: drop the workload "
                         f"{args.workload!r}, or the job config")
    if tt:
        from .torchtitan import read_torchtitan
        return read_torchtitan(tt, _one_world(args))
    if mg:
        from .megatron import read_megatron
        return read_megatron(mg, _one_world(args))
    return None


def _is_script(text: str) -> bool:
    return text.endswith(".py")


def _wants_tp(args: argparse.Namespace) -> bool:
    return any("tp" in [p.partition(":")[0].strip() for p in spec.split(",")]
               for spec in (getattr(args, "parallel", None) or []))


def accumulation(global_batch: int, per_replica: int, parallel: str, world_size: int) -> int:
    """Microsteps per optimizer step: ``global_batch`` over the sequences the layout runs at
    once (``per_replica`` per data-parallel replica × the data-parallel size)."""
    from ..program.parallel import Parallel

    par = Parallel.parse(parallel, world_size)
    at_once = per_replica * par.replicate * par.shard
    if global_batch % at_once:
        raise ValueError(f"--global-batch {global_batch} is not a multiple of the "
                         f"{at_once} sequences the layout {parallel} runs at once on "
                         f"{world_size} ranks ({per_replica} per data-parallel replica)")
    return global_batch // at_once


def _zoo_key(text: str) -> str | None:
    from .models import zoo_key  # the zoo's names come with torch: asked only when needed

    return zoo_key(text)


def apply_job(args: argparse.Namespace, whatif: Callable[..., Any],
              err: TextIO | None = None) -> Any:
    """The workload for ``whatif``, ``args`` filled from the job config or the model options
    (in place); prints to ``err`` (stderr) the job and what it asks for that is not
    modelled. Without a job config or model options: ``args.workload`` unchanged."""
    err = err or sys.stderr
    job = job_from_args(args)
    seq_len, local = getattr(args, "seq_len", None), getattr(args, "local_batch", None)
    global_batch = getattr(args, "global_batch", None)
    if job is None:
        text = getattr(args, "workload", None)
        if not text:
            raise ValueError("give a workload (a zoo name, a Hugging Face config.json, a "
                             "torchtitan flavor such as llama3:8B, a shape such as "
                             "llama:dim=4096,layers=32,heads=32) or a job config "
                             "(--torchtitan FILE, --megatron ARGS)")
        if local is not None and getattr(args, "batch_size", None) is not None:
            raise ValueError("give --local-batch or --batch-size, not both")
        if _is_script(text):
            if seq_len is not None or local is not None:
                raise ValueError(f"--seq-len and --local-batch size a model; {text} is a "
                                 f"script: give its scenario() those parameters")
            workload: Any = text
        elif text.endswith(".json") and seq_len is None and local is None and \
                global_batch is None and not _wants_tp(args):
            # a config file as is: whatif resolves it, or finds its capture in the cache by
            # the file's content without building it (no transformers, no torch)
            workload = text
        elif _zoo_key(text) is not None and seq_len is None and local is None:
            workload = _zoo_key(text)  # the zoo's own path, either spelling
        else:
            from .models import resolve_model, tp_refusal

            model = resolve_model(text, seq_len=seq_len, local_batch=local)
            if _wants_tp(args) and tp_refusal(model):
                why = tp_refusal(model)
                try:
                    model = resolve_model(text, seq_len=seq_len, local_batch=local, build="zoo")
                except ValueError:
                    raise ValueError(f"--parallel with tp: {why}") from None
                print(f"simddp: {text}: tensor parallelism needs the zoo's module names, so "
                      f"it is built as the zoo's Llama of the same shape", file=err)
            workload = model
        if global_batch is not None:
            _note_accumulation(args, global_batch, local or getattr(workload, "local_batch", None)
                               or getattr(args, "batch_size", None) or 1, err, whatif)
        return workload

    if seq_len is not None or local is not None:
        model = job.model.with_(**{k: v for k, v in (("seq_len", seq_len),
                                                      ("local_batch", local)) if v is not None})
        job = Job(**{**job.__dict__, "model": model, "seq_len": model.seq_len,
                     "local_batch": model.local_batch})
    if global_batch is not None:
        job = Job(**{**job.__dict__, "global_batch": global_batch})
    from .models import tp_refusal

    if "tp:" in job.parallel and tp_refusal(job.model):
        raise ValueError(f"{job.source}: {tp_refusal(job.model)}")
    print(job.describe(), file=err)
    print(f"simddp: as a command line: {job.whatif_args()}", file=err)
    kw, missing = job.whatif_kwargs(whatif)
    for key, v in kw.items():
        if key == "world_size":
            if args.world_size is None:
                args.world_size = v
        elif key == "parallel":
            if not args.parallel:
                args.parallel = v
        elif key == "activation_checkpointing":
            if not args.activation_checkpointing:
                args.activation_checkpointing = v
        elif hasattr(args, key) and getattr(args, key) in (None, False, [None]):
            setattr(args, key, v)
        elif not hasattr(args, key):
            missing.append(f"{key}={v}: `simddp whatif` here has no flag for it")
    for line in missing:
        print(f"simddp: not modelled: {line}", file=err)
    accum = job.knobs.get("grad_accum")
    if global_batch is not None and args.world_size and len(args.world_size) == 1:
        pp = "pp:" in job.parallel
        per_replica = job.local_batch * ((job.knobs.get("microbatches") or 1) if pp else 1)
        accum = accumulation(global_batch, per_replica, args.parallel[0], args.world_size[0])
    if accum and accum > 1 and "grad_accum" not in inspect.signature(whatif).parameters:
        print(f"simddp: not modelled: gradient accumulation ({accum} microsteps per step): "
              f"the rows are one microstep and its optimizer step", file=err)
    return job.model


def _note_accumulation(args: argparse.Namespace, global_batch: int, per_replica: int,
                       err: TextIO, whatif: Callable[..., Any]) -> None:
    worlds = args.world_size or []
    for spec in args.parallel or ["ddp"]:
        at_once = per_replica
        if "pp:" in spec:  # a pipeline replica runs its microbatches in one step
            at_once *= (args.microbatches or [1])[0]
        for n in worlds:
            accum = accumulation(global_batch, at_once, spec, n)
            if accum > 1 and "grad_accum" not in inspect.signature(whatif).parameters:
                print(f"simddp: not modelled: --global-batch {global_batch} at {spec} on {n} "
                      f"ranks is {accum} microsteps per optimizer step (gradient "
                      f"accumulation); the rows are one microstep and its optimizer step",
                      file=err)
    if not worlds:
        print(f"simddp: --global-batch {global_batch}: its accumulation steps need "
              f"--world-size", file=err)
