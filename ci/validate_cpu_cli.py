"""The CPU check through the CLI, as a user would run it (docs/costs.md, issue 18 item 5).

A user's own script (an MLP, written below to ``out/cpu_check/user_mlp.py``) trained with
``torchrun`` + gloo at 2 and 4 ranks with 1 and 25 MB buckets, interleaved rounds; its
single-process step; then ``simddp calibrate`` (defaults) and ``simddp whatif SCRIPT
--network cal.json --step-time <single-process step>``, once as before and once with the host's
cores shared (``--host-cores N --ranks-per-host 4 --rank-threads 1``: the ranks of this one
machine share its cores). Prints measured vs predicted per cell, median |error| and the
bucket-size ranking per world size. Minutes; run it on a quiet machine.

    python ci/validate_cpu_cli.py [--rounds 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

USER_SCRIPT = r'''
import os, sys, time
import torch
import torch.nn as nn
from fakepg.zoo import Scenario

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 512))

def batches(rank, world_size):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g))
            for _ in range(4)]

def loss(output, batch):
    return nn.functional.mse_loss(output, batch[1])

def scenario(bucket_cap_mb=25.0):
    return Scenario("user_mlp", model, batches, loss=loss,
                    ddp_kwargs={"bucket_cap_mb": bucket_cap_mb})

if __name__ == "__main__":
    steps = int(sys.argv[1])
    m = model()
    data = batches(int(os.environ.get("RANK", 0)), 1)
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        m = DDP(m, bucket_cap_mb=float(os.environ["CAP_MB"]))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    times = []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss(m(data[i % 4][0]), data[i % 4]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if "WORLD_SIZE" in os.environ:
        t = torch.tensor([sorted(times[5:])[len(times[5:]) // 2]])  # this rank's median
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(float(t), flush=True)
        dist.barrier()
        os._exit(0)  # gloo's teardown can abort a rank after the work is done
    else:
        print(sorted(times[5:])[len(times[5:]) // 2])
'''


def _run(cmd: list[str], env: dict | None = None) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default="out/cpu_check")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    script = os.path.join(args.dir, "user_mlp.py")
    with open(script, "w") as f:
        f.write(USER_SCRIPT)
    py = sys.executable
    torchrun = os.path.join(os.path.dirname(py), "torchrun")
    cells = [(n, cap) for n in (2, 4) for cap in (1, 25)]
    single, measured = [], {c: [] for c in cells}
    for r in range(args.rounds):  # interleaved: the machine's load drifts
        # one thread, as torchrun gives each rank (OMP_NUM_THREADS=1 by default): the same
        # single-process step a rank would take alone
        single.append(float(_run([py, script, str(args.steps)],
                                 {"OMP_NUM_THREADS": "1"}).split()[-1]))
        for n, cap in cells:
            out = _run([torchrun, "--standalone", f"--nproc_per_node={n}", script,
                        str(args.steps)], {"CAP_MB": str(cap), "OMP_NUM_THREADS": "1"})
            measured[(n, cap)].append(float(out.split()[-1]))
    step = statistics.median(single)
    cal = os.path.join(args.dir, "cal.json")
    simddp = [py, "-m", "simddp"]
    _run(simddp + ["calibrate", "--world-size", "2,4", "--json", cal])
    cores = os.cpu_count() or 1
    variants = {"before": [], f"+cores ({cores})": ["--host-cores", str(cores),
                                                    "--ranks-per-host", "4",
                                                    "--rank-threads", "1"]}
    pred: dict[str, dict] = {}
    for name, extra in variants.items():
        rows_path = os.path.join(args.dir, f"rows_{name.split()[0]}.json")
        _run(simddp + ["whatif", script, "--network", cal, "--gpu", "cpu", "--step-time",
                       repr(step), "--world-size", "2,4", "--bucket-cap-mb", "1,25",
                       "--no-progress", "--json", rows_path] + extra)
        with open(rows_path) as f:
            rows = json.load(f)
        pred[name] = {(r["world_size"], r["bucket_cap_mb"]): r["iteration_time_s"]
                      for r in rows}
    print(f"single-process step (median of {args.rounds}): {step * 1e3:.1f} ms; "
          f"{cores} cores")
    print(f"{'ranks':>5} {'cap MB':>6} {'measured ms':>12}  " + "  ".join(
        f"{n:>14} {'err':>6}" for n in variants))
    for (n, cap) in cells:
        m = statistics.median(measured[(n, cap)])
        cols = []
        for name in variants:
            p = pred[name][(n, float(cap))]
            cols.append(f"{p * 1e3:>14.1f} {100 * (p - m) / m:>+6.1f}")
        print(f"{n:>5} {cap:>6} {m * 1e3:>12.1f}  " + "  ".join(cols)
              + f"   (rounds: {', '.join(f'{x * 1e3:.1f}' for x in measured[(n, cap)])})")
    for name in variants:
        errs = [abs(pred[name][(n, float(c))] - statistics.median(measured[(n, c)]))
                / statistics.median(measured[(n, c)]) * 100 for n, c in cells]
        ranks = sum((pred[name][(n, 1.0)] < pred[name][(n, 25.0)]) ==
                    (statistics.median(measured[(n, 1)]) < statistics.median(measured[(n, 25)]))
                    for n in (2, 4))
        print(f"{name}: median |error| {statistics.median(errs):.1f} %; bucket-size ranking "
              f"right at {ranks} of 2 world sizes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
