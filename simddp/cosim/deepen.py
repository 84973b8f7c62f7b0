"""A deep pipeline from a shallow capture: stages that hold the same blocks run the same actions.

A pipeline stage's actions — its forward, backward, weight-gradient and optimizer steps, the
tensor-parallel and FSDP collectives inside them, what it sends on — depend on the blocks it
holds, the microbatch and the parallelism inside it, not on how many other stages the pipeline
has. So a capture whose first, middle and last stages hold what the target pipeline's first,
middle and last stages hold stands for a pipeline of any depth. That makes Llama 3 405B at
pp 16 × 8 virtual stages (128 stages, one block each; the first only the embedding, the last
only the head — the Llama 3 paper's layout) a capture of a 2-block model on 4 stages:

    >>> from fakepg import zoo
    >>> from simddp.cosim.capture_pp import capture_pp
    >>> from simddp.cosim.deepen import deepen
    >>> shallow = capture_pp(zoo.get("llama3-tiny", batch_size=4), 2, microbatches=4,
    ...                      schedule="Interleaved1F1B", stages_per_rank=2,
    ...                      input_weight=1, output_weight=1)       # [emb] [b0] [b1] [head]
    >>> deep = deepen(shallow, pp=4, stages_per_rank=4, n_layers=14)  # [emb] 14 × [b] [head]
    >>> len(deep.stages), deep.stages[-1]["layers"]
    (16, [14, 14])

What the copy cannot know is said where it matters: the deep capture has no co-simulated
iteration time of its own (``cosim_iteration_time`` = 0).

A plain step (FSDP2 / HSDP with TP or CP inside, no pipeline) deepens the same way one level
down: its middle blocks issue the same collectives and save the same activations, so
:func:`deepen_step` copies one middle block of a capture of :data:`SHALLOW_STEP_BLOCKS` blocks
as many times as the deep model has more.

:func:`capture_pipeline` does both steps for a pipeline of any depth: it captures the shallowest
pipeline whose stages hold what the target's first, middle and last stages hold (torchtitan's
uneven split: two kinds of middle stage at most), on a few microbatches (the first, middle and
last one are what a replay reads), and deepens it — a capture whose cost depends on the model's
stages, not on ``pp``, the microbatch count or the world.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Sequence

import torch

from fakepg.arguments import integer

from ..program.captured import CapturedPipeline
from .capture_pp import checked_llama, capture_pp, schedule_class, stage_ranks

__all__ = ["deepen", "capture_pipeline", "shallow_plan", "deepen_step", "block_bytes",
           "periodic_stretch", "SHALLOW_STEP_BLOCKS"]

# microbatches a shallow capture runs: the first, two middle and the last (a replay reads the
# first, the last and a middle one; any schedule takes 4 on the shallow pipelines below)
SHALLOW_MICROBATCHES = 4


def _counts(n_layers: int, num_stages: int, input_weight: int, output_weight: int) -> list[int]:
    from fakepg.zoo.llama import stage_layers

    return [len(stage_layers(n_layers, s, num_stages, input_weight=input_weight,
                             output_weight=output_weight)) for s in range(num_stages)]


def deepen(cap: CapturedPipeline, pp: int, stages_per_rank: int | None = None, *,
           n_layers: int, input_weight: int | None = None,
           output_weight: int | None = None) -> CapturedPipeline:
    """``cap`` as a pipeline of ``pp × stages_per_rank`` stages of a model with ``n_layers``
    blocks: stage 0 is ``cap``'s first stage, the last is its last, every stage between a copy
    of its middle stages (in turn). ``n_layers`` guards the model: the first, middle and last
    block counts of ``cap`` must add up to it at the new depth (a ValueError says which depth
    would). With ``input_weight`` / ``output_weight`` the deep pipeline is split as
    :func:`models.llama.stage_layers` splits it (torchtitan's uneven split, whose middle stages
    hold one of two block counts): each middle stage is then a copy of a captured middle stage
    holding as many blocks. The microbatches, schedule and the parallelism inside the stages
    stay ``cap``'s."""
    pp = integer("deepen: pp", pp, minimum=1)
    v = integer("deepen: stages_per_rank", cap.stages_per_rank if stages_per_rank is None
                else stages_per_rank, minimum=1)
    n_layers = integer("deepen: n_layers", n_layers, minimum=0)
    if len(cap.stages) < 3:
        raise ValueError(f"deepen: {cap.name}'s capture has {len(cap.stages)} stages; it needs a "
                         f"first, at least one middle and a last stage (capture pp × stages per "
                         f"rank >= 3)")
    blocks = [st["layers"][1] - st["layers"][0] for st in cap.stages]
    first, middle, last = blocks[0], blocks[1:-1], blocks[-1]
    if input_weight is not None or output_weight is not None:
        target = _counts(n_layers, pp * v, integer("deepen: input_weight", input_weight or 0,
                                                    minimum=0),
                         integer("deepen: output_weight", output_weight or 0, minimum=0))
        return _deepened(cap, pp, v, target)
    if len(set(middle)) != 1:
        raise ValueError(f"deepen: the captured middle stages hold {middle} blocks; deepening "
                         f"copies them, so they must hold the same number")
    per = middle[0]
    num_stages = pp * v
    if num_stages < 3 or first + per * (num_stages - 2) + last != n_layers:
        fits = ("" if per == 0 or (n_layers - first - last) % per else
                f" ({(n_layers - first - last) // per + 2} stages would)")
        raise ValueError(f"deepen: {num_stages} stages of {first} (first), {per} (middle) and "
                         f"{last} (last) blocks hold {first + per * max(0, num_stages - 2) + last}"
                         f" blocks, the model {n_layers}{fits}; capture the split the deep "
                         f"pipeline has (capture_pp's input_weight / output_weight)")
    return _deepened(cap, pp, v, [first] + [per] * (num_stages - 2) + [last])


