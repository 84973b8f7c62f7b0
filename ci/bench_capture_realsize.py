"""Benchmark: capture of a Llama 3 8B / 70B training step at real size, without arithmetic.

Each capture runs torch's real DDP or FSDP2 step (three iterations: forward, backward, AdamW
step) on the fake cluster with every tensor on the meta device, under co-simulation with an
H100 roofline (``simddp.cosim.capture.capture_workload``), and records the last iteration.
Each row is one capture in a fresh subprocess: its wall time (seconds, the goal) and the CPU
time it used (on a shared machine the fairer figure: wall time there includes waiting for a
core), the child's peak RSS (getrusage(RUSAGE_CHILDREN) in a small launcher whose only child it is), and what it
captured (parameters, collectives per rank, the co-simulated iteration time). A first row
("import") is a child that only loads simddp and torch: the floor of every RSS figure. For
scale: the same step on real tensors would hold about 16 bytes per parameter per rank (fp32
weights, gradients, AdamW's two moments; DDP) — 128 GB per rank for 8B.

    python ci/bench_capture_realsize.py [--models llama3-8b,llama3-70b]
        [--parallel ddp,fsdp] [--world-sizes 2,8] [--seq-len 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Iterator

_CHILD = r"""
import json, sys, time
name, parallel, ws, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import torch  # noqa: F401
from simddp.cosim.capture import capture_workload
if name == "import":
    print(json.dumps({}))
    raise SystemExit
t0, c0 = time.perf_counter(), time.process_time()
cap = capture_workload(name, ws, parallel=parallel, seq_len=seq)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"wall": wall, "cpu": cpu, "params": sum(p.numel for p in cap.params),
                  "collectives": len(cap.profiles[0].collectives),
                  "iteration": cap.cosim_iteration_time}))
"""

_LAUNCHER = r"""
import resource, subprocess, sys
out = subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], capture_output=True,
                     text=True)
if out.returncode:
    sys.stderr.write(out.stderr)
    raise SystemExit(out.returncode)
line = out.stdout.strip().splitlines()[-1]
print(line[:-1] + ("," if line != "{}" else "") +
      f' "rss_mb": {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}}}')
"""


def run_child(child: str, *args: str) -> dict:
    """Run ``child`` (Python source printing one JSON object last) with ``args`` in a fresh
    interpreter from the repository root; its JSON with the peak RSS (``rss_mb``) added."""
    out = subprocess.run([sys.executable, "-c", _LAUNCHER, child, *args], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if out.returncode:
        raise SystemExit(f"capture {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed_capture(setup: str, capture: str, report: str) -> str:
    """A child's source for :func:`run_child`: ``setup`` (reading ``sys.argv``, imports), then
    ``capture`` (statements binding ``cap``, with ``timing``: an H100 roofline on dgx-h100)
    timed, then one JSON line: ``wall``, ``cpu``, the co-simulated ``iteration`` and
    ``report`` (the items of a dict literal, over ``cap``; ``scope_events(cap, scope)``: rank
    0's collectives on a mesh dimension in the step)."""
    return f"""
import json, sys, time
from simddp import Compute, Network, Timing
timing = Timing(network=Network.preset("dgx-h100"), compute=Compute.roofline("h100"))
def scope_events(cap, scope):
    return sum(e["scope"] == scope for ph in cap.profiles[0].values() for e in ph["events"])
{setup}
t0, c0 = time.perf_counter(), time.process_time()
{capture}
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({{"wall": wall, "cpu": cpu, "iteration": cap.cosim_iteration_time,
                  {report}}}))
"""


def degree_sweep(doc: str, child: str, degree: str, degrees: str, seq_len: int
                 ) -> Iterator[tuple[str, int, int, dict]]:
    """A bench sweeping one parallel degree: reads its command line (``--models``, default
    llama3-8b; ``--DEGREE``, comma-separated, default ``degrees``; ``--seq-len``) and runs
    ``child`` with (model, degree, sequence length) for each model and degree, yielding them
    with the child's JSON."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-8b")
    ap.add_argument(f"--{degree}", default=degrees)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    a = ap.parse_args()
    for name in a.models.split(","):
        for d in (int(x) for x in getattr(a, degree).split(",")):
            yield name, d, a.seq_len, run_child(child, name, str(d), str(a.seq_len))


def _run(name: str, parallel: str, ws: int, seq: int) -> dict:
    return run_child(_CHILD, name, parallel, str(ws), str(seq))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--parallel", default="ddp,fsdp")
    ap.add_argument("--world-sizes", default="2,8")
    ap.add_argument("--seq-len", type=int, default=8192)
    a = ap.parse_args()
    base = _run("import", "ddp", 1, a.seq_len)
    print(f"import only (simddp + torch): peak RSS {base['rss_mb']} MB")
    print(f"{'workload':<12} {'parallel':<8} {'ranks':>5} {'seconds':>8} {'cpu s':>6} "
          f"{'peak RSS MB':>11} "
          f"{'parameters':>15} {'colls/rank':>10} {'cosim iter s':>12}")
    worst = 0.0
    for name in a.models.split(","):
        for parallel in a.parallel.split(","):
            for ws in (int(w) for w in a.world_sizes.split(",")):
                r = _run(name, parallel, ws, a.seq_len)
                worst = max(worst, r["wall"])
                print(f"{name:<12} {parallel:<8} {ws:>5} {r['wall']:>8.1f} {r['cpu']:>6.1f} "
                      f"{r['rss_mb']:>11} "
                      f"{r['params']:>15,} {r['collectives']:>10} {r['iteration']:>12.3f}",
                      flush=True)
    print(f"goal: seconds per capture on this machine; slowest here {worst:.1f} s "
          f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
