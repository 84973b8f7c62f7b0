"""Benchmark: capture of a pipeline-parallel Llama 3 step at real size, without arithmetic.

Each row is one :func:`simddp.cosim.capture_pp.capture_pp` on the meta device (torch's real
``PipelineStage`` objects and schedule, two steps, the last recorded, under co-simulation with
an H100 roofline) in a fresh subprocess: its wall time, the CPU time it used (on a shared
machine the fairer figure), the child's peak RSS, and what it captured (stages, the
co-simulated step time).

    python ci/bench_capture_pp.py [--configs 8b:4:1F1B,70b:4:1F1B,8b:4:1F1B:shard=2]
        [--microbatches 4] [--seq-len 8192]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys, time
size, pp, schedule, mesh, m, seq = sys.argv[1:7]
from fakepg.zoo import workloads
from simddp import Compute, Timing
from simddp.cosim.capture_pp import capture_pp
mesh = dict((k, int(v)) for k, v in (kv.split("=") for kv in mesh.split("+") if kv))
sc = workloads.WORKLOADS["llama3-" + size](batch_size=int(m), seq_len=int(seq))
t0, c0 = time.perf_counter(), time.process_time()
cap = capture_pp(sc, int(pp), schedule=schedule, microbatches=int(m), mesh=mesh or None,
                 stages_per_rank=1 if schedule in ("GPipe", "1F1B") else 2,
                 device="meta", timing=Timing(compute=Compute.roofline("h100")))
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "world": cap.world_size, "stages": len(cap.stages),
                  "step_s": cap.cosim_iteration_time}))
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="8b:4:1F1B,70b:4:1F1B,8b:4:1F1B:shard=2",
                    help="size:pp:schedule[:dim=n+dim=n], comma-separated")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192)
    a = ap.parse_args(argv)
    print(f"{'config':<28} {'world':>5} {'wall s':>7} {'cpu s':>6} {'RSS MB':>7} "
          f"{'step s':>8}")
    for config in a.configs.split(","):
        size, pp, schedule, *mesh = config.split(":")
        out = subprocess.run([sys.executable, "-c", _CHILD, size, pp, schedule,
                              mesh[0] if mesh else "", str(a.microbatches), str(a.seq_len)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{config:<28} failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{config:<28} {r['world']:>5} {r['wall']:>7.1f} {r['cpu']:>6.1f} "
              f"{r['rss_mb']:>7.0f} {r['step_s']:>8.3f}")


if __name__ == "__main__":
    main()