def _deepened(cap: CapturedPipeline, pp: int, v: int, target: Sequence[int]
              ) -> CapturedPipeline:
    """``cap`` deepened to stages holding ``target`` blocks each: the first and last stages are
    ``cap``'s, each middle one a copy of a captured middle stage of its block count (in turn
    among those)."""
    num_stages = pp * v
    blocks = [st["layers"][1] - st["layers"][0] for st in cap.stages]
    mids: dict[int, list[dict[str, Any]]] = {}
    for st, n in zip(cap.stages[1:-1], blocks[1:-1]):
        mids.setdefault(n, []).append(st)
    for what, want, have in (("first", target[0], blocks[0]), ("last", target[-1], blocks[-1])):
        if want != have:
            raise ValueError(f"deepen: the deep pipeline's {what} stage holds {want} blocks, the "
                             f"captured one {have}; capture the split the deep pipeline has "
                             f"(capture_pp's input_weight / output_weight)")
    missing = sorted(set(target[1:-1]) - set(mids))
    if missing:
        raise ValueError(f"deepen: the deep pipeline has middle stages of {missing} blocks; the "
                         f"capture's middle stages hold {sorted(mids)}: capture a pipeline with "
                         f"such a middle stage")
    placement = stage_ranks(cap.schedule, pp, v)
    stages, start, turn = [], 0, dict.fromkeys(mids, 0)
    for s, n in enumerate(target):
        if s == 0 or s == num_stages - 1:
            src = cap.stages[0 if s == 0 else -1]
        else:
            src = mids[n][turn[n] % len(mids[n])]
            turn[n] += 1
        st = copy.deepcopy(src)
        st.update(stage=s, rank=placement[s], layers=[start, start + n])
        start += n
        stages.append(st)
    param_bytes = sum(int(st["param_bytes"]) for st in stages)
    mesh = {**cap.mesh, "pp": pp}
    return dataclasses.replace(
        cap, name=f"{cap.name} (deepened to {num_stages} stages)", pp=pp, stages_per_rank=v,
        mesh=mesh, world_size=cap.world_size // cap.pp * pp, stages=stages,
        param_bytes=param_bytes, cosim_iteration_time=0.0, cosim_exposed_comm=0.0)


