"""Benchmark: what the command line costs before it answers, and what the capture cache saves.

1. ``simddp --help`` and ``simddp whatif --help`` (each in a fresh process, median of
   --rounds) beside ``python -c "import torch"``: help loads no torch, so it costs a Python
   start and the argument parser.
2. ``simddp whatif WORKLOAD --parallel SPEC`` cold (an empty cache directory: the capture
   runs) and warm (the same command again: the capture loads from the cache), each a fresh
   process, with the ratio; and whether both printed the same table.

    python ci/bench_cli.py [--rounds 3] [--workload llama3-8b] [--parallel fsdp]
        [--world-size 64,512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="llama3-8b")
    ap.add_argument("--parallel", default="fsdp")
    ap.add_argument("--world-size", default="64,512")
    args = ap.parse_args()
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if k != "SIMDDP_NO_CACHE"}
    print("1. help without torch (median of fresh processes)")
    rows = {"simddp --help": [py, "-m", "simddp", "--help"],
            "simddp whatif --help": [py, "-m", "simddp", "whatif", "--help"],
            "python -c 'import torch'": [py, "-c", "import torch"]}
    for name, cmd in rows.items():
        times = [_timed(cmd, env)[0] for _ in range(args.rounds)]
        print(f"   {name:28} {statistics.median(times):6.2f} s")
    print(f"2. simddp whatif {args.workload} --parallel {args.parallel} --world-size "
          f"{args.world_size}: cold vs warm capture cache")
    with tempfile.TemporaryDirectory() as cache:
        env["SIMDDP_CACHE_DIR"] = cache
        cmd = [py, "-m", "simddp", "whatif", args.workload, "--parallel", args.parallel,
               "--world-size", args.world_size, "--no-progress"]
        cold, first = _timed(cmd, env)
        warm, second = _timed(cmd, env)
    if first.returncode or second.returncode:
        sys.exit(f"whatif failed: {first.stderr or second.stderr}")
    print(f"   cold {cold:6.1f} s   warm {warm:6.1f} s   cold/warm {cold / warm:4.1f}x   "
          f"same table: {first.stdout == second.stdout}")


if __name__ == "__main__":
    main()
