"""Benchmark: what the command line costs before it answers, and what the capture cache saves.

1. ``simddp --help`` and ``simddp whatif --help`` (each in a fresh process, median of
   --rounds) beside ``python -c "import torch"``: help loads no torch, so it costs a Python
   start and the argument parser.
2. typical ``simddp whatif`` lines (a DDP zoo model, Llama 3 8B FSDP, FSDP×TP and a pipeline,
   a Hugging Face config.json) cold (an empty cache directory: the capture runs) and warm (the
   same command again: the capture loads from the cache, found by the command's own terms
   without building the model), each a fresh process: wall and CPU time (user + sys of the
   child: the steadier figure on a shared machine) side by side, the ratio, and whether both
   printed the same table. The goal (issue 25): warm ≤ 5 s.

    python ci/bench_cli.py [--rounds 3] [--only LABEL] [--checkout DIR]

``--checkout DIR`` times the simddp of another checkout of this repository (e.g. ``git worktree
add /tmp/base main``) with this interpreter and these lines: the figures before and after a
change, on the same machine at the same load.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMON = ["--no-progress"]
WHATIF = [  # (label, whatif arguments)
    ("mlp ddp", "mlp --world-size 64,1024 --network ib-ndr --gpus-per-node 8 --bucket-cap-mb 1,25"),
    ("8B fsdp", "llama3-8b --parallel fsdp --world-size 64,512"),
    ("8B fsdp:16,tp:8", "llama3-8b --parallel fsdp:16,tp:8 --world-size 128 --network dgx-h100 "
     "--gpu h100"),
    ("tiny pp:2,fsdp,tp:2", "llama3-tiny --parallel pp:2,fsdp,tp:2 --world-size 16,64 "
     "--network dgx-h100 --gpu h100 --pp-schedule 1f1b,interleaved1f1b --microbatches 4,8"),
    ("HF mistral-7b fsdp", "tests/data/hf/mistral-7b.json --parallel fsdp --world-size 64"),
]


def _measured(cmd: list[str], env: dict[str, str], cwd: str | None = None
              ) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, the child's user + sys CPU seconds, the finished process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help="run the what-if lines whose label contains this")
    ap.add_argument("--checkout", help="the checkout whose simddp runs (default: this one)")
    args = ap.parse_args()
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if k != "SIMDDP_NO_CACHE"}
    # `python -m simddp` from the checkout's root imports that checkout's simddp and fakepg
    root = os.path.abspath(args.checkout or os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env["PYTHONPATH"] = root
    print("1. help without torch (median of fresh processes)")
    rows = {"simddp --help": [py, "-m", "simddp", "--help"],
            "simddp whatif --help": [py, "-m", "simddp", "whatif", "--help"],
            "python -c 'import torch'": [py, "-c", "import torch"]}
    for name, cmd in rows.items():
        times = [_measured(cmd, env, root)[0] for _ in range(args.rounds)]
        print(f"   {name:28} {statistics.median(times):6.2f} s")
    print(f"2. simddp whatif cold vs warm capture cache (fresh processes; load average "
          f"{os.getloadavg()[0]:.1f} at the start)")
    print(f"   {'':22} {'cold wall':>9} {'cpu':>6}   {'warm wall':>9} {'cpu':>6}   "
          f"{'cold/warm cpu':>13}  same table")
    for label, line in WHATIF:
        if args.only and args.only not in label:
            continue
        with tempfile.TemporaryDirectory() as cache:
            env["SIMDDP_CACHE_DIR"] = cache
            cmd = [py, "-m", "simddp", "whatif", *line.split(), *COMMON]
            cold = _measured(cmd, env, root)  # the lines name files of the checkout
            warm = _measured(cmd, env, root)
        if cold[2].returncode or warm[2].returncode:
            sys.exit(f"whatif {line} failed: {cold[2].stderr or warm[2].stderr}")
        print(f"   {label:22} {cold[0]:8.1f}s {cold[1]:5.1f}s   {warm[0]:8.1f}s {warm[1]:5.1f}s   "
              f"{cold[1] / warm[1]:12.1f}x  {cold[2].stdout == warm[2].stdout}")
    print(f"   load average {os.getloadavg()[0]:.1f} at the end")



if __name__ == "__main__":
    main()
