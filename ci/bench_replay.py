"""Benchmark: trace-driven replay at scale, and a what-if sweep.

1. Capture one DDP iteration of an 8-layer MLP (1024 wide, 32 MiB of fp32 parameters) on 2 fake
   ranks under co-simulation (A100 roofline, 100 GbE), and check that replaying it at 2 ranks
   reproduces the co-simulated iteration time.
2. Replay it at 512, 1024 and 4096 ranks (best of --rounds, side by side in one run): wall time
   and wall time per simulated rank, plain DDP and with PowerSGD (3 collectives per bucket
   and a callback per rank and bucket: the heaviest knob), with jitter (every rank distinct:
   the vectorised engine).
3. Scale: at each of --scale (default 65,536 and 1,000,000 ranks), plain DDP with one
   straggler, each replay in a fresh subprocess (its peak RSS: getrusage(RUSAGE_CHILDREN) in
   a small launcher process whose only child it is, so every figure is separate; "import" is
   a child that only loads simddp and the capture): in classes of identical ranks (the
   default), per rank (``per_rank=True``, the path before classes), with jitter 0.02
   (per-rank noise: every rank distinct, the vectorised engine; --no-noise skips it) and with
   jitter 0.02 on the per-rank simpy engine (``engine="simpy"``, the path before the
   vectorised engine). --no-old skips both "before" rows. Median wall of --scale-rounds for
   the class path and the vectorised one, of --slow-rounds for the others; the before/after
   ratios, and whether both gave the same result (sha256 of ``to_json()`` for classes; of the
   iteration ends and the collectives for the two engines, whose exposed-comm sums may differ
   in the last bit).
4. A what-if table: world size × network × bucket_cap_mb × fp16 hook → iteration time and
   exposed communication; written as CSV and a PNG under --out (default /tmp/simddp_sweep).

    python ci/bench_replay.py [--rounds 3] [--out /tmp/simddp_sweep] [--scale 65536,1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from fakepg import zoo as models  # the scenario zoo, installed as fakepg.zoo
from simddp import Compute, Network, Timing
from simddp.replay import replay, write_csv
from simddp import capture, sweep


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:9.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/simddp_sweep")
    p.add_argument("--scale", default="65536,1000000",
                   help="world sizes for the scale section, comma-separated (empty: skip)")
    p.add_argument("--scale-rounds", type=int, default=3, help="rounds of the class path")
    p.add_argument("--slow-rounds", type=int, default=1,
                   help="rounds of the per-rank path and of the noisy replay")
    p.add_argument("--no-old", action="store_true", help="skip the per-rank (old) path")
    p.add_argument("--no-noise", action="store_true", help="skip the noisy replay")
    p.add_argument("--scale-only", action="store_true", help="only the scale section")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        return _child(json.loads(a._child))
    os.makedirs(a.out, exist_ok=True)

    net0 = Network.preset("100gbe")
    sc = models.get("mlp", depth=8, width=1024, batch_size=32, iterations=3)
    t = time.perf_counter()
    cap = capture(sc, 2, timing=Timing(network=net0, compute=Compute.roofline("a100")))
    t_cap = time.perf_counter() - t
    cap.save(os.path.join(a.out, "capture.json"))
    mib = cap.param_bytes / 2**20
    print(f"capture: {sc.description}, {len(cap.params)} parameters ({mib:.1f} MiB), "
          f"{len(cap.bucket_indices)} buckets, 2 ranks co-simulated in {t_cap:.2f} s (wall)")
    if a.scale_only:
        _scale(a, os.path.join(a.out, "capture.json"))
        return 0
    same = replay(cap, network=net0)
    err = same.iteration_time / cap.cosim_iteration_time - 1
    print(f"validation: replay at 2 ranks {same.iteration_time * 1e3:.4f} ms vs co-simulation "
          f"{cap.cosim_iteration_time * 1e3:.4f} ms: error {err:+.3%}")

    print(f"\nreplay wall time (best of {a.rounds}), ib-ndr with 8 GPUs per node:")
    net = Network.preset("ib-ndr", gpus_per_node=8)
    print(f"  {'ranks':>6} {'hook':>9} {'best s':>8} {'median s':>9} {'µs/rank':>8} "
          f"{'iteration ms':>13} {'events/s':>9}")
    for hook in (None, "powersgd"):
        for n in (512, 1024, 4096):
            walls = []
            for _ in range(a.rounds):
                res = replay(cap, n, network=net, comm_hook=hook, jitter=0.02)
                walls.append(res.wall_time)
            best = min(walls)
            ncoll = sum(res.rank_collectives)
            print(f"  {n:>6} {str(hook):>9} {best:8.3f} {statistics.median(walls):9.3f} "
                  f"{best / n * 1e6:8.1f} {res.iteration_time * 1e3:13.3f} "
                  f"{ncoll / best:9.0f}")
    print("  (events/s: rank-collective participations simulated per wall second)")
    _scale(a, os.path.join(a.out, "capture.json"))

    grid = dict(world_size=[64, 512, 4096],
                network=[Network.preset("100gbe", gpus_per_node=8),
                         Network.preset("ib-ndr", gpus_per_node=8)],
                bucket_cap_mb=[5, 25], comm_hook=[None, "fp16"])
    t = time.perf_counter()
    rows = sweep(cap, **grid)
    t_sweep = time.perf_counter() - t
    print(f"\nwhat-if: {len(rows)} replays in {t_sweep:.2f} s (wall)")
    print(f"  {'ranks':>6} {'network':>8} {'cap MB':>6} {'hook':>5} {'buckets':>7} "
          f"{'iteration ms':>13} {'exposed ms':>11}")
    for r in rows:
        print(f"  {r['world_size']:>6} {r['network']:>8} {r['bucket_cap_mb']:>6} "
              f"{str(r['comm_hook']):>5} {r['buckets']:>7} {_fmt_ms(r['iteration_time_s']):>13} "
              f"{_fmt_ms(r['exposed_comm_s']):>11}")
    csv_path = os.path.join(a.out, "sweep.csv")
    write_csv(rows, csv_path)
    png_path = os.path.join(a.out, "sweep.png")
    _plot(rows, png_path)
    tl_path = os.path.join(a.out, "replay_timeline.png")
    replay(cap, 512, network=net, bucket_cap_mb=5, comm_hook="fp16",
           rank_speed={3: 0.8}).timeline.subset(range(6)).plot(
        tl_path, title="replay: 512 ranks, ib-ndr, 5 MB buckets, fp16, rank 3 at 0.8 (ranks 0-5)")
    print(f"\nwrote {csv_path}, {png_path}, {tl_path}, {os.path.join(a.out, 'capture.json')}")
    return 0


SCALE_KNOBS = dict(network="ib-ndr", gpus_per_node=8, rank_speed={17: 0.8})


def _child(spec: dict) -> int:
    """One measured replay (or, with world 0, only the imports and the capture's load)."""
    from simddp.replay import CapturedIteration

    cap = CapturedIteration.load(spec["capture"])
    out = {"wall": 0.0}
    if spec["world"]:
        net = Network.preset(SCALE_KNOBS["network"], gpus_per_node=SCALE_KNOBS["gpus_per_node"])
        t = time.perf_counter()
        res = replay(cap, spec["world"], network=net, rank_speed=SCALE_KNOBS["rank_speed"],
                     jitter=spec["jitter"], seed=0, per_rank=spec["per_rank"],
                     engine=spec.get("engine"), progress=False)
        out["wall"] = time.perf_counter() - t
        times = json.dumps([list(res.timeline.boundaries[r]) for r in (0, 17, spec["world"] - 1)]
                           + [res.iteration_times, res.collectives])
        out.update(iteration_ms=res.iteration_time * 1e3,
                   exposed_ms=res.mean_exposed_comm * 1e3, slowest=res.slowest_rank,
                   lanes=len(res.timeline.class_lanes),
                   sha=hashlib.sha256(res.to_json().encode()).hexdigest()[:12],
                   sha_times=hashlib.sha256(times.encode()).hexdigest()[:12])
    print(json.dumps(out))
    return 0


_LAUNCHER = """
import json, resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True)
print(json.dumps({"children_maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def _measure(capture_path: str, world: int, *, per_rank: bool = False,
             jitter: float = 0.0, engine: str | None = None) -> dict:
    """Run one replay in a child process: its result, wall time and peak RSS (MB)."""
    spec = json.dumps({"capture": capture_path, "world": world, "per_rank": per_rank,
                       "jitter": jitter, "engine": engine})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t = time.perf_counter()
    # A small launcher process runs the replay as its child and reports
    # getrusage(RUSAGE_CHILDREN): a child forked from this (big) process would inherit its
    # peak RSS; the launcher's only child is the replay, so the figure is the replay's own.
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, sys.executable,
                           os.path.abspath(__file__), "--_child", spec],
                          stdout=subprocess.PIPE, env=env, check=True)
    lines = proc.stdout.decode().strip().splitlines()
    out = json.loads(lines[-2])
    out["rss_mb"] = json.loads(lines[-1])["children_maxrss_kb"] / 1024  # KiB on Linux
    out["process_s"] = time.perf_counter() - t
    return out


def _scale(a: argparse.Namespace, capture_path: str) -> None:
    worlds = [int(x) for x in str(a.scale).split(",") if x.strip()]
    if not worlds:
        return
    base = _measure(capture_path, 0)
    print(f"\nscale: ib-ndr, 8 GPUs per node, rank 17 at 0.8 speed; each replay in a fresh "
          f"process (import + capture alone: {base['rss_mb']:.0f} MB peak RSS, "
          f"{base['process_s']:.1f} s)")
    print(f"  {'ranks':>9} {'path':>19} {'lanes':>9} {'wall s':>8} {'(runs)':>20} "
          f"{'peak RSS MB':>11} {'iteration ms':>13} {'result':>13}")
    for n in worlds:
        rows = [("classes", False, 0.0, None, a.scale_rounds)]
        if not a.no_old:
            rows.append(("per rank (old)", True, 0.0, None, a.slow_rounds))
        if not a.no_noise:
            rows.append(("jitter 0.02", False, 0.02, None, a.scale_rounds))
            if not a.no_old:
                rows.append(("jitter, simpy (old)", True, 0.02, "simpy", a.slow_rounds))
        walls: dict[str, float] = {}
        runs_of: dict[str, dict] = {}
        for name, per_rank, jitter, engine, rounds in rows:
            runs = [_measure(capture_path, n, per_rank=per_rank, jitter=jitter, engine=engine)
                    for _ in range(max(1, rounds))]
            wall = statistics.median(r["wall"] for r in runs)
            rss = max(r["rss_mb"] for r in runs)
            last = runs[-1]
            walls[name], runs_of[name] = wall, last
            print(f"  {n:>9,} {name:>19} {last['lanes']:>9,} {wall:8.3f} "
                  f"{'/'.join(format(r['wall'], '.3f') for r in runs):>20} {rss:11.0f} "
                  f"{last['iteration_ms']:13.3f} {last['sha']:>13}", flush=True)
        for old, new, key in (("per rank (old)", "classes", "sha"),
                              ("jitter, simpy (old)", "jitter 0.02", "sha_times")):
            if old in walls and new in walls:
                same = runs_of[old][key] == runs_of[new][key]
                what = "results" if key == "sha" else "iteration ends and collectives"
                print(f"  {n:>9,} {old} / {new}: {walls[old] / walls[new]:.0f}x wall; "
                      f"{what} {'identical' if same else 'DIFFER'}")


def _plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, 2, i + 1) for i in range(2)]
    series: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in rows:
        key = (r["network"], r["bucket_cap_mb"], r["comm_hook"])
        series.setdefault(key, []).append((r["world_size"], r["iteration_time_s"],
                                           r["exposed_comm_s"]))
    for (netname, cap_mb, hook), pts in sorted(series.items(), key=str):
        pts.sort()
        label = f"{netname}, {cap_mb} MB, {hook or 'no hook'}"
        style = "-" if hook is None else "--"
        axes[0].plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, marker="o",
                     label=label)
        axes[1].plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], style, marker="o",
                     label=label)
    for ax, what in zip(axes, ("iteration time (ms)", "exposed communication (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("simddp replay what-if: 8-layer MLP (1024 wide), A100 roofline")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")


if __name__ == "__main__":
    sys.exit(main())
