"""``simddp calibrate``: nccl-tests-style timing of collectives on this machine's backend (gloo
on CPU, NCCL with GPUs, one process per rank), an α–β fit, and the contention of compute beside
a collective — the measured network model ``whatif --network FILE`` replays with
(:mod:`simddp.measure`). Nothing here imports torch until the measurement runs."""

from __future__ import annotations

import argparse
from typing import Any

from . import cli_args as A

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    c = sub.add_parser("calibrate", help="measure collectives on this machine's backend and "
                       "fit a network model", description="nccl-tests-style timing of "
                       "collectives (gloo on CPU, NCCL with GPUs), one process per rank.")
    c.add_argument("--world-size", type=A.listed(A.integer(1, 64, " processes")), default=[2],
                   help="e.g. 2,4")
    sz = c.add_mutually_exclusive_group()
    sz.add_argument("--sizes", type=A.listed(A.size), default=None,
                    help="message sizes, e.g. 4K,1M,16M (default: 4K, 16K, ... up to "
                         "--max-bytes)")
    sz.add_argument("--max-bytes", type=A.size, default=32 << 20, metavar="SIZE",
                    help="the largest message, sizes from 4K in powers of 4 up to it "
                         "(default 32M: DDP's 25 MB bucket and then some)")
    sz.add_argument("--workload", metavar="NAME",
                    help="measure up to the largest DDP bucket of this zoo workload or script "
                         "(at --bucket-cap-mb), e.g. vgg16 (a 411 MB bucket)")
    c.add_argument("--bucket-cap-mb", type=A.listed(A.cap), default=[None],
                   help="with --workload: the bucket caps the what-if will try (default DDP's)")
    c.add_argument("--op", type=A.listed(str), default=["all_reduce"],
                   help="all_reduce, all_gather, reduce_scatter, broadcast")
    c.add_argument("--reps", type=A.integer(1, 10_000), default=5,
                   help="timed calls per point and round")
    c.add_argument("--min-rounds", type=A.integer(1, 1000), default=3,
                   help="stable: each point's median over rounds held still while the last "
                        "this many rounds came in (default 3)")
    c.add_argument("--max-rounds", type=A.integer(1, 1000), default=10,
                   help="rounds at most before giving up on stability (default 10)")
    c.add_argument("--tolerance", type=A.real(0.0, hi=10.0), default=0.1,
                   help="how far (relative) a stable point's median may move over the last "
                        "--min-rounds rounds (default 0.1)")
    c.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    c.add_argument("--json", metavar="FILE", help="write measurements and the fit as JSON")
    c.add_argument("--no-contention", action="store_true",
                   help="skip the contention measurement (gloo: a matmul alone vs beside an "
                        "all_reduce, and the cost of issuing one; stored as the file's "
                        "\"contention\", which replay applies)")
    return c


def _sizes(args: argparse.Namespace) -> list[int]:
    """--sizes as given; else 4K, 16K, ... up to --max-bytes or the workload's largest bucket."""
    from .measure import default_sizes, largest_bucket_bytes

    if args.workload is None and args.bucket_cap_mb != [None]:
        raise ValueError("--bucket-cap-mb says which buckets --workload NAME forms; give the "
                         "workload too, or --max-bytes for the largest message")
    if args.sizes is not None:
        return args.sizes
    if args.workload is None:
        return default_sizes(args.max_bytes)
    import torch

    from .whatif import load_workload

    sc = load_workload(args.workload)
    with torch.device("meta"):  # shapes only
        model = sc.build_model()
    caps = [sc.ddp_kwargs.get("bucket_cap_mb") if c is None else c for c in args.bucket_cap_mb]
    largest = max(largest_bucket_bytes(model, c) for c in caps)
    print(f"{args.workload}: largest DDP bucket {largest} bytes "
          f"({largest / (1 << 20):.1f} MiB); measuring up to it")
    return default_sizes(largest)


