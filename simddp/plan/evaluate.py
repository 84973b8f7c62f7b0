"""One layout's answer: a capture of the real program (shared by every layout it stands for),
its step program's memory (cheap: no simulation), then a replay (only for layouts that fit).

Layouts share a capture when what the capture records is the same for them: the blocks' tensor
and context parallelism, activation checkpointing, the microbatch size, FSDP2's flavour and
``reshard_after_forward``, and for pipelines the stage count — it fixes the blocks each stage
holds (torchtitan's split), and a stage's actions (its forward, backward, the FSDP2 and TP
collectives inside them) are the same whichever schedule runs them and however the stages sit
on ranks: 1F1B on 8 ranks and Interleaved1F1B on 4 ranks × 2 replay one capture, each
placed by :func:`~simddp.cosim.deepen.deepen` and run by its own schedule's actions (the
pipeline planner replays torch's action lists). The data-parallel size, HSDP's shard size, the
microbatch count, the schedule and the world are replay knobs.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..models import NetworkModel
from ..program import Config, Knobs, plan as plan_program
from ..sweep import replay_row
from .space import Layout, Shape

__all__ = ["CaptureKey", "capture_key", "evaluate_key", "default_capture", "memory_verdict",
           "step_program",
           "replay_config", "pipeline_capture_form", "compute_seconds", "block_activation_bytes"]

GIB = 1 << 30


@dataclass(frozen=True)
class CaptureKey:
    """What a capture depends on (see the module docstring): ``stages`` is the pipeline's
    stage count (pp × virtual stages; 1 without a pipeline), which fixes the blocks each stage
    holds (torchtitan's split), whatever the schedule and however the stages sit on ranks."""

    tp: int
    cp: int
    ac: str
    microbatch: int
    hsdp: bool
    reshard_after_forward: bool
    stages: int = 1

    def describe(self) -> str:
        parts = ["HSDP" if self.hsdp else "FSDP"] + \
            ([f"tp {self.tp}"] if self.tp > 1 else []) + \
            ([f"cp {self.cp}"] if self.cp > 1 else []) + \
            [f"AC {self.ac}", f"{self.microbatch} seq/microbatch"]
        if not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.stages > 1:
            parts.append(f"{self.stages} pipeline stages")
        return ", ".join(parts)


def capture_key(shape: Shape, layout: Layout) -> CaptureKey:
    """The capture ``layout`` is replayed from: layouts that differ only in the data-parallel
    size, HSDP's shard size, the microbatch count, the schedule or how many stages a rank runs
    (for the same stage count) share it."""
    return CaptureKey(layout.tp, layout.cp, layout.ac, layout.microbatch,
                      layout.flavour == "hsdp", layout.reshard_after_forward,
                      layout.pp * layout.stages_per_rank if layout.pp > 1 else 1)


# How a pipeline of S stages is captured: with torch's Interleaved1F1B, two stages a rank on
# S / 2 pipeline ranks (a multi-stage schedule records FSDP2's UNSHARD, RESHARD and REDUCE_GRAD
# actions, which the pipeline planner replays under any schedule), through the registry's
# capture (the shallowest pipeline whose stages hold each block count the S-stage split has,
# deepened); two stages have no such form and run 1F1B on 2 ranks. The microbatches: the
# first, middle ones and the last (what a replay reads).
PIPELINE_CAPTURE_SCHEDULE = "Interleaved1F1B"
PIPELINE_CAPTURE_MICROBATCHES = 4


def pipeline_capture_form(stages: int) -> tuple[str, int, int]:
    """(schedule, pp, stages per rank) a pipeline of ``stages`` stages is captured with."""
    if stages == 2:
        return "1F1B", 2, 1
    if stages % 2:
        raise ValueError(f"a pipeline of {stages} stages: plan searches pp and virtual stages "
                         f"in powers of two")
    return PIPELINE_CAPTURE_SCHEDULE, stages // 2, 2


def evaluate_key(key: CaptureKey, layouts: list[Layout], scenario: Callable[..., Any],
                 timing: Any, shape: Shape, network: NetworkModel, memory_bytes: int,
                 capture: Callable[..., Any] | None = None) -> dict[str, Any]:
    """One capture and every layout it stands for (module-level, one job: an executor's
    worker captures and replays without sending the capture back and forth): ``{"seconds":
    the capture's, "captured": whether the registry captured it, "results": per layout
    (stage, reason, figures)}`` — ``("memory", reason, peak)`` for a layout the capture or the
    planner refuses or whose step program's peak exceeds ``memory_bytes``, ``("replay", "",
    row)`` for one that fits (its replay row); ``"job_seconds"`` the whole job's, and
    ``"cpu_seconds"`` / ``"job_cpu_seconds"`` the capture's and the job's CPU seconds."""
    import time

    t, cpu = time.perf_counter(), time.process_time()
    gb = memory_bytes / 1e9  # the replay knob counts GB
    out: list[tuple[str, str, Any]] = []
    with _no_cyclic_gc():
        cap = _capture_or_refusal(capture or default_capture, key, scenario, timing, shape)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
        for lay in layouts:
            out.append(_verdict_or_replay(shape, lay, cap, network, gb, memory_bytes))
    return {"seconds": seconds, "captured": not isinstance(cap, Exception), "results": out,
            "job_seconds": time.perf_counter() - t,
            # this process's CPU (a worker runs one job at a time): what a loaded machine's
            # other jobs do not inflate, as they do the wall times above
            "cpu_seconds": cpu_seconds, "job_cpu_seconds": time.process_time() - cpu,
            "compute_s": compute_seconds(cap),
            "block_activation_bytes": block_activation_bytes(cap, shape.n_layers)}


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic collector off, then one collection: a pipeline's step program is
    millions of instruction objects (a 16-stage pipeline of 512 microbatches: 2 x 10^6 marks),
    which every full collection while the program is built and replayed walks again (a
    16-stage job took 49 CPU s with it, 28 without, the same peak RSS: planning and
    replaying leave no cycles to speak of; a 2-stage 70B capture 11.3 CPU s with it, 10.2
    without, its peak RSS 419 and 439 MiB)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


def _verdict_or_replay(shape: Shape, lay: Layout, cap: Any, network: NetworkModel, gb: float,
                       memory_bytes: int) -> tuple[str, str, Any]:
    """One layout's answer in :func:`evaluate_key`."""
    if isinstance(cap, Exception):
        return ("memory", f"not captured: {' '.join(str(cap).split())}", None)
    try:
        deep, config = replay_config(shape, lay, cap, network, gb)
        program = step_program(deep, config)  # built once: its verdict and its replay
        peak, _ = program.memory()
    except ValueError as e:  # torch's schedule class or the planner refuses the layout
        why = " ".join(str(e).split())
        return ("rules" if why.startswith("torch's") else "memory",
                why if why.startswith("torch's") else f"refused by the planner: {why}", None)
    if peak > memory_bytes:
        return ("memory", f"OOM by {(peak - memory_bytes) / GIB:.1f} GiB: the step's peak is "
                f"{peak / GIB:.1f} GiB of {memory_bytes / GIB:.1f}", peak)
    return ("replay", "", replay_row(deep, config, program=program))


def compute_seconds(cap: Any) -> float | None:
    """A plain FSDP2 capture's forward and backward compute on its quickest rank (waits
    excluded): one microbatch of the whole model at its TP degree (None: not such a capture)."""
    from ..program.captured import CapturedStep

    if not isinstance(cap, CapturedStep) or not cap.profiles:
        return None
    return min(float(p["forward"]["seconds"]) + float(p["backward"]["seconds"])
               for p in cap.profiles)


def block_activation_bytes(cap: Any, n_layers: int) -> int | None:
    """What one block of a plain FSDP2 capture saved for backward in a microbatch's forward
    (one TP rank's share), read off the capture's saved storages: the model's ``n_layers``
    identical blocks save the same run of storages, so the list holds a stretch of at least
    ``n_layers - 2`` repeats of one period (the first block's may sit apart, among what the
    embedding saves; the longest period that repeats so is a block's); one period is one
    block. None where no such stretch is
    there (fewer than 8 blocks: too few to tell them from what the embedding, head and loss
    save)."""
    from ..program.captured import CapturedStep

    sizes = list(getattr(cap, "activation_sizes", None) or []) \
        if isinstance(cap, CapturedStep) else []
    if n_layers < 8 or len(sizes) < n_layers:
        return None
    reps = n_layers - 2
    for period in range(len(sizes) // n_layers, 0, -1):  # the longest first: a block's own
        found = [sum(sizes[o:o + period]) for o in range(len(sizes) - reps * period + 1)
                 if sizes[o:o + (reps - 1) * period] == sizes[o + period:o + reps * period]]
        if found:
            return min(found)
    return None


def capture_cost(shape: Shape, key: CaptureKey) -> int:
    """Blocks the capture runs (a rough cost, to start the longest captures first)."""
    if key.stages == 1:  # deeper models: a shallow capture, deepened
        from ..cosim.deepen import SHALLOW_STEP_BLOCKS

        return min(shape.n_layers, SHALLOW_STEP_BLOCKS) * key.microbatch
    if key.stages <= 4:
        return shape.n_layers
    return 4 * -(-shape.n_layers // key.stages)


def _capture_or_refusal(capture: Callable[..., Any], key: CaptureKey, *args: Any) -> Any:
    try:
        return capture(key, *args)
    except (NotImplementedError, ValueError) as e:  # the registry refuses the layout
        return e


def default_capture(key: CaptureKey, scenario: Callable[..., Any], timing: Any,
                    shape: Shape, shallow: bool = True) -> Any:
    """The registry's capture of the key's layout (torch's real FSDP2, TP and pipelining on
    the meta device, bf16 parameters and fp32 reductions as torchtitan trains), through the
    on-disk capture cache: FSDP2 on its smallest mesh (2 shards; 2 × 2 for HSDP) with TP
    inside, or a pipeline of ``key.stages`` stages as :func:`pipeline_capture_form` says
    (the registry's ``capture_pipeline`` captures its shallowest equivalent and deepens it).
    A plain step (no pipeline, no CP) of a model deeper than
    :data:`~simddp.cosim.deepen.SHALLOW_STEP_BLOCKS` blocks is captured on that many blocks
    and deepened (:func:`~simddp.cosim.deepen.deepen_step`; ``shallow=False``: the whole
    model)."""
    from ..capture_cache import cached, enabled_by_default
    from ..program.parallel import Parallel
    from ..program.registry import CaptureOptions, CaptureRequest

    from ..cosim.deepen import SHALLOW_STEP_BLOCKS

    data = "hsdp" if key.hsdp else "fsdp"
    layers = shape.n_layers
    if key.stages == 1:
        pp, schedule, v, m = 1, None, None, None
        # context parallelism's capture lists no saved storages to copy: captured whole
        if shallow and layers > SHALLOW_STEP_BLOCKS and key.cp == 1:
            layers = SHALLOW_STEP_BLOCKS
            sc = scenario(batch_size=key.microbatch, n_layers=layers)
        else:
            sc = scenario(batch_size=key.microbatch)
    else:
        schedule, pp, v = pipeline_capture_form(key.stages)
        m = PIPELINE_CAPTURE_MICROBATCHES if key.stages > 2 else 3
        sc = scenario(batch_size=m * key.microbatch)
    named = ("pp",) * (pp > 1) + (data,) + ("cp",) * (key.cp > 1) + ("tp",) * (key.tp > 1)
    par = Parallel(data, pp, 2 if key.hsdp else 1, 2, key.tp, key.cp, named=named)
    opts = CaptureOptions(reshard_after_forward=key.reshard_after_forward, param_dtype="bf16",
                          reduce_dtype="fp32", activation_checkpointing=key.ac,
                          pp_schedule=schedule, microbatches=m,
                          microbatch_size=key.microbatch if schedule else None,
                          stages_per_rank=v)
    req = CaptureRequest(sc, par, timing, "meta", 0, opts)
    cap, _ = cached(req, par.capture_key() + f"/layers{layers}",
                    lambda: par.owner().load("capture")(req), enabled=enabled_by_default())
    if layers != shape.n_layers:
        try:
            cap = _deepened_step(cap, sc, layers, shape.n_layers, key.tp)
        except ValueError:  # no block period to copy (a capture kind without saved storages)
            return default_capture(key, scenario, timing, shape, shallow=False)
    return cap


def _deepened_step(cap: Any, scenario: Any, captured: int, n_layers: int, tp: int) -> Any:
    """``cap`` (a plain step of ``scenario``'s ``captured`` blocks) deepened to ``n_layers``,
    its blocks' parameter bytes read off the model built on meta."""
    import torch

    from ..cosim.deepen import block_bytes, deepen_step

    with torch.device("meta"):
        model = scenario.build_model()
    blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m))
    return deepen_step(cap, n_layers, captured_layers=captured,
                       block=block_bytes(blocks[0], tp))


def _ranks(mesh: dict[str, int]) -> int:
    out = 1
    for v in mesh.values():
        out *= v
    return out


def replay_config(shape: Shape, layout: Layout, cap: Any, network: NetworkModel,
                  gpu_memory_gb: float | None) -> tuple[Any, Config]:
    """The capture as the layout replays it (a pipeline deepened to its depth) and the
    replay's :class:`~simddp.program.Config`."""
    knobs: dict[str, Any] = dict(parallel=layout.parallel, gpu_memory_gb=gpu_memory_gb)
    if layout.pp > 1:
        if (cap.pp, cap.stages_per_rank) != (layout.pp, layout.stages_per_rank):
            from ..cosim.deepen import deepen  # the same stages, placed as the layout runs them

            cap = deepen(cap, layout.pp, layout.stages_per_rank, n_layers=shape.n_layers,
                         input_weight=1, output_weight=1)  # torchtitan's split, as captured
        knobs.update(pp_schedule=layout.schedule, microbatches=layout.microbatches,
                     stages_per_rank=layout.stages_per_rank)
    return cap, Config(layout.gpus, network, Knobs.of(**knobs))


def step_program(cap: Any, config: Config) -> Any:
    """The step program of ``cap`` for ``config`` (its planner only: no simulation)."""
    return plan_program(cap, config.knobs.checked(config.world_size, config.network))


def memory_verdict(cap: Any, config: Config) -> tuple[int, dict[str, int]]:
    """The step program's peak memory for ``config`` (its planner only: no simulation)."""
    return step_program(cap, config).memory()
