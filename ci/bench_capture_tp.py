"""Benchmark: capture of a Llama 3 training step with FSDP2 × tensor parallelism at real size,
on the meta device (no arithmetic), as ``simddp whatif --parallel fsdp:N,tp:T`` captures it.

Each row is one ``capture_fsdp(..., mesh={"shard": 2, "tp": T}, device="meta")`` (2 × T fake
ranks, torchtitan's TP plan, then FSDP2 on the shard submesh; two steps, the last recorded) in
a fresh subprocess: its wall time (the goal), the CPU time it used (the fairer figure on a
shared machine), the child's peak RSS, the TP collectives per rank and step, and the
co-simulated step. ``T = 1`` is the FSDP2-only capture beside it, for the ratio.

    python ci/bench_capture_tp.py [--models llama3-8b] [--tp 1,2,8] [--seq-len 8192]
"""

from __future__ import annotations

import os

from bench_capture_realsize import degree_sweep, timed_capture

_CHILD = timed_capture(
    setup="""name, tp, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from fakepg import zoo
from simddp.cosim.capture_fsdp import capture_fsdp
mesh = {"shard": 2, "tp": tp} if tp > 1 else {"shard": 2}""",
    capture="""cap = capture_fsdp(zoo.get(name, seq_len=seq), 2 * tp, timing=timing, mesh=mesh, device="meta")""",
    report='"tp_collectives": scope_events(cap, "tp"), "tp_param_gb": cap.tp_param_bytes / 1e9')


def main() -> None:
    print(f"{'workload':<12} {'tp':>3} {'ranks':>5} {'seconds':>8} {'cpu s':>6} "
          f"{'peak RSS MB':>11} {'TP colls':>8} {'TP-rank GB':>10} {'cosim iter s':>12}")
    first: dict[str, float] = {}  # each model's first row, for the ratio
    for name, tp, _, r in degree_sweep(__doc__, _CHILD, "tp", "1,2,8", 8192):
        base = first.setdefault(name, r["wall"])
        print(f"{name:<12} {tp:>3} {2 * tp:>5} {r['wall']:>8.1f} {r['cpu']:>6.1f} "
              f"{r['rss_mb']:>11} {r['tp_collectives']:>8} {r['tp_param_gb']:>10.2f} "
              f"{r['iteration']:>12.3f}   x{r['wall'] / base:.2f} of the first row",
              flush=True)
    print(f"goal: seconds per capture on this machine (load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