def run(args: argparse.Namespace) -> int:
    import json

    from .measure import measure
    from .models import Network
    from .program.parallel import UsageError

    if args.max_rounds < args.min_rounds:
        raise UsageError(f"--max-rounds {args.max_rounds} is below --min-rounds "
                         f"{args.min_rounds}: give max >= min")
    if args.backend == "nccl":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < max(args.world_size):
            raise RuntimeError(f"--backend nccl needs a GPU per rank: this machine has {have}, "
                               f"--world-size asks for {max(args.world_size)} (use --backend "
                               f"gloo, or run on a machine with the GPUs)")

    rows = measure(world_sizes=args.world_size, sizes=_sizes(args), ops=args.op,
                   reps=args.reps, backend=args.backend, min_rounds=args.min_rounds,
                   max_rounds=args.max_rounds, tolerance=args.tolerance)
    print(f"{'op':<15}{'ranks':>6}{'bytes':>12}{'time us':>12}{'busbw GB/s':>12}"
          f"{'spread':>8}{'moved':>7}{'rounds':>7}  note")
    for r in rows:
        bus = Network.bus_bandwidth_factor(r["op"], r["world_size"]) * r["bytes"] / r["seconds"]
        note = [] if r["stable"] else ["unstable"]
        if "measured_seconds" in r:
            note.append(f"lowered from {r['measured_seconds'] * 1e6:.1f} us (a larger "
                        f"message was faster)")
        print(f"{r['op']:<15}{r['world_size']:>6}{r['bytes']:>12}{r['seconds'] * 1e6:>12.1f}"
              f"{bus / 1e9:>12.3f}{r['spread']:>8.1%}{r['moved']:>7.1%}{r['rounds']:>7}  "
              f"{'; '.join(note)}")
    print("spread: interquartile range of a point's rounds / their median; moved: how far its "
          f"median moved over the last {args.min_rounds} rounds; time: the median, made "
          "monotone in size")
    unstable = [r for r in rows if not r["stable"]]
    if unstable:
        print(f"calibrate: {len(unstable)} of {len(rows)} points did not settle (median moved "
              f"more than {args.tolerance:.0%}) in {args.max_rounds} rounds (spread per size "
              f"above): this machine's load varies; predictions from this file carry that "
              f"uncertainty. Rerun on a quieter machine or raise --max-rounds.")
    fits = {}
    for op in args.op:
        data = [(r["bytes"], r["world_size"], r["seconds"]) for r in rows if r["op"] == op]
        try:
            net = Network.calibrate(data, op=op, name=f"calibrated-{rows[0]['backend']}")
        except ValueError as e:
            print(f"{op}: no α–β fit ({e})")
            continue
        fits[op] = {"bandwidth_GBps": net.bandwidth_GBps, "latency_us": net.latency_us}
        print(f"{op}: α–β fit: latency {net.latency_us:.1f} us, bandwidth "
              f"{net.bandwidth_GBps:.3f} GB/s (Network(bandwidth_GBps=..., latency_us=...))")
    contention = None
    if not args.no_contention and rows and rows[0]["backend"] == "gloo":
        from .measure import contention_of, measure_contention

        worlds = [n for n in args.world_size if n >= 2]
        if worlds:
            contention = contention_of(measure_contention(world_sizes=worlds, reps=args.reps))
            for r in contention["measurements"]:
                print(f"contention, {r['world_size']} ranks: compute x{r['slowdown']:.2f} while "
                      f"an all_reduce runs (the all_reduce x{r['comm_slowdown']:.2f} while the "
                      f"rank computes); issuing one: {r['per_collective_us']:.0f} us")
            print(f"contention: slowdown {contention['slowdown']:.2f}, per collective "
                  f"{contention['per_collective_us']:.0f} us (medians over world sizes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measurements": rows, "alpha_beta": fits, "contention": contention}, f,
                      indent=1)
        print(f"wrote {args.json}: use it as a measured network model, e.g. "
              f"`simddp whatif mlp --network {args.json}` or Network.from_measurements(path)")
    return 0
