"""simddp's predictions against real multi-process gloo DDP on this machine: an error table.

What runs (all on the machine at hand, gloo over loopback, one intra-op thread per rank):

1. ``simddp calibrate``'s measurement (:func:`simddp.measure.measure`): all_reduce at
   4 KiB–32 MiB on 2 and 4 real gloo processes -> :class:`simddp.MeasuredNetwork`; and its
   contention measurement (:func:`simddp.measure.measure_contention`: a matmul alone
   vs while a gloo all_reduce runs, the cost of issuing one) -> :class:`simddp.Contention`;
2. real DDP training (``torch.multiprocessing``, one process per rank, ``TrainLoop``'s model,
   optimizer and batches) for each workload × world size × bucket cap, plus two references per
   world size: ``no_sync`` (DDP without its all_reduce: compute and the rank's share of the
   machine) and ``nodp`` (the plain model, no DDP, ``world size`` processes side by side — the
   contention calibration, which involves no communication). Repetitions are interleaved
   (round-robin over configurations, ``--rounds`` times) and each cell reports the median of
   the per-round medians and the min–max spread, so the noise is visible;
3. predictions with the public what-if path (:func:`simddp.whatif.whatif`):
   * ``solo``: compute scaled to the one-process step time (``--step-time``, the path of ``simddp whatif``);
   * ``shared``: compute scaled to the ``nodp`` step time at that world size (ranks sharing the
     machine's cores, measured without any communication);
   * ``+cont.``: ``shared`` on the same measured network carrying the measured contention
     (compute slowed while the rank's all_reduce runs, a fixed cost per issued collective).

Columns: measured iteration time (ms, median [min–max over rounds]), each prediction and its
error; exposed communication measured as T(DDP) − T(no_sync) against the predicted
T(DDP) − T(no communication) (the same replay on a network of ~zero cost, no contention);
then the what-if orderings (bucket cap 1 vs 25 MB, world size 2 → 4), measured against
predicted without and with contention.

    .venv/bin/python ci/validate_simddp.py              # ~5 minutes on 2 cores
    .venv/bin/python ci/validate_simddp.py --quick      # one workload, 2 rounds
    .venv/bin/python ci/validate_simddp.py --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fakepg import zoo  # noqa: E402
from simddp import Compute, Contention, MeasuredNetwork, Network  # noqa: E402
from simddp.measure import contention_of, measure, measure_contention  # noqa: E402
from simddp.whatif import whatif  # noqa: E402

WORKLOADS = {  # name -> zoo overrides; sized so that gradients are MBs (buckets matter)
    "mlp-1024": ("mlp", dict(depth=4, width=1024, batch_size=64)),
    "mlp-512x8": ("mlp", dict(depth=8, width=512, batch_size=128)),
}
WARMUP, ITERS = 3, 10


def _scenario(workload: str):
    name, kw = WORKLOADS[workload]
    return zoo.get(name, iterations=WARMUP + ITERS, **kw)


def _rank(rank: int, world: int, store: str, out: str, workload: str, mode: str,
          cap: float | None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        sc = _scenario(workload)
        if mode == "nodp":
            model = sc.build_model()
        else:
            model = zoo.TrainLoop().build(sc, bucket_cap_mb=cap)
        opt = sc.optimizer(model.parameters())
        times = []
        dist.barrier()
        for batch in sc.inputs(rank, world):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with model.no_sync() if mode == "nosync" else nullcontext():
                sc.step(model, batch).backward()
            opt.step()
            times.append(time.perf_counter() - t)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(statistics.median(times[WARMUP:]), f)
    finally:
        dist.destroy_process_group()


def run_real(workload: str, world: int, mode: str, cap: float | None) -> float:
    """Median iteration seconds of the slowest rank."""
    import torch.multiprocessing as mp

    for attempt in range(3):
        tmp = tempfile.mkdtemp(prefix="simddp-validate-")
        try:
            mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), tmp, workload,
                                            mode, cap), nprocs=world, start_method="fork")
            return max(json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world))
        except mp.ProcessExitedException as e:  # gloo's occasional abort at teardown: again
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise AssertionError("unreachable")


def predict(workload: str, world: int, cap: float, nets: list, step_s: float) -> list[dict]:
    """Per network of ``nets`` (one capture): iteration time and the comm it adds over a
    network of ~zero cost (appended last)."""
    zero = Network(bandwidth_GBps=1e9, latency_us=0.0, name="zero")
    rows = whatif(_scenario(workload).with_(iterations=1), world_size=world,
                  network=[*nets, zero], bucket_cap_mb=cap, compute=Compute.roofline("cpu"),
                  step_time_s=step_s)
    t0 = rows[len(nets)]["iteration_time_s"]
    return [{"iter": r["iteration_time_s"], "exposed": r["iteration_time_s"] - t0}
            for r in list(rows)[:len(nets)]]


def _err(pred: float, real: float) -> float:
    return 100.0 * (pred - real) / real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--caps", default="1,25")
    ap.add_argument("--quick", action="store_true", help="first workload, 2 rounds")
    ap.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown")
    args = ap.parse_args()
    torch.set_num_threads(1)
    workloads = args.workloads.split(",")[:1] if args.quick else args.workloads.split(",")
    rounds = 2 if args.quick else args.rounds
    worlds = [int(w) for w in args.world_sizes.split(",")]
    caps = [float(c) for c in args.caps.split(",")]

    t0 = time.perf_counter()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; calibrating the network (all_reduce, gloo) ...", flush=True)
    sizes = [1 << k for k in (12, 14, 16, 18, 20, 22, 24, 25)]
    measured = measure(world_sizes=worlds, sizes=sizes, reps=5)
    cont_doc = contention_of(measure_contention(world_sizes=worlds, reps=5))
    cont = Contention.from_dict(cont_doc)
    for r in cont_doc["measurements"]:
        print(f"contention, {r['world_size']} ranks: compute x{r['slowdown']:.2f} beside an "
              f"all_reduce (the all_reduce x{r['comm_slowdown']:.2f}); issuing one "
              f"{r['per_collective_us']:.0f} us", flush=True)
    net = MeasuredNetwork(measured, name="measured-gloo")
    net_c = MeasuredNetwork(measured, name="measured-gloo+contention", contention=cont)

    configs = [(w, 1, "nodp", None) for w in workloads]
    for w in workloads:
        for n in worlds:
            configs += [(w, n, "nodp", None), (w, n, "nosync", caps[-1])]
            configs += [(w, n, "ddp", c) for c in caps]
    samples: dict[tuple, list[float]] = {c: [] for c in configs}
    for r in range(rounds):  # interleaved: every configuration once per round
        for c in configs:
            samples[c].append(run_real(*c))
        print(f"round {r + 1}/{rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    med = {c: statistics.median(v) for c, v in samples.items()}

    lines = [f"contention (measured, medians over world sizes): compute x{cont.slowdown:.2f} "
             f"while the rank's all_reduce runs; {cont.per_collective_us:.0f} us per issued "
             f"collective", "",
             "| workload | ranks | cap MB | measured ms [spread] | shared ms (err) "
             "| +cont. ms (err) | exposed meas. ms | exposed pred. ms | +cont. ms |",
             "|" + "---|" * 9]
    errs: dict[str, list[float]] = {"solo": [], "shared": [], "cont": []}
    exposed_ratio: dict[str, list[float]] = {"shared": [], "cont": []}
    preds: dict[str, dict[tuple, float]] = {"shared": {}, "cont": {}}
    for w in workloads:
        solo = med[(w, 1, "nodp", None)]
        for n in worlds:
            shared = med[(w, n, "nodp", None)]
            nosync = med[(w, n, "nosync", caps[-1])]
            for cap in caps:
                real = med[(w, n, "ddp", cap)]
                lo, hi = min(samples[(w, n, "ddp", cap)]), max(samples[(w, n, "ddp", cap)])
                (a,) = predict(w, n, cap, [net], solo)
                b, c = predict(w, n, cap, [net, net_c], shared)
                preds["shared"][(w, n, cap)] = b["iter"]
                preds["cont"][(w, n, cap)] = c["iter"]
                errs["solo"].append(abs(_err(a["iter"], real)))
                errs["shared"].append(abs(_err(b["iter"], real)))
                errs["cont"].append(abs(_err(c["iter"], real)))
                exposed = real - nosync
                if exposed > 0:
                    exposed_ratio["shared"].append(exposed / max(b["exposed"], 1e-9))
                    exposed_ratio["cont"].append(exposed / max(c["exposed"], 1e-9))
                lines.append(
                    f"| {w} | {n} | {cap:g} | {real * 1e3:.1f} [{lo * 1e3:.1f}–{hi * 1e3:.1f}] "
                    f"| {b['iter'] * 1e3:.1f} ({_err(b['iter'], real):+.0f} %) "
                    f"| {c['iter'] * 1e3:.1f} ({_err(c['iter'], real):+.0f} %) "
                    f"| {exposed * 1e3:.1f} | {b['exposed'] * 1e3:.1f} "
                    f"| {c['exposed'] * 1e3:.1f} |")
    lines.append("")
    lines.append(f"median |error| of iteration time: solo {statistics.median(errs['solo']):.0f} %, "
                 f"shared {statistics.median(errs['shared']):.0f} %, shared + contention "
                 f"{statistics.median(errs['cont']):.0f} % ({len(errs['shared'])} cells, "
                 f"{rounds} interleaved rounds)")
    if exposed_ratio["shared"]:
        lines.append(
            f"exposed comm, measured / predicted (median [range]): shared "
            f"{statistics.median(exposed_ratio['shared']):.2f}× "
            f"[{min(exposed_ratio['shared']):.2f}–{max(exposed_ratio['shared']):.2f}], "
            f"+ contention {statistics.median(exposed_ratio['cont']):.2f}× "
            f"[{min(exposed_ratio['cont']):.2f}–{max(exposed_ratio['cont']):.2f}]")
    lines.append("")
    lines.append("| what-if | measured | shared | same direction | + contention | same direction |")
    lines.append("|---|---|---|---|---|---|")
    agree = {"shared": 0, "cont": 0}
    total = 0

    def same(m: float, p: float) -> bool:
        return (m - 1) * (p - 1) > 0 or (abs(m - 1) < 0.05 and abs(p - 1) < 0.05)

    def row(label: str, num: tuple, den: tuple) -> None:
        nonlocal total
        m = med[(num[0], num[1], "ddp", num[2])] / med[(den[0], den[1], "ddp", den[2])]
        cells = []
        for kind in ("shared", "cont"):
            p = preds[kind][num] / preds[kind][den]
            ok = same(m, p)
            agree[kind] += ok
            cells.append(f"{p:.2f}× | {'yes' if ok else 'no'}")
        total += 1
        lines.append(f"| {label} | {m:.2f}× | {cells[0]} | {cells[1]} |")

    for w in workloads:
        for n in worlds:
            if len(caps) >= 2:
                row(f"{w}, {n} ranks: cap {caps[0]:g} / cap {caps[-1]:g} MB",
                    (w, n, caps[0]), (w, n, caps[-1]))
        for cap in caps:
            if len(worlds) >= 2:
                row(f"{w}, cap {cap:g} MB: {worlds[-1]} / {worlds[0]} ranks",
                    (w, worlds[-1], cap), (w, worlds[0], cap))
    lines.append("")
    lines.append(f"what-if directions right: shared {agree['shared']} of {total}, + contention "
                 f"{agree['cont']} of {total} (ratios within 5 % of 1 on both sides count as "
                 f"right); {time.perf_counter() - t0:.0f} s in all")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