def shallow_plan(n_layers: int, pp: int, stages_per_rank: int, schedule: str, *,
                 input_weight: int = 0, output_weight: int = 0) -> tuple[int, int] | None:
    """(pp, n_layers) of the shallowest pipeline (``stages_per_rank`` stages a rank, as the
    target) whose first and last stages hold what the target's hold and whose middle stages
    hold each middle block count the target has; None when it has no fewer stages than the
    target. :func:`models.llama.stage_layers` gives every stage ``per`` or ``per + 1`` blocks of
    the weighted model (the first ``extra`` ones the more), so a shallow split with the same
    ``per`` and an ``extra`` of 0, 1, 2 or all-but-one has them all."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    num_stages = pp * stages_per_rank
    target = _counts(n_layers, num_stages, input_weight, output_weight)  # raises if no split
    weights = input_weight + output_weight
    per, extra = divmod(n_layers + weights, num_stages)
    kinds = len(set(target[1:-1]))
    need = 4 if kinds > 1 else 3  # first, one or two kinds of middle, last
    shallow_pp = max(2 if not issubclass(schedule_class(schedule), PipelineScheduleSingle)
                     else 3, -(-need // stages_per_rank))
    stages = shallow_pp * stages_per_rank
    if stages >= num_stages:
        return None
    shallow_extra = {0: 0, 1: 1}.get(extra, stages - 1 if extra == num_stages - 1 else 2)
    layers = stages * per + shallow_extra - weights
    got = _counts(layers, stages, input_weight, output_weight)
    if (got[0], got[-1]) != (target[0], target[-1]) or set(got[1:-1]) != set(target[1:-1]):
        raise AssertionError(f"shallow_plan: {got} does not hold the stages of {target}")
    return shallow_pp, layers


class _FirstRows:
    """A scenario's batches cut to their first ``rows`` samples (fewer microbatches of the
    same size)."""

    def __init__(self, batches: Any, rows: int) -> None:
        self.batches, self.rows = batches, rows

    def __call__(self, rank: int, world_size: int) -> list:
        return [tuple(t[:self.rows] if isinstance(t, torch.Tensor) else t for t in batch)
                for batch in self.batches(rank, world_size)]


def capture_pipeline(scenario: Any, pp: int, *, schedule: str = "1F1B",
                     microbatches: int | None = None, stages_per_rank: int = 1,
                     input_weight: int = 0, output_weight: int = 0,
                     shallow: bool | None = None, **kwargs: Any) -> CapturedPipeline:
    """:func:`~simddp.cosim.capture_pp.capture_pp`'s capture of ``scenario`` pipelined over
    ``pp`` ranks, at the cost of the shallowest pipeline that has each of its stages' roles:
    where :func:`shallow_plan` finds one, that pipeline (the model cut to its blocks) is
    captured on :data:`SHALLOW_MICROBATCHES` microbatches of the same size and
    :func:`deepened <deepen>` to ``pp`` — its stages' actions are the deep pipeline's, as
    co-simulated with their own neighbours; else (few stages, fewer than 4 microbatches, or
    ``losses`` asked for, which are the whole model's) ``capture_pp`` as asked.
    ``shallow``: None (the default) decides so, False always captures the whole pipeline, True
    refuses where no shallow pipeline stands for it. ``kwargs`` go to ``capture_pp`` (mesh,
    timing, device, …)."""
    cls = schedule_class(schedule)
    spr = integer("capture_pipeline: stages_per_rank", stages_per_rank, minimum=1)
    model = checked_llama(scenario)
    split = dict(input_weight=input_weight, output_weight=output_weight)
    plan = None if shallow is False else shallow_plan(model.args.n_layers, pp, spr, schedule,
                                                      **split)
    batch = int(scenario.inputs(0, 1)[0][0].shape[0])
    m = batch if microbatches is None else integer("capture_pipeline: microbatches",
                                                   microbatches, minimum=1)
    if plan is not None and (batch % m or m < SHALLOW_MICROBATCHES
                             or kwargs.get("losses") is not None):
        plan = None  # capture_pp says what is wrong with m; too few to cut; the deep losses
    if plan is None:
        if shallow:
            raise ValueError(f"capture_pipeline: no shallower pipeline stands for pp={pp} × "
                             f"{spr} stages of {model.args.n_layers} blocks with {m} "
                             f"microbatches ({cls.__name__}); capture it with shallow=False")
        return capture_pp(scenario, pp, schedule=schedule, microbatches=m,
                          stages_per_rank=spr, **split, **kwargs)
    shallow_pp, layers = plan
    from fakepg.zoo.llama import Llama

    rows = batch // m * SHALLOW_MICROBATCHES
    cut = scenario.with_(model=functools.partial(
        Llama, dataclasses.replace(model.args, n_layers=layers)),
        batches=_FirstRows(scenario.batches, rows))
    cap = capture_pp(cut, shallow_pp, schedule=schedule, microbatches=SHALLOW_MICROBATCHES,
                     stages_per_rank=spr, **split, **kwargs)
    deep = deepen(cap, pp, spr, n_layers=model.args.n_layers, **split)
    for st in deep.stages:  # m microbatches: the first, the middle ones, the last
        st["actions"] = {kind: [copy.deepcopy(profs[_captured_microbatch(mb, m, len(profs))])
                                for mb in range(m)] for kind, profs in st["actions"].items()}
    return dataclasses.replace(deep, name=str(getattr(scenario, "name", "scenario")),
                               microbatches=m)


def _captured_microbatch(mb: int, m: int, n: int) -> int:
    """Which of ``n`` captured microbatches stands for microbatch ``mb`` of ``m``: the first,
    the last, or a middle one (the pipeline planner's rule)."""
    if mb == 0 or n == 1:
        return 0
    if mb == m - 1:
        return n - 1
    return min(mb, n - 2) if n > 2 else 0


# blocks a shallow capture of a plain (non-pipelined) sharded step runs: the first block (its
# all-gather issued with the root's), the last (nothing to prefetch after it) and a stretch of
# middle ones long enough to show their period in every phase
SHALLOW_STEP_BLOCKS = 8


def periodic_stretch(seq: Sequence[Any], reps: int) -> tuple[int, int, int] | None:
    """(start, period, repeats) of the longest period that repeats at least ``reps`` times in
    a row somewhere in ``seq`` (the longest stretch of it; ties: the first), None where none
    does. A model of identical blocks issues (and saves) the same run per block, so the
    longest such period is a block's."""
    n = len(seq)
    for period in range(n // max(reps, 1), 0, -1):
        best = None
        o = 0
        while o + reps * period <= n:
            k = 1
            while o + (k + 1) * period <= n and \
                    seq[o + k * period:o + (k + 1) * period] == seq[o:o + period]:
                k += 1
            if k >= reps and (best is None or k > best[2]):
                best = (o, period, k)
            o += 1 if k < reps else k * period
        if best:
            return best
    return None


def _deepen_phase(phase: dict[str, Any], extra: int, reps: int, what: str
                  ) -> dict[str, Any]:
    """A captured phase (``{"seconds", "events"}``) with ``extra`` more copies of one middle
    block's collectives and compute: a copy of the middle period of the longest periodic
    stretch of its events (op, scope, bytes), inserted after it; every later event (and wait)
    moves on by the block's compute."""
    evs = phase["events"]
    sig = [(e["op"], e["scope"], e["bytes"]) for e in evs]
    found = periodic_stretch(sig, reps)
    if found is None:
        raise ValueError(f"deepen_step: the {what} phase's collectives show no block period "
                         f"repeated {reps} times; capture the whole model")
    o, period, k = found
    j = o + (k // 2) * period  # the middle block's first event
    ins = j + period           # where the copies go
    if ins >= len(evs):
        raise ValueError(f"deepen_step: the {what} phase's middle block is its last")
    t = float(evs[ins]["offset"])
    delta = t - float(evs[j]["offset"])
    if delta < 0:
        raise ValueError(f"deepen_step: the {what} phase's blocks do not advance in time")
    shift = extra * delta

    def moved(e: dict[str, Any], by: float, after: bool) -> dict[str, Any]:
        w = e["wait_at"]
        return {**e, "offset": e["offset"] + (by if after else 0.0),
                "wait_at": None if w is None else w + (by if after or w > t else 0.0)}

    out = [moved(e, shift, False) for e in evs[:ins]]
    for i in range(1, extra + 1):
        out.extend({**e, "offset": e["offset"] + i * delta,
                    "wait_at": None if e["wait_at"] is None else e["wait_at"] + i * delta}
                   for e in evs[j:ins])
    out.extend(moved(e, shift, True) for e in evs[ins:])
    return {**phase, "seconds": float(phase["seconds"]) + shift, "events": out}


def deepen_step(cap: Any, n_layers: int, *, captured_layers: int,
                block: tuple[int, int]) -> Any:
    """A plain sharded step (FSDP2 / HSDP, with TP or CP inside: a
    :class:`~simddp.program.captured.ShardedStep`) captured on a model of ``captured_layers``
    identical blocks, as the same model with ``n_layers`` blocks: in forward and backward one
    middle block's collectives and compute copied ``n_layers - captured_layers`` times (the
    first and last blocks, whose FSDP2 prefetch and reshard differ, stay as captured), the
    saved activations likewise (a block's period of saved storages), the parameters by
    ``block`` = (one block's bytes, one TP rank's share) each, the optimizer's state and step
    time in proportion to a TP rank's parameters. What does not grow with depth stays: the
    largest block's recompute, the loss's temporaries. The deep capture has no co-simulated
    iteration time of its own (0)."""
    n_layers = integer("deepen_step: n_layers", n_layers, minimum=1)
    have = integer("deepen_step: captured_layers", captured_layers, minimum=1)
    extra = n_layers - have
    if extra == 0:
        return cap
    if extra < 0 or have < SHALLOW_STEP_BLOCKS:
        raise ValueError(f"deepen_step: a capture of {have} blocks deepens to more blocks (at "
                         f"least {SHALLOW_STEP_BLOCKS} captured), not to {n_layers}")
    reps = have - 3  # the middle blocks: all but the first two and the last
    profiles = []
    for prof in cap.profiles:
        deep = {ph: (_deepen_phase(v, extra, reps, ph) if ph in ("forward", "backward")
                     else dict(v)) for ph, v in prof.items()}
        profiles.append(deep)
    whole, per_tp = (integer("deepen_step: block bytes", b, minimum=0) for b in block)
    tp_before = cap.tp_param_bytes
    tp_after = tp_before + extra * (per_tp if cap.local_param_bytes else whole)
    scale = tp_after / tp_before
    for prof in profiles:  # the optimizer steps every parameter of the rank's shard
        prof["optimizer"] = {**prof["optimizer"],
                             "seconds": float(prof["optimizer"]["seconds"]) * scale}
    changes: dict[str, Any] = dict(
        profiles=profiles, param_bytes=cap.param_bytes + extra * whole,
        local_param_bytes=(cap.local_param_bytes + extra * per_tp) if cap.local_param_bytes
        else 0, optimizer_state_bytes=int(round(cap.optimizer_state_bytes * scale)),
        name=f"{cap.name} (deepened from {have} to {n_layers} blocks)",
        cosim_iteration_time=0.0, cosim_exposed_comm=0.0)
    sizes = list(getattr(cap, "activation_sizes", None) or [])
    if sizes:
        found = periodic_stretch(sizes, have - 2)
        if found is None:
            raise ValueError("deepen_step: the saved activations show no block period; "
                             "capture the whole model")
        o, period, k = found
        j = o + (k // 2) * period
        run = sizes[j:j + period]
        changes["activation_sizes"] = sizes[:j + period] + run * extra + sizes[j + period:]
        changes["activation_bytes"] = int(cap.activation_bytes) + extra * sum(run)
    elif cap.activation_bytes:
        raise ValueError("deepen_step: the capture lists no saved storages to tell a block's "
                         "activations by; capture the whole model")
    return dataclasses.replace(cap, **changes)


def block_bytes(block: torch.nn.Module, tp: int = 1) -> tuple[int, int]:
    """(bytes, one TP rank's bytes) of a block's parameters: torchtitan's TP plan shards every
    linear layer of a block over ``tp`` ranks and replicates the rest (its norms)."""
    whole = local = 0
    for m in block.modules():
        for p in m.parameters(recurse=False):
            b = p.numel() * p.element_size()
            whole += b
            local += b // tp if isinstance(m, torch.nn.Linear) else b
    return whole, local
