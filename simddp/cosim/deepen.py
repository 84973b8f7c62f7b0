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
"""

from __future__ import annotations

import copy
import dataclasses

from fakepg.arguments import integer

from ..program.captured import CapturedPipeline
from .capture_pp import stage_ranks

__all__ = ["deepen"]


def deepen(cap: CapturedPipeline, pp: int, stages_per_rank: int | None = None, *,
           n_layers: int) -> CapturedPipeline:
    """``cap`` as a pipeline of ``pp × stages_per_rank`` stages of a model with ``n_layers``
    blocks: stage 0 is ``cap``'s first stage, the last is its last, every stage between a copy
    of its middle stages (in turn). ``n_layers`` guards the model: the first, middle and last
    block counts of ``cap`` must add up to it at the new depth (a ValueError says which depth
    would). The microbatches, schedule and the parallelism inside the stages stay ``cap``'s."""
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
    placement = stage_ranks(cap.schedule, pp, v)
    stages, start = [], 0
    mids = cap.stages[1:-1]
    for s in range(num_stages):
        src = cap.stages[0] if s == 0 else cap.stages[-1] if s == num_stages - 1 \
            else mids[(s - 1) % len(mids)]
        st = copy.deepcopy(src)
        n = blocks[0] if s == 0 else last if s == num_stages - 1 else per
        st.update(stage=s, rank=placement[s], layers=[start, start + n])
        start += n
        stages.append(st)
    param_bytes = sum(int(st["param_bytes"]) for st in stages)
    mesh = {**cap.mesh, "pp": pp}
    return dataclasses.replace(
        cap, name=f"{cap.name} (deepened to {num_stages} stages)", pp=pp, stages_per_rank=v,
        mesh=mesh, world_size=cap.world_size // cap.pp * pp, stages=stages,
        param_bytes=param_bytes, cosim_iteration_time=0.0, cosim_exposed_comm=0.0)
