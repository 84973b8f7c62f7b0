"""``simddp plan``: search the layouts of a model on N GPUs for the fastest that fits.

Three stages, cheapest first (:func:`plan`):

1. **rules** (:func:`~simddp.plan.space.rule_out`): TP within a node and dividing the heads,
   enough microbatches for the pipeline, torch's own schedule classes accepting the shape;
   then parameters, gradients and optimizer state alone against the card (no capture);
2. **memory**: one capture of the real program per :class:`~simddp.plan.evaluate.CaptureKey`
   (layouts that differ only in data-parallel size or microbatch count share it), and its
   step program's peak memory for each layout (the planner only, no simulation);
3. **replay** of the layouts that fit, on a local process pool or a Dask cluster's executor.

Ranked by the objective: tokens/s per GPU (``tokens-per-s``), GPU-seconds per token
(``cost``: layouts may use fewer of the GPUs), or the time to train ``T`` tokens
(``time-to-tokens``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .evaluate import CaptureKey, Capturer, capture_key, evaluate_row, memory_verdict, \
    replay_config
from .space import Layout, Shape, layouts, rule_out, schedule_refuses, static_bytes

__all__ = ["Candidate", "plan", "OBJECTIVES"]

GIB = 1 << 30
OBJECTIVES = ("tokens-per-s", "cost", "time-to-tokens")


@dataclass
class Candidate:
    """One layout and what the search found: ``feasible`` (None: not evaluated), ``reason``
    (why it was dropped, or "" when it runs), the figures of its replay."""

    layout: Layout
    feasible: bool | None = None
    reason: str = ""
    stage: str = ""  # "rules", "memory" or "replay": where the verdict came from
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    peak_memory_bytes: int | None = None
    exposed_comm_by_dim: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float | None = None

    @property
    def parallel(self) -> str:
        return self.layout.parallel

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"parallel": lay.parallel, "gpus": lay.gpus, "pp_schedule": lay.schedule,
                "stages_per_rank": lay.stages_per_rank, "microbatch": lay.microbatch,
                "microbatches": lay.microbatches, "activation_checkpointing": lay.ac,
                "reshard_after_forward": lay.reshard_after_forward,
                "feasible": self.feasible, "reason": self.reason, "stage": self.stage,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "step_time_s": self.step_time_s, "peak_memory_bytes": self.peak_memory_bytes,
                "exposed_comm_by_dim": self.exposed_comm_by_dim,
                "bubble_fraction": self.bubble_fraction}


def _score(c: Candidate, objective: str) -> float:
    """Higher is better."""
    if objective == "cost":  # tokens per GPU-second
        return c.tokens_per_s_per_gpu or 0.0
    return (c.tokens_per_s_per_gpu or 0.0) * c.layout.gpus  # tokens/s of the job


def plan(shape: Shape, scenario: Callable[..., Any], *, gpus: int, gpus_per_node: int,
         seq_len: int, global_batch: int, timing: Any, network: Any, memory_bytes: int,
         peak_flops: float, objective: str = "tokens-per-s", top: int = 5,
         executor: concurrent.futures.Executor | None = None,
         status: Callable[[str], None] | None = None, capture: Any = None,
         **space: Any) -> tuple[list[Candidate], list[Candidate], dict[str, Any]]:
    """Every layout of ``shape`` on ``gpus`` GPUs (fewer, down to a quarter, with
    ``objective="cost"``), evaluated or pruned (see the module docstring): (all candidates,
    the ``top`` feasible ones best first, facts about the search). ``scenario(batch_size=,
    n_layers=None)`` builds the workload; ``timing`` carries the compute model the captures
    use; ``peak_flops`` the GPU's dense bf16 FLOP/s (for MFU); ``space``: options of
    :func:`~simddp.plan.space.layouts`."""
    import time

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    say = status or (lambda text: None)
    t0 = time.perf_counter()
    counts = [gpus] + ([gpus // 2, gpus // 4] if objective == "cost" else [])
    cands = [Candidate(lay) for n in counts if n >= 1
             for lay in layouts(shape, n, gpus_per_node=gpus_per_node, seq_len=seq_len,
                                global_batch=global_batch, **space)]
    limit = memory_bytes
    gpu_memory_gb = memory_bytes / 1e9  # the replay knob counts GB
    for c in cands:  # 1. rules, and what the parameters alone need
        why = rule_out(c.layout, shape, gpus_per_node=gpus_per_node, seq_len=seq_len)
        if why is None:
            need = static_bytes(c.layout, shape)
            if need > limit:
                why = (f"OOM by {(need - limit) / GIB:.1f} GiB before activations: "
                       f"parameters, gradients and Adam state need {need / GIB:.1f} GiB of "
                       f"{limit / GIB:.1f}")
        if why is None:
            why = schedule_refuses(c.layout)
        if why is not None:
            c.feasible, c.reason, c.stage = False, why, "rules"
    alive = [c for c in cands if c.feasible is None]
    say(f"{len(cands)} layouts, {len(alive)} pass the rules; capturing")
    capturer = Capturer(scenario, timing, shape, capture)
    keys = sorted({capture_key(shape, c.layout) for c in alive}, key=repr)
    capturer.run(keys, executor, say)  # 2. captures, then each layout's memory
    to_replay = []
    for c in alive:
        cap = capturer.cache[capture_key(shape, c.layout)]
        if isinstance(cap, Exception):
            c.feasible, c.reason, c.stage = False, f"not captured: {' '.join(str(cap).split())}", \
                "memory"
            continue
        try:
            deep, config = replay_config(shape, c.layout, cap, network, gpu_memory_gb)
            peak, _ = memory_verdict(deep, config)
        except ValueError as e:
            c.feasible, c.reason, c.stage = False, f"refused by the planner: {e}", "memory"
            continue
        c.peak_memory_bytes = peak
        if peak > limit:
            c.feasible, c.reason, c.stage = False, (
                f"OOM by {(peak - limit) / GIB:.1f} GiB: the step's peak is "
                f"{peak / GIB:.1f} GiB of {limit / GIB:.1f}"), "memory"
        else:
            to_replay.append(c)
    say(f"{len(to_replay)} layouts fit; replaying")
    rows = _replay_all(shape, to_replay, capturer, network, gpu_memory_gb, executor)
    flops_per_token = 6 * shape.params + 12 * shape.n_layers * shape.dim * seq_len
    for c, row in zip(to_replay, rows):  # 3. the replays' figures
        lay = c.layout
        accumulation = lay.microbatches if lay.pp == 1 else 1  # replay runs one microbatch
        step = row["iteration_time_s"] * accumulation
        tokens = lay.sequences_per_step * seq_len
        c.step_time_s = step
        c.tokens_per_s_per_gpu = tokens / step / lay.gpus
        c.mfu = c.tokens_per_s_per_gpu * flops_per_token / peak_flops
        c.peak_memory_bytes = int(row["peak_memory_bytes"])
        c.exposed_comm_by_dim = {k: v * accumulation for k, v in
                                 (row.get("exposed_comm_by_dim") or {}).items()}
        c.bubble_fraction = row.get("bubble_fraction")
        c.feasible, c.stage = not row.get("oom"), "replay"
        if row.get("oom"):
            c.reason = "OOM in the replay"
    ranked = sorted((c for c in cands if c.feasible), key=lambda c: -_score(c, objective))
    captured = sum(not isinstance(capturer.cache[k], Exception) for k in keys)
    facts = {"layouts": len(cands), "passed_rules": len(alive), "captures": captured,
             "replayed": len(to_replay), "feasible": len(ranked),
             "capture_seconds": sum(capturer.seconds.values()),
             "wall_seconds": time.perf_counter() - t0}
    return cands, ranked[:top], facts


def _replay_all(shape: Shape, cands: list[Candidate], capturer: Capturer, network: Any,
                gpu_memory_gb: float, executor: concurrent.futures.Executor | None
                ) -> list[dict[str, Any]]:
    jobs = [(shape, c.layout, capturer.cache[capture_key(shape, c.layout)], network,
             gpu_memory_gb) for c in cands]
    if executor is None:
        return [evaluate_row(*j) for j in jobs]
    futures = [executor.submit(evaluate_row, *j) for j in jobs]
    try:
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
