"""What ``simddp plan`` prints and writes: the top layouts as a table, each with the
``simddp whatif`` line and the torchtitan TOML fragment that run it, why each pruned family was
dropped, the JSON of every candidate, and the Pareto front of tokens/s against memory."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Sequence

from .search import Candidate

__all__ = ["table", "whatif_line", "torchtitan_toml", "pruned_summary", "write_json",
           "plot_pareto", "pareto_front"]

GIB = 1 << 30


def whatif_line(c: Candidate, *, model: str, gpu: str, network: str, seq_len: int,
                global_batch: int) -> str:
    """The ``simddp whatif`` command that answers for this layout alone."""
    lay = c.layout
    out = [f"simddp whatif {model} --parallel {lay.parallel} --world-size {lay.gpus}",
           f"--gpu {gpu} --network {network} --seq-len {seq_len}",
           f"--global-batch {global_batch} --local-batch {lay.microbatch}",
           f"--activation-checkpointing {lay.ac}",
           "--param-dtype bf16 --reduce-dtype fp32"]  # torchtitan's mixed precision, as captured
    if lay.pp > 1:
        out.append(f"--pp-schedule {lay.schedule} --microbatches {lay.microbatches}")
        if lay.stages_per_rank > 1:
            out.append(f"--stages-per-rank {lay.stages_per_rank}")
    elif not lay.reshard_after_forward:
        out.append("--reshard-after-forward false")
    return " ".join(out)


def torchtitan_toml(c: Candidate, *, seq_len: int, global_batch: int) -> str:
    """The torchtitan job-config sections (``local_batch_size`` / ``global_batch_size`` form)
    that run this layout."""
    lay = c.layout
    local = lay.microbatch * (lay.microbatches if lay.pp > 1 else 1)
    lines = ["[training]", f"local_batch_size = {local}", f"global_batch_size = {global_batch}",
             f"seq_len = {seq_len}", "", "[parallelism]",
             f"data_parallel_replicate_degree = {lay.replicate}",
             f"data_parallel_shard_degree = {lay.shard}",
             f"tensor_parallel_degree = {lay.tp}", f"context_parallel_degree = {lay.cp}",
             f"pipeline_parallel_degree = {lay.pp}"]
    if lay.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{lay.schedule}"',
                  f"pipeline_parallel_microbatch_size = {lay.microbatch}"]
    if lay.pp == 1:
        lines.append('fsdp_reshard_after_forward = "%s"'
                     % ("always" if lay.reshard_after_forward else "never"))
    mode = {"none": "none", "full": "full", "selective-op": "selective"}.get(lay.ac, lay.ac)
    lines += ["", "[activation_checkpoint]", f'mode = "{mode}"']
    if lay.ac == "selective-op":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines)


def table(top: Sequence[Candidate]) -> str:
    """The ranked layouts, one line each."""
    head = (f"{'#':>2}  {'layout':<26} {'schedule':<19} {'mb':>6} {'AC':<12} {'tok/s/GPU':>9} "
            f"{'MFU':>6} {'mem GiB':>7} {'bubble':>6}  exposed comm by dim")
    lines = [head]
    for i, c in enumerate(top, 1):
        lay = c.layout
        sched = "-" if lay.pp == 1 else lay.schedule + (f" v{lay.stages_per_rank}"
                                                       if lay.stages_per_rank > 1 else "")
        comm = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(c.exposed_comm_by_dim.items())
                         if v > 0) or "-"
        bubble = "-" if c.bubble_fraction is None else f"{c.bubble_fraction:.1%}"
        lines.append(f"{i:>2}  {lay.parallel:<26} {sched:<19} "
                     f"{f'{lay.microbatches}x{lay.microbatch}':>6} {lay.ac:<12} "
                     f"{c.tokens_per_s_per_gpu:>9,.0f} {c.mfu:>6.1%} "
                     f"{c.peak_memory_bytes / GIB:>7.1f} {bubble:>6}  {comm}")
    return "\n".join(lines) + "\n"


def _family(c: Candidate) -> str:
    lay = c.layout
    return f"tp:{lay.tp}" + (f",cp:{lay.cp}" if lay.cp > 1 else "") + \
        (f",pp:{lay.pp}" if lay.pp > 1 else "")


def pruned_summary(cands: Sequence[Candidate], limit: int = 12) -> str:
    """Why layouts were dropped, by family (tp, cp, pp) and reason kind, the most common
    first, with one example reason each."""
    groups: Counter = Counter()
    example: dict[tuple[str, str], str] = {}
    for c in cands:
        if c.feasible is False:
            kind = c.reason.split(":")[0] if not c.reason.startswith("OOM") else \
                ("OOM before activations" if "before activations" in c.reason else "OOM")
            key = (_family(c), kind)
            groups[key] += 1
            example.setdefault(key, c.reason)
    lines = [] if groups else ["  none: every layout was evaluated and fits"]
    for (fam, kind), n in groups.most_common(limit):
        lines.append(f"  {fam:<16} {n:>4} dropped: {example[(fam, kind)]}")
    if len(groups) > limit:
        lines.append(f"  ... and {len(groups) - limit} more families (--json has every one)")
    return "\n".join(lines) + "\n"


def write_json(path: str | os.PathLike, cands: Sequence[Candidate], top: Sequence[Candidate],
               facts: dict[str, Any]) -> str:
    """``{"candidates": [...], "top": [...], "search": facts}``."""
    data = {"candidates": [c.to_dict() for c in cands], "top": [c.to_dict() for c in top],
            "search": facts}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return os.fspath(path)


def pareto_front(cands: Sequence[Candidate]) -> list[Candidate]:
    """The feasible layouts no other beats on both tokens/s per GPU and peak memory."""
    ok = sorted((c for c in cands if c.feasible and c.tokens_per_s_per_gpu),
                key=lambda c: (c.peak_memory_bytes, -c.tokens_per_s_per_gpu))
    front, best = [], -1.0
    for c in ok:
        if c.tokens_per_s_per_gpu > best:
            front.append(c)
            best = c.tokens_per_s_per_gpu
    return front


def plot_pareto(path: str | os.PathLike, cands: Sequence[Candidate], *, title: str,
                memory_limit_gib: float) -> str:
    """A PNG: every replayed layout's tokens/s per GPU against its peak memory, the Pareto
    front joined, the card's memory as a line."""
    from ..analysis.plot import load_matplotlib

    canvas_cls, figure_cls, _ = load_matplotlib()
    ok = [c for c in cands if c.tokens_per_s_per_gpu]
    front = pareto_front(cands)
    fig = figure_cls(figsize=(8, 5))
    canvas_cls(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter([c.peak_memory_bytes / GIB for c in ok], [c.tokens_per_s_per_gpu for c in ok],
               s=12, alpha=0.5, label="replayed layouts")
    ax.plot([c.peak_memory_bytes / GIB for c in front],
            [c.tokens_per_s_per_gpu for c in front], "o-", color="C3", label="Pareto front")
    for c in front[-3:]:
        ax.annotate(c.layout.parallel, (c.peak_memory_bytes / GIB, c.tokens_per_s_per_gpu),
                    fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.axvline(memory_limit_gib, color="grey", ls="--", lw=1, label="allocatable memory")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120, format="png")
    return os.fspath(path)
