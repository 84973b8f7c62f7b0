"""One layout's answer: a capture of the real program (shared by every layout it stands for),
its step program's memory (cheap: no simulation), then a replay (only for layouts that fit).

Layouts share a capture when what the capture records is the same for them: the blocks' tensor
and context parallelism, activation checkpointing, the microbatch size, FSDP2's flavour and
``reshard_after_forward``, and for pipelines the schedule and its stage split (the pipeline's
depth is added afterwards by :func:`~simddp.cosim.deepen.deepen`). The data-parallel size, the
microbatch count and the world are replay knobs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

from ..models import NetworkModel
from ..program import Config, Knobs, plan as plan_program
from ..sweep import replay_row
from .space import Layout, Shape

__all__ = ["CaptureKey", "capture_key", "Capturer", "memory_verdict", "replay_config"]

GIB = 1 << 30


@dataclass(frozen=True)
class CaptureKey:
    """What a capture depends on (see the module docstring)."""

    tp: int
    cp: int
    ac: str
    microbatch: int
    hsdp: bool
    reshard_after_forward: bool
    schedule: str | None = None
    stages_per_rank: int = 1
    # a deep pipeline: its first, middle and last stages' blocks (captured shallow, deepened);
    # a shallow one (at most 3 stages): its depth, captured whole
    stage_blocks: tuple[int, int, int] | None = None
    pp: int = 1

    def describe(self) -> str:
        parts = ["HSDP" if self.hsdp else "FSDP"] + \
            ([f"tp {self.tp}"] if self.tp > 1 else []) + \
            ([f"cp {self.cp}"] if self.cp > 1 else []) + \
            [f"AC {self.ac}", f"{self.microbatch} seq/microbatch"]
        if not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.schedule and self.stage_blocks:
            parts.append(f"{self.schedule} ×{self.stages_per_rank}, stages of "
                         f"{'/'.join(map(str, self.stage_blocks))} blocks")
        elif self.schedule:
            parts.append(f"{self.schedule} ×{self.stages_per_rank} on pp {self.pp}")
        return ", ".join(parts)


def _stage_blocks(shape: Shape, layout: Layout) -> tuple[int, int, int]:
    from fakepg.zoo.llama import stage_layers  # torchtitan's split: embedding, head weigh 1

    n = layout.pp * layout.stages_per_rank
    counts = [len(stage_layers(shape.n_layers, s, n, input_weight=1, output_weight=1))
              for s in range(n)]
    return counts[0], counts[1], counts[-1]


def capture_key(shape: Shape, layout: Layout) -> CaptureKey:
    """The capture ``layout`` is replayed from."""
    from .space import SAME_CAPTURE

    pipe = layout.pp > 1
    deep = pipe and layout.pp * layout.stages_per_rank > 3
    schedule = SAME_CAPTURE.get(layout.schedule, layout.schedule) if pipe else None
    return CaptureKey(layout.tp, layout.cp, layout.ac, layout.microbatch,
                      layout.flavour == "hsdp", layout.reshard_after_forward,
                      schedule, layout.stages_per_rank,
                      _stage_blocks(shape, layout) if deep else None,
                      1 if deep or not pipe else layout.pp)


class Capturer:
    """Captures by key, each once: ``scenario(microbatch=...)`` builds the workload;
    ``capture(key, scenario, timing)`` is the registry's capture for a key (see
    :func:`default_capture`)."""

    def __init__(self, scenario: Callable[..., Any], timing: Any, shape: Shape,
                 capture: Callable[..., Any] | None = None) -> None:
        self.scenario, self.timing, self.shape = scenario, timing, shape
        self.capture = capture or default_capture
        self.cache: dict[CaptureKey, Any] = {}
        self.seconds: dict[CaptureKey | None, float] = {}

    def run(self, keys: list[CaptureKey], executor: Any = None,
            say: Callable[[str], None] = lambda text: None) -> None:
        """Capture every key (here, or on ``executor`` — captures are pure functions of their
        key); a capture the registry refuses is kept as its exception."""
        import concurrent.futures
        import time

        todo = [k for k in keys if k not in self.cache]
        t0 = time.perf_counter()
        if executor is None:
            for i, key in enumerate(todo):
                say(f"capture {i + 1}/{len(todo)}: {key.describe()}")
                t = time.perf_counter()
                self.cache[key] = _capture_or_refusal(self.capture, key, self.scenario,
                                                      self.timing, self.shape)
                self.seconds[key] = time.perf_counter() - t
            return
        futures = {executor.submit(_capture_or_refusal, self.capture, key, self.scenario,
                                   self.timing, self.shape): key for key in todo}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            key = futures[fut]
            self.cache[key] = fut.result()
            say(f"capture {i}/{len(todo)} done: {key.describe()}")
        self.seconds[None] = time.perf_counter() - t0  # wall time of the parallel captures


def _capture_or_refusal(capture: Callable[..., Any], key: CaptureKey, *args: Any) -> Any:
    try:
        return capture(key, *args)
    except (NotImplementedError, ValueError) as e:  # the registry refuses the layout
        return e


def default_capture(key: CaptureKey, scenario: Callable[..., Any], timing: Any,
                    shape: Shape) -> Any:
    """The registry's capture of the key's layout (torch's real FSDP2, TP and pipelining on
    the meta device, bf16 parameters and fp32 reductions as torchtitan trains), through the
    on-disk capture cache; a deep pipeline is captured shallow (its first, a middle and its
    last stage) and deepened per layout (:func:`replay_config`)."""
    from ..capture_cache import cached, enabled_by_default
    from ..program.parallel import Parallel
    from ..program.registry import CaptureOptions, CaptureRequest

    data = "hsdp:2" if key.hsdp else "fsdp:2"
    spec = ",".join(([f"pp:{key.pp if key.stage_blocks is None else 3}"] if key.schedule else [])
                    + [data] + ([f"cp:{key.cp}"] if key.cp > 1 else [])
                    + ([f"tp:{key.tp}"] if key.tp > 1 else []))
    v = key.stages_per_rank
    if key.schedule is None:
        sc = scenario(batch_size=key.microbatch)
        cap_pp = 1
    elif key.stage_blocks is None:  # a shallow pipeline: captured whole
        cap_pp = key.pp
        sc = scenario(batch_size=cap_pp * key.microbatch)
    else:  # a first, a middle and a last stage, deepened later
        cap_pp = 3 if v == 1 else 2
        first, middle, last = key.stage_blocks
        sc = scenario(batch_size=cap_pp * key.microbatch,
                      n_layers=first + middle * (cap_pp * v - 2) + last)
        spec = spec.replace("pp:3", f"pp:{cap_pp}", 1)
    world = 2 if key.hsdp else 1  # hsdp:2 shards over 2 ranks, replicated twice
    for part in spec.split(","):
        world *= int(part.partition(":")[2])
    par = Parallel.parse(spec, world)
    opts = CaptureOptions(reshard_after_forward=key.reshard_after_forward, param_dtype="bf16",
                          reduce_dtype="fp32", activation_checkpointing=key.ac,
                          pp_schedule=key.schedule, microbatches=cap_pp if key.schedule else None,
                          microbatch_size=key.microbatch if key.schedule else None,
                          stages_per_rank=v if key.schedule else None)
    req = CaptureRequest(sc, par, timing, "meta", 0, opts)
    cap, _ = cached(req, par.capture_key() + f"/layers{shape.n_layers}",
                    lambda: par.owner().load("capture")(req), enabled=enabled_by_default())
    return cap


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
        from ..cosim.deepen import deepen

        if cap.pp != layout.pp:
            cap = deepen(cap, layout.pp, layout.stages_per_rank, n_layers=shape.n_layers,
                         input_weight=1, output_weight=1)  # torchtitan's split, as captured
        knobs.update(pp_schedule=layout.schedule, microbatches=layout.microbatches)
    return cap, Config(layout.gpus, network, Knobs.of(**knobs))


def memory_verdict(cap: Any, config: Config) -> tuple[int, dict[str, int]]:
    """The step program's peak memory for ``config`` (its planner only: no simulation)."""
    checked = config.knobs.checked(config.world_size, config.network)
    return plan_program(cap, checked).memory()


def evaluate_row(shape: Shape, layout: Layout, cap: Any, network: NetworkModel,
                 gpu_memory_gb: float | None) -> dict[str, Any]:
    """The replay row of ``layout`` (module-level: executors in other processes run it)."""
    cap, config = replay_config(shape, layout, cap, network, gpu_memory_gb)
    return replay_row(cap, config)
