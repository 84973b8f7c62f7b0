"""The step program: one training step per rank, written by planners, run by every engine.

* :mod:`~simddp.program.steps` — the instructions (compute, segments with marks, collectives,
  waits, memory) and :class:`StepProgram`, what every planner returns;
* :mod:`~simddp.program.mesh` — the communicators a program's collectives run on;
* :mod:`~simddp.program.knobs` — :class:`Knobs`, every what-if choice in one frozen object;
* :mod:`~simddp.program.parallel` — :class:`Parallel`, a world's layout (``--parallel``);
* :mod:`~simddp.program.captured` — what a capture of the real program holds;
* planners, one per parallelism: :mod:`~simddp.program.ddp`, :mod:`~simddp.program.fsdp`,
  :mod:`~simddp.program.pipeline` (with :mod:`~simddp.program.schedules`, torch's schedules).

:func:`plan` picks the planner by the capture's type.
"""

from __future__ import annotations

from typing import Any, Callable

from .captured import CapturedIteration, CapturedPipeline, CapturedStep
from .context import CapturedCP, CPProgram, plan_cp
from .ddp import DDPProgram, plan_ddp
from .fsdp import FSDPProgram, plan_fsdp
from .knobs import COMM_HOOKS, CheckedKnobs, Config, Knobs
from .mesh import DDPMesh, DeviceMesh, Mesh
from .parallel import PARALLEL_MODES, Parallel
from .pipeline import PipelineProgram, plan_pipeline, uniform_pipeline
from .steps import (MEMORY_CATEGORIES, Collective, Compute, Instruction, Issue, Mark, Memory,
                    Segment, StepProgram, Wait, WaitAll, peak_memory)

__all__ = ["plan", "PLANNERS", "Knobs", "CheckedKnobs", "Config", "COMM_HOOKS", "StepProgram",
           "Collective", "Compute", "Segment", "Mark", "Issue", "Wait", "WaitAll", "Memory",
           "Instruction", "MEMORY_CATEGORIES", "peak_memory", "Mesh", "DDPMesh", "DeviceMesh",
           "DDPProgram", "plan_ddp", "FSDPProgram", "plan_fsdp", "CapturedStep", "Parallel", "PARALLEL_MODES",
           "CapturedPipeline", "PipelineProgram", "plan_pipeline", "uniform_pipeline",
           "CapturedCP", "CPProgram", "plan_cp"]

# capture type -> its planner; a new parallelism registers its own here
PLANNERS: dict[type, Callable[[Any, CheckedKnobs], Any]] = {CapturedIteration: plan_ddp,
                                                             CapturedStep: plan_fsdp,
                                                             CapturedPipeline: plan_pipeline,
                                                             CapturedCP: plan_cp}


def plan(captured: Any, checked: CheckedKnobs) -> Any:
    """The step program of ``captured`` for ``checked``'s world and knobs."""
    pipeline = checked.knobs.pipeline_knobs
    if pipeline and not isinstance(captured, CapturedPipeline):
        raise ValueError(f"{', '.join(pipeline)}: pipeline knobs apply to a pipeline capture "
                         f"(CapturedPipeline), not to a {type(captured).__name__}")
    for kind, planner in PLANNERS.items():
        if isinstance(captured, kind):
            return planner(captured, checked)
    raise TypeError(f"no planner for {type(captured).__name__}: the captures replay knows are "
                    f"{', '.join(t.__name__ for t in PLANNERS)}")
