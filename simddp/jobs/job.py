"""A training job as the user configured it: :class:`Job`, what the CLI runs for
``simddp whatif --torchtitan FILE`` or ``--megatron ARGS`` (and what the readers return)."""

from __future__ import annotations

import inspect
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Job", "KNOBS", "AC_MODES", "check_ac_mode"]

# the knobs a Job may carry (Job.knobs keys) and what each means
KNOBS: dict[str, str] = {
    "pp_schedule": "pipeline schedule, torch's name (1F1B, Interleaved1F1B, ...)",
    "microbatches": "pipeline microbatches per step and data-parallel replica",
    "stages_per_rank": "virtual pipeline stages per rank (multi-stage schedules)",
    "activation_checkpointing": "full, selective-op, selective-layer:N or none",
    "param_dtype": "mixed precision: the dtype parameters are computed in (bf16, fp16, fp32)",
    "reduce_dtype": "mixed precision: the dtype gradients are reduced in",
    "sequence_parallel": "with tensor parallelism: norms and activations on sequence shards",
    "compile": "torch.compile",
    "float8": "Float8 matmuls (torchao / Transformer Engine)",
    "async_tp": "async tensor parallelism (collectives fused with matmuls)",
    "reshard_after_forward": "FSDP2: free gathered parameters after forward",
    "grad_accum": "gradient accumulation: microsteps per optimizer step (global batch over "
                  "what the layout runs at once)",
}
# what the capture does when a knob is not passed
_DEFAULTS: dict[str, Any] = {"sequence_parallel": True, "compile": False, "float8": False,
                             "async_tp": False, "grad_accum": 1}
AC_MODES = ("full", "selective-op", "selective-layer:N", "none")


