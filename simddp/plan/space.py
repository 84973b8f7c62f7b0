"""The layouts torch can run for a model on N GPUs, and the rules that drop the rest.

A :class:`Layout` is one training configuration as torchtitan would run it: data parallelism
(FSDP2 ``fully_shard`` over ``shard`` ranks, replicated ``replicate`` times — HSDP when both are
above one), tensor parallelism ``tp`` (innermost, inside a node), context parallelism ``cp``,
pipeline parallelism ``pp`` with a schedule and ``stages_per_rank`` virtual stages, the
microbatch size (sequences per microbatch), activation checkpointing and
``reshard_after_forward``. :func:`layouts` enumerates them; :func:`rule_out` says why one
cannot run (a rule torch or the model imposes), before anything is captured (torch's schedule
classes are asked when the layout is planned: building their action lists costs seconds).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["Layout", "Shape", "layouts", "rule_out", "static_bytes", "SCHEDULES", "AC_MODES"]

# torch's schedule names as simddp.program.schedules takes them, with the virtual stages each
# runs per rank (single-stage schedules 1, the looped ones 2 or more, the V-shaped zero-bubble
# ones exactly 2); every one replays the capture of its stage count (simddp.plan.evaluate)
SCHEDULES: dict[str, tuple[int, ...]] = {"1F1B": (1,), "GPipe": (1,), "Interleaved1F1B": (2,),
                                         "LoopedBFS": (2,)}
AC_MODES = ("none", "selective-op", "full")


@dataclass(frozen=True)
class Shape:
    """What the rules need of a decoder: blocks, attention heads and key/value heads, and its
    parameters split as embedding, one block and head (bytes are counted from these)."""

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    dim: int
    vocab_size: int
    block_params: int
    embedding_params: int
    head_params: int

    @classmethod
    def of_llama(cls, name: str, args: Any) -> Shape:
        """From a :class:`fakepg.zoo.llama.LlamaArgs`."""
        d, kv = args.dim, args.kv_heads * args.head_dim
        block = 2 * d * d + 2 * d * kv + 3 * d * args.ffn_hidden_dim + 2 * d
        emb = args.vocab_size * d
        return cls(name, args.n_layers, args.n_heads, args.kv_heads, d, args.vocab_size, block,
                   emb, 0 if args.tie_embeddings else emb + d)

    @property
    def params(self) -> int:
        return self.n_layers * self.block_params + self.embedding_params + self.head_params


@dataclass(frozen=True)
class Layout:
    """One configuration (see the module docstring). ``microbatch`` is sequences per
    microbatch on one data-parallel rank; ``microbatches`` how many a step runs (the pipeline's
    microbatches, or gradient-accumulation steps without a pipeline)."""

    gpus: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    replicate: int = 1
    shard: int = 1
    schedule: str | None = None
    stages_per_rank: int = 1
    microbatch: int = 1
    microbatches: int = 1
    ac: str = "full"
    reshard_after_forward: bool = True

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    @property
    def flavour(self) -> str:
        return "hsdp" if self.replicate > 1 and self.shard > 1 else "fsdp"

    @property
    def parallel(self) -> str:
        """The ``--parallel`` spec (simddp's grammar; sizes in torchtitan's mesh order)."""
        parts = [f"pp:{self.pp}"] if self.pp > 1 else []
        parts.append(f"hsdp:{self.shard}" if self.flavour == "hsdp" else f"fsdp:{self.dp}")
        if self.cp > 1:
            parts.append(f"cp:{self.cp}")
        if self.tp > 1:
            parts.append(f"tp:{self.tp}")
        return ",".join(parts)

    @property
    def sequences_per_step(self) -> int:
        return self.dp * self.microbatch * self.microbatches

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        """A short human description: the spec, then the knobs that are not the defaults."""
        out = [self.parallel]
        if self.pp > 1:
            out.append(f"{self.schedule}" + (f" v={self.stages_per_rank}"
                                             if self.stages_per_rank > 1 else ""))
        out.append(f"{self.microbatches}×{self.microbatch} seq")
        out.append(f"AC {self.ac}")
        if not self.reshard_after_forward:
            out.append("no reshard")
        return ", ".join(out)


def _powers_of_two(upto: int) -> list[int]:
    return [1 << i for i in range(upto.bit_length()) if (1 << i) <= upto]


def layouts(shape: Shape, gpus: int, *, gpus_per_node: int, seq_len: int, global_batch: int,
            microbatch_sizes: tuple[int, ...] | None = None, ac_modes: tuple[str, ...] = AC_MODES,
            max_cp: int | None = None, max_pp: int = 16,
            reshard_after_forward: tuple[bool, ...] = (True,),
            schedules: dict[str, tuple[int, ...]] | None = None) -> Iterator[Layout]:
    """Every layout of ``gpus`` GPUs for ``global_batch`` sequences of ``seq_len`` tokens a
    step, before rules: tp, cp and pp powers of two (tp within a node), FSDP over the rest or
    HSDP sharding inside 1, 2, 4... nodes (without a pipeline), each schedule of ``schedules``
    (default :data:`SCHEDULES`) with its virtual stages, microbatch
    sizes (``microbatch_sizes``; None: one sequence with a pipeline, without one each power of
    two up to the data-parallel rank's whole share of the batch — torchtitan's local batch,
    fewer gradient-accumulation steps), activation checkpointing modes, and ``reshard_after_forward`` (without a pipeline;
    torchtitan turns it off under pipelines). ``max_cp`` None: context parallelism up to 8 for
    sequences of 32k tokens and more, none below."""
    if max_cp is None:  # context parallelism is for long sequences (torchtitan: 32k and up)
        max_cp = 8 if seq_len >= 32768 else 1
    for tp in _powers_of_two(min(gpus_per_node, gpus)):
        for cp in _powers_of_two(min(max_cp, gpus // tp)):
            for pp in _powers_of_two(min(max_pp, gpus // (tp * cp))):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                # HSDP: shard inside 1, 2, 4 ... nodes' worth of data-parallel ranks
                per_node = max(1, gpus_per_node // (tp * cp))
                shards = [dp] + ([s for s in (per_node << i for i in range(4)) if 1 < s < dp
                                  and dp % s == 0] if pp == 1 else [])
                for shard in shards:
                    sizes = microbatch_sizes or ((1,) if pp > 1 else
                                                 _powers_of_two(global_batch // dp))
                    for mb in sizes:
                        if global_batch % (dp * mb):
                            continue
                        m = global_batch // (dp * mb)
                        scheds = [(None, 1)] if pp == 1 else \
                            [(s, v) for s, vs in (schedules or SCHEDULES).items() for v in vs]
                        for sched, v in scheds:
                            for ac in ac_modes:
                                for raf in (reshard_after_forward if pp == 1 else (False,)):
                                    yield Layout(gpus, tp, cp, pp, dp // shard, shard, sched, v,
                                                 mb, m, ac, raf)


def rule_out(layout: Layout, shape: Shape, *, gpus_per_node: int, seq_len: int) -> str | None:
    """Why ``layout`` cannot run (None: no rule against it)."""
    lay = layout
    if lay.tp > gpus_per_node:
        return f"tp:{lay.tp} spans nodes ({gpus_per_node} GPUs per node): TP stays on NVLink"
    if shape.n_heads % lay.tp or shape.n_kv_heads % lay.tp:
        return (f"tp:{lay.tp} does not divide {shape.n_heads} attention heads and "
                f"{shape.n_kv_heads} key/value heads (torchtitan's plan shards both)")
    if lay.cp > 1 and seq_len % (2 * lay.cp):
        return f"cp:{lay.cp}: sequence {seq_len} is not divisible into 2 × {lay.cp} chunks " \
               f"(load-balanced causal attention)"
    from ..program.parallel import Parallel  # the registry's own word on the composition

    try:
        why = Parallel.parse(lay.parallel, lay.gpus).not_replayed()
    except ValueError as e:
        why = str(e)
    if why:
        return " ".join(why.split())
    stages = lay.pp * lay.stages_per_rank
    if lay.pp > 1:
        if stages > shape.n_layers + 2:  # the embedding and the head weigh a block each
            return f"{stages} pipeline stages for {shape.n_layers} blocks, the embedding and " \
                   f"the head"
        if lay.microbatches < lay.pp:
            return f"{lay.microbatches} microbatches for {lay.pp} pipeline ranks: the " \
                   f"schedule needs at least one per rank"
    return None


def static_bytes(layout: Layout, shape: Shape) -> int:
    """Per GPU on the busiest pipeline rank: parameters (fp32, sharded), their gradients (fp32,
    sharded) and Adam's two moments (fp32) — what a step holds before any activation. The
    embedding and head sit on the first and last stages with their share of blocks."""
    lay = layout
    stages = lay.pp * lay.stages_per_rank
    per_stage_blocks = math.ceil(shape.n_layers / stages)
    edge = max(shape.embedding_params, shape.head_params)
    per_rank = lay.stages_per_rank * per_stage_blocks * shape.block_params + \
        (edge if lay.pp > 1 else shape.embedding_params + shape.head_params)
    if lay.pp == 1:
        per_rank = shape.params
    return 16 * per_rank // (lay.tp * lay.shard * lay.cp)  # FSDP shards over shard × cp
