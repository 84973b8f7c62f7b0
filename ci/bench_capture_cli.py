"""Benchmark: `simddp whatif` cold, at real size, for the zoo's Llama 3 8B / 70B / 405B layouts,
and the representative capture beside the whole-world capture it replaces.

Part 1 runs each command line below in a fresh interpreter (cold: imports, the capture on the
meta device, the replays, the table) and prints its wall time and the CPU time of the child
(on a shared machine the fairer figure). The goal (issue 25, DESIGN.md point 24): every layout
≤ 60 s on this 2-core machine. The captures behind them run one rank per distinct role
(:mod:`simddp.cosim.represent`) and pipelines as a shallow pipeline deepened
(:func:`simddp.cosim.deepen.capture_pipeline`), so their cost is the model's, not the world's.

Part 2 captures layouts both ways side by side, each in a fresh interpreter: the whole world
(``representatives=False``, and for pipelines ``shallow=False``: what the CLI ran before) and
the representative one, with the ratio and the rank programs each ran — the old one where it
is affordable (its cost grows with tp × the ranks of a stage and with pp; ``--old-all`` runs
it everywhere).

    python ci/bench_capture_cli.py [--only 405b] [--skip-cli] [--skip-old]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = "--network dgx-h100 --gpu h100 --no-progress"
CLI = [  # (label, whatif arguments)
    ("8B fsdp, 64 GPUs", "llama3-8b --parallel fsdp --world-size 64"),
    ("8B fsdp:64,tp:8 (512)", "llama3-8b --parallel fsdp:64,tp:8"),
    ("70B fsdp:32,tp:8 (256)", "llama3-70b --parallel fsdp:32,tp:8"),
    ("405B fsdp, 1024 GPUs", "llama3-405b --parallel fsdp --world-size 1024 "
     "--param-dtype bf16 --reduce-dtype fp32"),
    ("8B pp:4,fsdp:16,tp:8 1F1B+Int.", "llama3-8b --parallel pp:4,fsdp:16,tp:8 "
     "--pp-schedule 1f1b,interleaved1f1b --microbatches 8,16 --param-dtype bf16 "
     "--reduce-dtype fp32"),
    ("405B pp:8,fsdp:8,tp:8 1F1B", "llama3-405b --parallel pp:8,fsdp:8,tp:8 --pp-schedule 1f1b "
     "--param-dtype bf16 --reduce-dtype fp32"),
    ("405B pp:8,fsdp:8,tp:8 Interleaved", "llama3-405b --parallel pp:8,fsdp:8,tp:8 "
     "--pp-schedule interleaved1f1b --param-dtype bf16 --reduce-dtype fp32"),
    ("405B pp:16,fsdp:128,tp:8 Int. (16384)", "llama3-405b --parallel pp:16,fsdp:128,tp:8 "
     "--pp-schedule interleaved1f1b --param-dtype bf16 --reduce-dtype fp32"),
]

_CAPTURE = r"""
import json, sys, time
kind, name, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.cosim import represent
timing = Timing(network=Network.preset("dgx-h100"), compute=Compute.roofline("h100"))
old = kind == "old"
t0, c0 = time.perf_counter(), time.process_time()
if "pp" in spec:
    from simddp.cosim.deepen import capture_pipeline
    pp, m = spec.pop("pp"), spec.pop("microbatches")
    cap = capture_pipeline(zoo.get(name, batch_size=m), pp, microbatches=m, timing=timing,
                           device="meta", input_weight=1, output_weight=1,
                           representatives=not old, shallow=not old, **spec)
    step = cap.cosim_iteration_time
else:
    from simddp.cosim.capture_fsdp import capture_fsdp
    mesh = spec["mesh"]
    n = 1
    for v in mesh.values():
        n *= v
    cap = capture_fsdp(zoo.get(name), n, mesh=mesh, timing=timing, device="meta",
                       representatives=not old)
    step = cap.cosim_iteration_time
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "ranks_run": represent.executed()}))
"""

CAPTURES = [  # (label, workload, capture spec, old by default): what whatif captures
    ("8B fsdp:N,tp:8", "llama3-8b", {"mesh": {"shard": 2, "tp": 8}}, True),
    ("70B fsdp:N,tp:8", "llama3-70b", {"mesh": {"shard": 2, "tp": 8}}, False),
    ("8B pp:4,fsdp:N,tp:8 Interleaved", "llama3-8b",
     {"pp": 4, "microbatches": 4, "schedule": "Interleaved1F1B", "stages_per_rank": 2,
      "mesh": {"shard": 2, "tp": 8}, "param_dtype": "bf16", "reduce_dtype": "fp32"}, True),
    ("405B pp:16,fsdp:N,tp:8 Interleaved", "llama3-405b",
     {"pp": 16, "microbatches": 16, "schedule": "Interleaved1F1B", "stages_per_rank": 2,
      "mesh": {"shard": 2, "tp": 8}, "param_dtype": "bf16", "reduce_dtype": "fp32"}, False),
]


def _child(kind: str, name: str, spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _CAPTURE, kind, name, json.dumps(spec)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"capture {kind} {name} {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli(args: str) -> tuple[float, float, str]:
    exe = os.path.join(os.path.dirname(sys.executable), "simddp")
    before = os.times()
    t0 = time.perf_counter()
    out = subprocess.run([exe, "whatif", *shlex.split(args), *shlex.split(COMMON)],
                         capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system
                                                           - before.children_system)
    if out.returncode:
        return wall, cpu, "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1]
    return wall, cpu, "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the rows whose label contains this")
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--skip-old", action="store_true", help="part 2 without the old captures")
    ap.add_argument("--old-all", action="store_true",
                    help="the old capture of every row (the 70B one takes minutes, the 405B "
                         "pipeline's 512 fake ranks far longer)")
    a = ap.parse_args()
    if not a.skip_cli:
        print("part 1: simddp whatif, cold (a fresh process each)")
        print(f"{'layout':<40} {'wall s':>7} {'cpu s':>6}  load  result")
        for label, args in CLI:
            if a.only not in label:
                continue
            wall, cpu, what = _cli(args)
            print(f"{label:<40} {wall:>7.1f} {cpu:>6.1f} {os.getloadavg()[0]:>5.1f}  {what}",
                  flush=True)
    print("\npart 2: the capture, whole world (old) vs one rank per role (new), fresh processes")
    print(f"{'capture':<34} {'old s':>7} {'old cpu':>7} {'ranks':>5} {'new s':>7} "
          f"{'new cpu':>7} {'ranks':>5} {'old/new':>8}  load")
    for label, name, spec, by_default in CAPTURES:
        if a.only not in label:
            continue
        new = _child("new", name, dict(spec))
        run_old = not a.skip_old and (by_default or a.old_all)
        old = _child("old", name, dict(spec)) if run_old else None
        cols = (f"{old['wall']:>7.1f} {old['cpu']:>7.1f} {old['ranks_run']:>5}" if old else
                f"{'-':>7} {'-':>7} {'-':>5}")
        ratio = f"x{old['wall'] / new['wall']:.1f}" if old else "-"
        print(f"{label:<34} {cols} {new['wall']:>7.1f} {new['cpu']:>7.1f} "
              f"{new['ranks_run']:>5} {ratio:>8} {os.getloadavg()[0]:>5.1f}", flush=True)
    print(f"\ngoal: every layout cold <= 60 s (load average now {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; wall time on a loaded machine is mostly waiting for a core)")


if __name__ == "__main__":
    main()