def check_ac_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`AC_MODES` (``selective-layer:N`` with N ≥ 1)."""
    if mode in ("full", "selective-op", "none"):
        return mode
    head, _, n = mode.partition(":")
    if head == "selective-layer" and n.isdigit() and int(n) >= 1:
        return mode
    raise ValueError(f"activation checkpointing {mode!r}: give one of {', '.join(AC_MODES)}")


@dataclass(frozen=True)
class Job:
    """One training job: the model (a resolved :class:`~simddp.jobs.models.ModelScenario`),
    its batch, its layout and its knobs, and what of the source simddp does not model.

    ``seq_len``: tokens per sequence; ``local_batch``: sequences per rank per microbatch;
    ``global_batch``: sequences per optimizer step over the whole job (None: unknown until
    the world size is); ``parallel``: a ``--parallel`` spec in simddp's grammar (torchtitan's
    -1 degrees resolved with ``world_size``; left unsized when it is None); ``knobs``: see
    :data:`KNOBS`; ``not_modelled``: one line per thing the source asks for that simddp does
    not model (the key and why); ``source``: where the job came from; ``model_spec``: the model
    as ``simddp whatif`` takes it (:func:`~simddp.jobs.models.resolve_model`'s text)."""

    model: Any
    model_name: str
    seq_len: int
    local_batch: int
    global_batch: int | None
    parallel: str
    world_size: int | None
    knobs: Mapping[str, Any] = field(default_factory=dict)
    not_modelled: tuple[str, ...] = ()
    source: str = ""
    model_spec: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.knobs) - set(KNOBS))
        if unknown:
            raise ValueError(f"Job: unknown knob(s) {', '.join(unknown)}; known: "
                             f"{', '.join(KNOBS)}")
        ac = self.knobs.get("activation_checkpointing")
        if ac is not None:
            check_ac_mode(ac)

    def whatif_args(self) -> str:
        """The ``simddp whatif`` command line that asks for this job."""
        k = self.knobs
        words = ["simddp", "whatif", self.model_spec or self.model_name,
                 "--parallel", self.parallel]
        if self.world_size is not None:
            words += ["--world-size", str(self.world_size)]
        words += ["--seq-len", str(self.seq_len), "--local-batch", str(self.local_batch)]
        if self.global_batch is not None:
            words += ["--global-batch", str(self.global_batch)]
        for key, flag in (("pp_schedule", "--pp-schedule"), ("microbatches", "--microbatches"),
                          ("stages_per_rank", "--stages-per-rank"),
                          ("activation_checkpointing", "--activation-checkpointing"),
                          ("param_dtype", "--param-dtype"), ("reduce_dtype", "--reduce-dtype")):
            if k.get(key) is not None:
                words += [flag, str(k[key])]
        if k.get("reshard_after_forward") is False:
            words += ["--reshard-after-forward", "false"]
        if k.get("sequence_parallel") is False and "tp:" in self.parallel:
            words.append("--no-sequence-parallel")
        for key, flag in (("compile", "--compile"), ("float8", "--float8"),
                          ("async_tp", "--async-tp")):
            if k.get(key):
                words.append(flag)
        return " ".join(shlex.quote(w) for w in words)

    def describe(self) -> str:
        """The job, one field a line, and what is not modelled."""
        lines = [f"job from {self.source}",
                 f"  model: {self.model_name} ({getattr(self.model, 'source', '')})",
                 f"  seq_len {self.seq_len}, local batch {self.local_batch}, global batch "
                 f"{self.global_batch if self.global_batch is not None else '?'}",
                 f"  parallel {self.parallel}"
                 + (f" on {self.world_size} ranks" if self.world_size else ""),
                 "  knobs: " + ", ".join(f"{k}={v}" for k, v in self.knobs.items())]
        lines += [f"  not modelled: {line}" for line in self.not_modelled]
        return "\n".join(lines)

    def whatif_kwargs(self, whatif: Callable[..., Any]) -> tuple[dict[str, Any], list[str]]:
        """Keyword arguments for ``whatif`` (:func:`simddp.whatif.whatif`) that ask for this
        job, and one line per knob that this ``whatif`` does not take (not modelled here):
        only the parameters it has are passed, so a knob it learns is passed once it does."""
        params = inspect.signature(whatif).parameters
        k = dict(self.knobs)
        pp = "pp:" in self.parallel
        kw: dict[str, Any] = {"parallel": [self.parallel],
                              "batch_size": self.local_batch * (k.get("microbatches") or 1)
                              if pp else self.local_batch}
        if self.world_size is not None:
            kw["world_size"] = [self.world_size]
        missing: list[str] = []
        if pp:
            kw["pp_schedule"] = [k.pop("pp_schedule", None) or "1F1B"]
            if k.get("microbatches") is not None:
                kw["microbatches"] = [k.pop("microbatches")]
            kw["stages_per_rank"] = k.pop("stages_per_rank", None)
        else:
            for key in ("pp_schedule", "microbatches", "stages_per_rank"):
                k.pop(key, None)  # no pipeline: nothing to schedule
        ac = k.pop("activation_checkpointing", None)
        if ac is not None:  # whatif takes torchtitan's policies by name
            kw["activation_checkpointing"] = ac
        names = {part.partition(":")[0].strip() for part in self.parallel.split(",")}
        raf = k.pop("reshard_after_forward", None)
        ddp = "ddp" in names
        if raf is not None and not ddp:  # an FSDP2 knob: DDP has none
            kw["reshard_after_forward"] = [raf]
        for key in ("param_dtype", "reduce_dtype"):
            v = k.pop(key, None)
            if v is None:
                continue
            if not ddp:
                kw[key] = v
            elif v != "fp32":
                missing.append(f"{key}={v} with DDP: torch autocasts the forward (torchtitan) "
                               f"or keeps bf16 parameters (Megatron); the DDP capture here "
                               f"runs the parameters' own dtype")
        if "tp:" not in self.parallel:
            k.pop("sequence_parallel", None)
        for key, v in k.items():
            if key in params:
                kw[key] = v
            elif v is not None and v != _DEFAULTS.get(key):
                missing.append(f"{key}={v}: `simddp whatif` here takes no {key} (not modelled "
                               f"yet); the step runs without it")
        return kw, missing
