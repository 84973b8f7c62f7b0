"""The step program: one training step per rank, written by planners, run by every engine.

* :mod:`~simddp.program.steps` — the instructions (compute, segments with marks, collectives,
  waits, memory) and :class:`StepProgram`, what every planner returns;
* :mod:`~simddp.program.mesh` — the communicators a program's collectives run on;
* :mod:`~simddp.program.knobs` — :class:`Knobs`, every what-if choice in one frozen object;
* :mod:`~simddp.program.registry` — the parallelism registry: each parallelism's spec name,
  mesh dimension, capture, captured type and planner, in one place;
* :mod:`~simddp.program.parallel` — :class:`Parallel`, a world's layout (``--parallel``),
  parsed once against the registry;
* :mod:`~simddp.program.captured` — what a capture of the real program holds;
* planners, one per parallelism: :mod:`~simddp.program.ddp`, :mod:`~simddp.program.fsdp`,
  :mod:`~simddp.program.pipeline` (with :mod:`~simddp.program.schedules`, torch's schedules).

:func:`plan` picks the planner the registry names for the capture's type. Names are imported
on first use, so ``simddp.program.parallel`` (the CLI's spec parser) loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .parallel import PARALLEL_MODES, Parallel
from .registry import REGISTRY, CaptureOptions, CaptureRequest, Parallelism, planner_for, register

__all__ = ["plan", "PLANNERS", "Knobs", "CheckedKnobs", "Config", "COMM_HOOKS", "StepProgram",
           "Collective", "Compute", "Segment", "Mark", "Issue", "Wait", "WaitAll", "Memory",
           "Instruction", "MEMORY_CATEGORIES", "peak_memory", "Mesh", "DDPMesh", "DeviceMesh",
           "DDPProgram", "plan_ddp", "FSDPProgram", "plan_fsdp", "CapturedStep", "Parallel",
           "PARALLEL_MODES", "CapturedIteration", "CapturedPipeline", "PipelineProgram",
           "plan_pipeline", "uniform_pipeline", "REGISTRY", "Parallelism", "register",
           "CaptureOptions", "CaptureRequest", "CapturedCP", "CPProgram", "plan_cp"]

# name -> the submodule that defines it (imported on first use)
_LAZY = {
    **dict.fromkeys(("CapturedIteration", "CapturedPipeline", "CapturedStep"), "captured"),
    **dict.fromkeys(("DDPProgram", "plan_ddp"), "ddp"),
    **dict.fromkeys(("FSDPProgram", "plan_fsdp"), "fsdp"),
    **dict.fromkeys(("COMM_HOOKS", "CheckedKnobs", "Config", "Knobs"), "knobs"),
    **dict.fromkeys(("DDPMesh", "DeviceMesh", "Mesh"), "mesh"),
    **dict.fromkeys(("PipelineProgram", "plan_pipeline", "uniform_pipeline"), "pipeline"),
    **dict.fromkeys(("CapturedCP", "CPProgram", "plan_cp"), "context"),
    **dict.fromkeys(("MEMORY_CATEGORIES", "Collective", "Compute", "Instruction", "Issue",
                     "Mark", "Memory", "Segment", "StepProgram", "Wait", "WaitAll",
                     "peak_memory"), "steps"),
}


def __getattr__(name: str) -> Any:
    if name == "PLANNERS":  # captured type -> planner, as the registry holds them
        return {p.load("captured"): p.load("planner") for p in REGISTRY.values()
                if p.captured and p.planner and not p.reserved}
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plan(captured: Any, checked: Any) -> Any:
    """The step program of ``captured`` for ``checked``'s world and knobs (a
    :class:`~simddp.program.knobs.CheckedKnobs`), by the planner the registry names for the
    capture's type."""
    from .captured import CapturedPipeline

    pipeline = checked.knobs.pipeline_knobs
    if pipeline and not isinstance(captured, CapturedPipeline):
        raise ValueError(f"{', '.join(pipeline)}: pipeline knobs apply to a pipeline capture "
                         f"(CapturedPipeline), not to a {type(captured).__name__}")
    return planner_for(captured)(captured, checked)
