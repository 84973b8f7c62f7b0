"""``simddp plan``: the command line of the layout search (:mod:`simddp.plan`).

::

    simddp plan llama3-70b --gpus 256 --gpu h100 --network dgx-h100 --seq-len 8192 \\
        --global-batch 1024 --top 5 --json plan.json --out plan/

Prints the top layouts (tokens/s per GPU, MFU, peak memory, bubble, exposed communication by
mesh dimension), for each its ``simddp whatif`` line and torchtitan TOML, and why the pruned
families were dropped; ``--json`` writes every candidate, ``--out DIR`` the Pareto plot and
the JSON. Nothing here imports torch until the search runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from . import cli_args as A

__all__ = ["add_parser", "run"]

_OBJECTIVES = ("tokens-per-s", "cost", "time-to-tokens")
_AC = ("none", "selective-op", "full")


def _tokens(text: str) -> float:
    """``1e12``, ``15T``, ``300B``: tokens for --objective time-to-tokens."""
    t = text.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    try:
        v = float(t[:-1] if t[-1:] in "KMBGT" else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a token count, e.g. 15T or 3e11") \
            from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the token count must be > 0")
    return v


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(allowed)}")
        return items
    return parse


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2")
    return sizes


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="search the layouts of a model on N GPUs for the fastest "
                       "that fits", description="Enumerate the layouts torch can run (FSDP/"
                       "HSDP, TP, PP with each schedule, microbatches, activation "
                       "checkpointing), prune by rules and memory, replay the rest from "
                       "captures of the real program, and rank them.")
    p.add_argument("model", help="a zoo Llama (llama3-8b, llama3-70b, llama3-405b, llama3-tiny)")
    p.add_argument("--gpus", type=A.integer(1, A.MAX_WORLD, " GPUs"), required=True)
    p.add_argument("--gpu", default="h100", help="GPU preset (default h100)")
    p.add_argument("--network", default="dgx-h100", help="network preset (default dgx-h100)")
    p.add_argument("--gpus-per-node", type=A.integer(1, 1024), default=None,
                   help="GPUs per node (default: the network preset's)")
    p.add_argument("--seq-len", type=A.integer(1, 1 << 24, " tokens"), default=8192)
    p.add_argument("--global-batch", type=A.integer(1, 1 << 30, " sequences"), required=True,
                   help="sequences per optimizer step")
    p.add_argument("--objective", choices=_OBJECTIVES, default="tokens-per-s",
                   help="tokens-per-s (the job's throughput), cost (tokens per GPU-second; "
                        "layouts may use half or a quarter of the GPUs) or time-to-tokens "
                        "(with --tokens: days to train that many)")
    p.add_argument("--tokens", type=_tokens, default=None,
                   help="--objective time-to-tokens: tokens to train, e.g. 15T")
    p.add_argument("--top", type=A.integer(1, 1000), default=5)
    p.add_argument("--activation-checkpointing", type=_choices(_AC), default=_AC,
                   metavar="MODES", help="modes to try (default none,selective-op,full)")
    p.add_argument("--microbatch-sizes", type=_sizes, default=None, metavar="SIZES",
                   help="sequences per microbatch to try, e.g. 1,2 (default: 1 with a "
                        "pipeline; without one each power of two up to a data-parallel "
                        "rank's share of the global batch)")
    p.add_argument("--max-pp", type=A.integer(1, 1024), default=16)
    p.add_argument("--max-cp", type=A.integer(1, 1024), default=None,
                   help="largest context-parallel degree (default 8 for sequences of 32k "
                        "tokens and more, else 1)")
    p.add_argument("--json", metavar="FILE", help="write every candidate and the top as JSON")
    p.add_argument("--out", metavar="DIR", help="write pareto.png and plan.json here")
    p.add_argument("--workers", type=A.integer(1, 1024), default=None,
                   help="replay on a local pool of N processes")
    p.add_argument("--dask", metavar="SCHEDULER_ADDRESS",
                   help="replay on a Dask distributed cluster, e.g. tcp://10.0.0.5:8786")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return p


def run(args: argparse.Namespace, executor: Any, status: Any) -> int:
    from .plan import plan

    if args.objective == "time-to-tokens" and args.tokens is None:
        raise ValueError("--objective time-to-tokens needs --tokens (e.g. --tokens 15T)")
    space: dict[str, Any] = dict(ac_modes=args.activation_checkpointing, max_pp=args.max_pp,
                                 max_cp=args.max_cp)
    if args.microbatch_sizes:
        space["microbatch_sizes"] = args.microbatch_sizes
    res = plan(args.model, gpus=args.gpus, gpu=args.gpu, network=args.network,
               gpus_per_node=args.gpus_per_node, seq_len=args.seq_len,
               global_batch=args.global_batch, objective=args.objective, top=args.top,
               executor=executor, status=status, **space)
    q, f = res.question, res.facts
    print(f"simddp plan: {q['model']} on {q['gpus']} × {q['gpu']} ({q['network']}), "
          f"{q['global_batch']} sequences of {q['seq_len']} tokens a step, "
          f"{q['gpu_memory_gib']:.1f} GiB per GPU")
    print(f"{f['layouts']} layouts: {f['dropped_by_rules']} dropped by rules, "
          f"{f['bounded']} by the compute bound, {f['evaluated'] - f['replayed']} by memory or "
          f"refused, {f['replayed']} replayed from {f['captures']} captures; {f['feasible']} "
          f"fit")
    if not res.top:
        print("no layout fits; why they were dropped:")
        print(res.pruned(), end="")
        return 1
    print(res.table(), end="")
    if args.objective == "time-to-tokens":
        for i, c in enumerate(res.top, 1):
            days = args.tokens / (c.tokens_per_s_per_gpu * c.layout.gpus) / 86400
            print(f"  #{i}: {days:,.1f} days to {args.tokens:,.3g} tokens")
    best = res.top[0]
    print("\nthe best layout as a what-if:\n  " + res.whatif_line(best))
    print("and as torchtitan job config:\n" + "\n".join(
        "  " + line if line else "" for line in res.torchtitan_toml(best).splitlines()))
    print("\nwhy the other layouts were dropped (by family):")
    print(res.pruned(), end="")
    if args.json:
        print(f"wrote {res.to_json(args.json)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        print(f"wrote {res.to_json(os.path.join(args.out, 'plan.json'))}")
        print(f"wrote {res.plot(os.path.join(args.out, 'pareto.png'))}")
    return 0
