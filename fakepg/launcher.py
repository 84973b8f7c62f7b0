"""``fakerun``: torchrun's launch flags, one process, the fake cluster underneath.

    fakerun --nproc-per-node 4 train.py --epochs 2
    fakerun --standalone --nproc_per_node=4 -m mypkg.train

The script runs unmodified: it reads RANK/WORLD_SIZE/LOCAL_RANK from os.environ and
calls ``dist.init_process_group("nccl")``/``("gloo")``/``()``; each rank runs the script
as ``__main__`` on its own thread. Exit status 0 on success; 1, with the hang, mismatch
or failure report on stderr, otherwise.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from typing import Sequence

from .errors import FakePGError, RankFailedError
from .world import spawn


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fakerun",
        description="Run a torchrun-style script on an in-process fake cluster (fakepg).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", default="1",
                   help="number of ranks (an integer; 'cpu'/'auto' mean 1 as in torchrun on a CPU host)")
    p.add_argument("--nnodes", default="1", help="must be 1: the fake cluster is one process")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", default="0")
    p.add_argument("--standalone", action="store_true", help="accepted for torchrun compatibility")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=29500)
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None)
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", default="0")
    p.add_argument("--seed", type=int, default=0, help="fakepg seed for unseeded RNG state")
    p.add_argument("-m", "--module", dest="module", action="store_true",
                   help="run the target as a module (python -m)")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.nnodes not in ("1", "1:1"):
        print(f"fakerun: --nnodes {args.nnodes}: the fake cluster is a single node in one process; "
              f"use --nnodes 1 and set --nproc-per-node to the total world size", file=sys.stderr)
        return 2
    nproc = 1 if args.nproc in ("cpu", "auto", "gpu") else int(args.nproc)
    if nproc < 1:
        print(f"fakerun: --nproc-per-node must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2

    def rank_main(rank: int) -> None:
        old_argv = sys.argv
        sys.argv = [args.target, *args.script_args]
        try:
            if args.module:
                runpy.run_module(args.target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(args.target, run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                raise RuntimeError(f"the script exited with status {e.code}") from e
        finally:
            sys.argv = old_argv

    try:
        spawn(rank_main, nprocs=nproc, seed=args.seed, master_port=args.master_port)
    except RankFailedError as e:
        cause = e.__cause__
        print(f"fakerun: {e}", file=sys.stderr)
        if cause is not None:
            import traceback

            traceback.print_exception(cause, file=sys.stderr)
        return 1
    except FakePGError as e:
        print(f"fakerun: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
