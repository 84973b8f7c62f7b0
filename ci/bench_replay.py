"""Benchmark: trace-driven replay at scale, and a what-if sweep.

1. Capture one DDP iteration of an 8-layer MLP (1024 wide, 32 MiB of fp32 parameters) on 2 fake
   ranks under co-simulation (A100 roofline, 100 GbE), and check that replaying it at 2 ranks
   reproduces the co-simulated iteration time.
2. Replay it at 512, 1024 and 4096 ranks (best of --rounds, side by side in one run): wall time
   and wall time per simulated rank, plain DDP and with PowerSGD (3 collectives per bucket and
   a callback process per rank and bucket: the heaviest knob); then once at --scale ranks
   (default 65,536) with plain DDP.
3. A what-if table: world size × network × bucket_cap_mb × fp16 hook → iteration time and
   exposed communication; written as CSV and a PNG under --out (default /tmp/simddp_sweep).

    python ci/bench_replay.py [--rounds 3] [--out /tmp/simddp_sweep] [--scale 65536]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from fakepg import zoo as models  # the scenario zoo, installed as fakepg.zoo
from simddp import Compute, Network, Timing
from simddp.replay import capture, replay, sweep, write_csv


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:9.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/simddp_sweep")
    p.add_argument("--scale", type=int, default=65536,
                   help="one plain-DDP replay at this many ranks (0: skip)")
    a = p.parse_args(argv)
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
    if a.scale:
        res = replay(cap, a.scale, network=net, jitter=0.02)
        ncoll = sum(res.rank_collectives)
        print(f"  {a.scale:>6} {'None':>9} {res.wall_time:8.3f} {'(1 run)':>9} "
              f"{res.wall_time / a.scale * 1e6:8.1f} {res.iteration_time * 1e3:13.3f} "
              f"{ncoll / res.wall_time:9.0f}")

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
