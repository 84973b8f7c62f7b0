"""``simddp plan``: search the layouts of a model on N GPUs for the fastest that fits.

Three stages, cheapest first (:func:`plan`):

1. **rules** (:func:`~simddp.plan.space.rule_out`): TP within a node and dividing the heads,
   enough microbatches for the pipeline; then parameters, gradients and optimizer state alone
   against the card (no capture);
2. **memory**: one capture of the real program per :class:`~simddp.plan.evaluate.CaptureKey`
   (layouts that differ only in data-parallel size, microbatch count or pipeline schedule
   share it), and its step program's peak memory for each layout (the planner only, no
   simulation; torch's own schedule class refusing the pipeline's shape is a rule found here);
3. **replay** of the layouts that fit.

Stages 2 and 3 run as one job per capture (:func:`~simddp.plan.evaluate.evaluate_key`), here
or on a local process pool or a Dask cluster's executor.

Ranked by the objective: tokens/s per GPU (``tokens-per-s``), GPU-seconds per token
(``cost``: layouts may use fewer of the GPUs), or the time to train ``T`` tokens
(``time-to-tokens``).
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .evaluate import CaptureKey, capture_cost, capture_key, evaluate_key
from .space import Layout, Shape, layouts, rule_out, static_bytes

__all__ = ["Candidate", "plan", "OBJECTIVES"]

GIB = 1 << 30
ROUND = 6  # captures evaluated between two looks at the bound
OBJECTIVES = ("tokens-per-s", "cost", "time-to-tokens")


@dataclass
class Candidate:
    """One layout and what the search found: ``feasible`` (None: not evaluated), ``reason``
    (why it was dropped, or "" when it runs), the figures of its replay."""

    layout: Layout
    feasible: bool | None = None
    reason: str = ""
    # where the verdict came from: "rules", "bound" (the probes' compute bound or memory floor:
    # not evaluated), "memory" (the step program's peak, or a refusal) or "replay"
    stage: str = ""
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
    for c in cands:  # 1. rules, and what the parameters alone need
        why = rule_out(c.layout, shape, gpus_per_node=gpus_per_node, seq_len=seq_len)
        if why is None:
            need = static_bytes(c.layout, shape)
            if need > limit:
                why = (f"OOM by {(need - limit) / GIB:.1f} GiB before activations: "
                       f"parameters, gradients and Adam state need {need / GIB:.1f} GiB of "
                       f"{limit / GIB:.1f}")
        if why is not None:
            c.feasible, c.reason, c.stage = False, why, "rules"
    alive = [c for c in cands if c.feasible is None]
    say(f"{len(cands)} layouts, {len(alive)} pass the rules; capturing and replaying")
    by_key: dict[CaptureKey, list[Candidate]] = {}
    for c in alive:
        by_key.setdefault(capture_key(shape, c.layout), []).append(c)
    flops_per_token = 6 * shape.params + 12 * shape.n_layers * shape.dim * seq_len
    done: dict[CaptureKey, dict[str, Any]] = {}

    def evaluate(keys: list[CaptureKey]) -> None:  # 2. captures, memory verdicts, replays
        # the longest captures first (a pool's workers finish together); the results do not
        # depend on the order
        keys = sorted(keys, key=lambda k: (-capture_cost(shape, k), repr(k)))
        jobs = [(k, [c.layout for c in by_key[k]], scenario, timing, shape, network, limit,
                 capture) for k in keys]
        n0 = sum(bool(r.get("results")) or r["captured"] for r in done.values())
        for k, res in zip(keys, _run_jobs(jobs, executor, lambda i, k, res: say(
                f"capture {n0 + i} ({res['seconds']:.0f} s; with its {len(by_key[k])} "
                f"layouts {res['job_seconds']:.0f} s): {k.describe()}"))):
            done[k] = res
            for c, (stage, why, fig) in zip(by_key[k], res["results"]):
                c.stage = stage
                if stage == "replay":
                    _figures(c, fig, seq_len, flops_per_token, peak_flops)
                else:
                    c.feasible, c.reason, c.peak_memory_bytes = False, why, fig

    # 2a. the probes: each TP degree, AC policy and microbatch size's plain FSDP layout, whose
    # compute bounds every layout of that TP degree, policy and microbatch size (below); those
    # of one-sequence microbatches first: their blocks' saved activations give the memory
    # floor of every microbatch size (a block saves per sequence), which may spare the others
    probes = [k for k in by_key if k.stages == 1 and not k.hsdp and k.cp == 1]
    evaluate([k for k in probes if k.microbatch == 1])
    # a block's saved bytes for one sequence, per TP degree and policy
    per_block = {(k.tp, k.ac): done[k]["block_activation_bytes"] for k in probes
                 if k in done and k.microbatch == 1 and done[k].get("block_activation_bytes")}

    # a capture all of whose layouts need more than the card before anything but the
    # parameters, Adam state and the probe's blocks' activations is counted is skipped too
    oom = 0
    for k in [k for k in by_key if k not in done and k.cp == 1]:
        blk = per_block.get((k.tp, k.ac))
        floors = [memory_floor(c.layout, shape, blk) for c in by_key[k]] if blk else []
        if floors and min(floors) > limit:
            for c, need in zip(by_key[k], floors):
                c.feasible, c.stage, c.peak_memory_bytes = False, "bound", None
                c.reason = (f"OOM by at least {(need - limit) / GIB:.1f} GiB: parameters, Adam "
                            f"state and the first pipeline rank's activations alone "
                            f"({blk * k.microbatch / GIB:.2f} GiB a block a microbatch of "
                            f"{k.microbatch}, as captured for tp:{k.tp}, AC {k.ac}) need "
                            f"{need / GIB:.1f} GiB of {limit / GIB:.1f}")
            oom += len(by_key[k])
            done[k] = {"captured": False, "seconds": 0.0}
    probes = [k for k in probes if done.get(k, {}).get("captured", True)]
    evaluate([k for k in probes if k not in done])
    # 2b. the rest, best bound first, in rounds of ROUND captures: after each round, a
    # capture none of whose layouts' bound (the probe's compute alone: waits, communication
    # and bubble left out, a lower bound of the step) reaches the top ``top`` replayed so far
    # is skipped. Rounds are fixed sets, so the answer does not depend on the executor.
    compute = {(k.tp, k.ac, k.microbatch): done[k]["compute_s"] for k in probes
               if done[k].get("compute_s")}
    bounds: dict[CaptureKey, list[float] | None] = {}
    for k in by_key:
        c_mb = compute.get((k.tp, k.ac, k.microbatch)) if k.cp == 1 else None
        bounds[k] = None if c_mb is None else [_bound(c.layout, c_mb, seq_len)
                                                for c in by_key[k]]

    def best(k: CaptureKey) -> float:
        ubs = bounds[k]
        return math.inf if ubs is None else max(
            _score(Candidate(c.layout, tokens_per_s_per_gpu=ub), objective)
            for c, ub in zip(by_key[k], ubs))

    rest = sorted((k for k in by_key if k not in done),
                  key=lambda k: (-best(k), -capture_cost(shape, k), repr(k)))
    say(f"{len(probes)} probes replayed; {oom} layouts cannot fit (their memory floor); "
        f"{len(rest)} captures left, best bound first")
    bounded = oom
    while rest:
        scores = sorted((_score(c, objective) for c in cands if c.feasible), reverse=True)
        floor = scores[top - 1] if len(scores) >= top else 0.0
        for k in [k for k in rest if best(k) < floor]:
            rest.remove(k)
            for c, ub in zip(by_key[k], bounds[k] or ()):
                c.feasible, c.stage = False, "bound"
                c.reason = (f"cannot reach the top {top}: its compute alone (as captured for "
                            f"tp:{k.tp}, AC {k.ac}) allows at most {ub:,.0f} tokens/s per "
                            f"GPU, below the top {top} replayed before it")
            bounded += len(by_key[k])
        evaluate(rest[:ROUND])
        rest = rest[ROUND:]
    ranked = sorted((c for c in cands if c.feasible), key=lambda c: -_score(c, objective))
    facts = {"layouts": len(cands), "passed_rules": len(alive),
             "dropped_by_rules": sum(c.stage == "rules" for c in cands),
             "captures": sum(r["captured"] for r in done.values()),
             "replayed": sum(c.stage == "replay" for c in cands), "feasible": len(ranked),
             "evaluated": sum(c.stage in ("memory", "replay") for c in cands),
             "bounded": bounded, "probes": len(probes),
             "probe_compute_s": {f"tp:{tp},ac:{ac},microbatch:{mb}": v
                                 for (tp, ac, mb), v in sorted(compute.items())},
             "probe_block_activation_bytes": {f"tp:{tp},ac:{ac},microbatch:1": v
                                              for (tp, ac), v in sorted(per_block.items())},
             "capture_seconds": sum(r["seconds"] for r in done.values()),
             # where the time went: (captures, their seconds, jobs' seconds with the verdicts
             # and replays) of plain steps and of pipelines, as the workers' clocks count them
             "by_kind": {kind: (sum(r["captured"] for k, r in done.items() if pick(k)),
                                sum(r["seconds"] for k, r in done.items() if pick(k)),
                                sum(r.get("job_seconds", 0.0) for k, r in done.items()
                                    if pick(k)))
                         for kind, pick in KINDS},
             # the same in CPU seconds (the workers' own: not inflated by a loaded machine)
             "cpu_by_kind": {kind: (sum(r.get("cpu_seconds", 0.0) for k, r in done.items()
                                        if pick(k)),
                                    sum(r.get("job_cpu_seconds", 0.0) for k, r in done.items()
                                        if pick(k)))
                             for kind, pick in KINDS},
             "wall_seconds": time.perf_counter() - t0}
    return cands, ranked[:top], facts


KINDS = (("plain", lambda k: k.stages == 1), ("pipeline", lambda k: k.stages > 1))


def memory_floor(lay: Layout, shape: Shape, block_bytes: int) -> int:
    """Bytes ``lay`` needs at least on its first (pipeline) rank when a block saves
    ``block_bytes`` for backward a sequence (a one-sequence probe's, at the layout's TP degree
    and policy; a microbatch of ``lay.microbatch`` sequences saves that many times as much):
    its parameters (fp32) and Adam's two moments, sharded over its data-parallel
    ranks and TP; with a pipeline, its first stage's parameters unsharded (bf16, FSDP2 keeps
    them gathered: ``reshard_after_forward`` off) and that stage's activations for the
    microbatches it runs before its first backward (one per pipeline rank, at least, under
    each of the schedules searched); without one, every block's activations for one
    microbatch. What else a step holds (gradients, communication buffers, temporaries, the
    embedding's and head's activations) is left out: a floor, not an estimate."""
    from fakepg.zoo.llama import stage_layers  # torchtitan's split, as the captures

    sharding = lay.tp * lay.shard * lay.cp
    block_bytes *= lay.microbatch
    if lay.pp == 1:
        return 12 * shape.params // sharding + shape.n_layers * block_bytes
    n = lay.pp * lay.stages_per_rank
    counts = [len(stage_layers(shape.n_layers, s, n, input_weight=1, output_weight=1))
              for s in range(n)]
    first = counts[0] * shape.block_params + shape.embedding_params
    mine = first + sum(counts[s] for s in range(lay.pp, n, lay.pp)) * shape.block_params
    held = min(lay.pp, lay.microbatches) * counts[0] * block_bytes
    return 12 * mine // sharding + 2 * first // lay.tp + held


def _bound(lay: Layout, compute_s: float, seq_len: int) -> float:
    """The most tokens/s per GPU ``lay`` can reach when a microbatch's forward and backward
    take ``compute_s`` on one rank (the whole model at its TP degree): the busiest rank
    computes at least its share of every microbatch, nothing else counted."""
    step = compute_s * lay.microbatches / lay.pp
    return lay.sequences_per_step * seq_len / step / lay.gpus


def _figures(c: Candidate, row: dict[str, Any], seq_len: int, flops_per_token: float,
             peak_flops: float) -> None:
    """``c``'s figures from its replay row."""
    lay = c.layout
    accumulation = lay.microbatches if lay.pp == 1 else 1  # replay runs one microbatch
    step = row["iteration_time_s"] * accumulation
    c.step_time_s = step
    c.tokens_per_s_per_gpu = lay.sequences_per_step * seq_len / step / lay.gpus
    c.mfu = c.tokens_per_s_per_gpu * flops_per_token / peak_flops
    c.peak_memory_bytes = int(row["peak_memory_bytes"])
    c.exposed_comm_by_dim = {k: v * accumulation for k, v in
                             (row.get("exposed_comm_by_dim") or {}).items()}
    c.bubble_fraction = row.get("bubble_fraction")
    c.feasible, c.stage = not row.get("oom"), "replay"
    if row.get("oom"):
        c.reason = "OOM in the replay"


def _run_jobs(jobs: list[tuple], executor: concurrent.futures.Executor | None,
              say: Callable[[int, CaptureKey, dict[str, Any]], None]) -> list[dict[str, Any]]:
    """:func:`~simddp.plan.evaluate.evaluate_key` of each job, here or on ``executor``, in
    the jobs' order."""
    if executor is None:
        out = []
        for i, job in enumerate(jobs, 1):
            out.append(evaluate_key(*job))
            say(i, job[0], out[-1])
        return out
    futures = {executor.submit(evaluate_key, *job): n for n, job in enumerate(jobs)}
    out: list[dict[str, Any] | None] = [None] * len(jobs)
    try:
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            n = futures[fut]
            out[n] = fut.result()
            say(i, jobs[n][0], out[n])
    finally:
        for f in futures:
            f.cancel()
    return out  # type: ignore[return-value]
