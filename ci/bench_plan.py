"""simddp plan's speed and answers at the issue's scales, cold (no capture cache):

* Llama 3 70B on 256 H100 (DGX H100 fabric), sequence 8,192, 1,024 sequences a step — goal:
  at least 100 layouts evaluated (given a memory verdict or replayed) in at most 5 minutes;
* Llama 3.1 405B on 16,384 H100, sequence 8,192, 2,048 sequences a step (16M tokens, the
  Llama 3 paper's batch) — goal: at most 10 minutes.

For each it prints the layouts, captures, replays, wall time, the top 5, and where the layout
practitioners published lands (torchtitan's 70B FSDP 32 × TP 8 on 256 H100; the Llama 3
paper's 405B TP 8 × PP 16 × DP 128 on 16,384 H100, interleaved 1F1B).

    python ci/bench_plan.py            # both
    python ci/bench_plan.py 70b        # one
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import tempfile
import time

CASES = {
    "70b": dict(model="llama3-70b", gpus=256, global_batch=1024,
                published=("fsdp:32,tp:8", None, "torchtitan docs/performance.md, Table 4"),
                goal_s=300),
    "405b": dict(model="llama3-405b", gpus=16384, global_batch=2048,
                 published=("pp:16,fsdp:128,tp:8", "Interleaved1F1B",
                            "The Llama 3 Herd of Models, Table 4"),
                 goal_s=600),
}


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        one, five, fifteen = f.read().split()[:3]
    return f"load average {one}, {five}, {fifteen} on {os.cpu_count()} CPUs"


def _cpu() -> float:
    """CPU seconds (user + system) of this process and its ended children."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def run(name: str) -> None:
    from simddp.plan import plan

    case = CASES[name]
    spec, sched, source = case["published"]
    print(f"{name}: start, {_uptime()}", flush=True)
    t0 = time.perf_counter()
    cpu0 = _cpu()
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 2) as pool:  # captures, replays
        res = plan(case["model"], gpus=case["gpus"], gpu="h100", network="dgx-h100",
                   seq_len=8192, global_batch=case["global_batch"], top=5, executor=pool,
                   status=lambda s: print(f"  [{time.perf_counter() - t0:6.1f} s] {s}",
                                          flush=True))
    wall = time.perf_counter() - t0
    cpu = _cpu() - cpu0  # the pool's workers have ended: their CPU is counted
    f = res.facts
    print(f"\n{case['model']} on {case['gpus']} H100: {f['layouts']} layouts, "
          f"{f['dropped_by_rules']} dropped by rules, {f['bounded']} by the compute "
          f"bound of {f['probes']} probes, {f['evaluated']} evaluated (memory verdict or "
          f"replay: goal >= 100), {f['replayed']} replayed from {f['captures']} captures "
          f"({f['capture_seconds']:.0f} s capturing); {f['feasible']} fit; wall "
          f"{wall:.0f} s (goal {case['goal_s']} s); {_uptime()}")
    print(f"  CPU: {cpu:.0f} s (this process and its pool's workers, user + system; "
          f"{cpu / (os.cpu_count() or 2):.0f} s on each of {os.cpu_count()} CPUs: the wall "
          f"time on a machine running nothing else, at best)")
    for kind, (n, cap_s, job_s) in f["by_kind"].items():
        cap_cpu, job_cpu = f["cpu_by_kind"][kind]
        print(f"  {kind} steps: {n} captures, {cap_s:.0f} s capturing ({cap_cpu:.0f} CPU s), "
              f"{job_s:.0f} s with their memory verdicts and replays ({job_cpu:.0f} CPU s)")
    print(res.table(), end="")
    _check_bounds(res, case["model"])
    ranked = [c for c in res.candidates if c.feasible]
    ranked.sort(key=lambda c: -c.tokens_per_s_per_gpu)
    mine = [c for c in res.candidates if c.parallel == spec and
            (sched is None or c.layout.schedule == sched)]
    print(f"published layout {spec}{' ' + sched if sched else ''} ({source}):")
    for c in mine:
        if c.feasible:
            print(f"  {c.layout.label()}: rank {ranked.index(c) + 1} of {len(ranked)} feasible, "
                  f"{c.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                  f"{c.tokens_per_s_per_gpu / ranked[0].tokens_per_s_per_gpu:.1%} of the best "
                  f"({ranked[0].layout.label()}), peak {c.peak_memory_bytes / (1 << 30):.1f} GiB")
        else:
            print(f"  {c.layout.label()}: not feasible ({c.stage}): {c.reason}")
    if not mine:
        print("  not enumerated")


def _check_bounds(res, model: str) -> None:
    """The probes' compute bound and memory floor against every layout evaluated for real."""
    from simddp.plan import LlamaWorkload, Shape
    from simddp.plan.search import _bound, memory_floor

    f, shape = res.facts, Shape.of_llama(model, LlamaWorkload(model, 8192).args())
    over = under = checked = 0
    for c in res.candidates:
        lay = c.layout
        k = f"tp:{lay.tp},ac:{lay.ac},microbatch:{lay.microbatch}"
        blk = f["probe_block_activation_bytes"].get(f"tp:{lay.tp},ac:{lay.ac},microbatch:1")
        c_mb = f["probe_compute_s"].get(k)
        if c.stage not in ("memory", "replay") or c.peak_memory_bytes is None or lay.cp > 1:
            continue
        checked += 1
        if blk and memory_floor(lay, shape, blk) > c.peak_memory_bytes:
            over += 1
        if c_mb and c.tokens_per_s_per_gpu and c.tokens_per_s_per_gpu > _bound(lay, c_mb, 8192):
            under += 1
    print(f"bounds checked on {checked} evaluated layouts: {over} memory floors above the "
          f"planned peak, {under} replays above their compute bound (both must be 0)")


def main() -> None:
    os.environ.setdefault("SIMDDP_CACHE_DIR", tempfile.mkdtemp(prefix="simddp-bench-plan-"))
    for name in sys.argv[1:] or list(CASES):
        run(name)


if __name__ == "__main__":
    main()
