"""``python -m simddp.jobs``: print the job a config describes, what is not modelled, and the
``simddp whatif`` line that asks for it — without capturing anything.

    python -m simddp.jobs --torchtitan llama3_70b.toml --world-size 64
    python -m simddp.jobs --megatron "--num-layers 32 ..." --world-size 8
    python -m simddp.jobs --model path/to/config.json --seq-len 4096
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simddp.jobs", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--torchtitan", metavar="FILE", help="torchtitan's job TOML")
    src.add_argument("--megatron", metavar="ARGS", help="a Megatron-LM argument line")
    src.add_argument("--model", metavar="MODEL", help="a model (resolve_model's forms)")
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--local-batch", type=int, default=None)
    args = p.parse_args(argv)
    try:
        if args.model:
            from .models import resolve_model

            sc = resolve_model(args.model, seq_len=args.seq_len, local_batch=args.local_batch)
            params = f"{sc.num_params:,} parameters, " if sc.num_params else ""
            print(f"{sc.name}: {params}{sc.seq_len} tokens x {sc.local_batch} sequences per "
                  f"rank per microbatch ({sc.source})")
            return 0
        if args.torchtitan:
            from .torchtitan import read_torchtitan
            job = read_torchtitan(args.torchtitan, args.world_size)
        else:
            from .megatron import read_megatron
            job = read_megatron(args.megatron, args.world_size)
        if args.seq_len or args.local_batch:
            p.error("--seq-len and --local-batch size a --model; a job config gives its own")
    except (ValueError, FileNotFoundError) as e:
        print(f"python -m simddp.jobs: error: {e}", file=sys.stderr)
        return 1
    print(job.describe())
    print(job.whatif_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
