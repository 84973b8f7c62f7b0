"""Benchmark: FSDP2 replay at scale (goal: 1,024 and 65,536 ranks in ≤ 10 s each).

Captures one FSDP2 step of the zoo's transformer block (torch's real ``fully_shard`` on 2 fake
ranks, H100 roofline, DGX H100 network) and of the same model as HSDP (2 × 2), then replays
each at 1,024 and 65,536 ranks, side by side in one run: in classes of identical ranks (no
jitter: one lane stands for every rank), and with jitter 0.02 (every rank distinct: the
vectorised engine), best of --rounds. Prints wall seconds and the ratio to the 10 s goal.

    python ci/bench_replay_fsdp.py [--rounds 3] [--scale 1024,65536]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", default="1024,65536")
    args = p.parse_args()

    from fakepg import zoo
    from simddp import Compute, Network, Timing
    from simddp.cosim.capture_fsdp import capture_fsdp
    from simddp.replay import replay

    net = Network.preset("dgx-h100")
    timing = Timing(network=net, compute=Compute.roofline("h100"))
    sc = zoo.get("transformer_block")
    t0 = time.perf_counter()
    caps = {"fsdp": (capture_fsdp(sc, 2, timing=timing), "fsdp"),
            "hsdp:8": (capture_fsdp(sc, 4, timing=timing, mesh={"replicate": 2, "shard": 2}),
                       "hsdp:8")}
    print(f"captures (FSDP on 2 ranks, HSDP on 4): {time.perf_counter() - t0:.1f} s")
    print(f"{'layout':8} {'ranks':>7} {'engine':>7} {'wall s':>8} {'goal 10 s':>10} "
          f"{'iteration ms':>13} {'exposed ms':>11} {'peak MB':>8}")
    for name, (cap, spec) in caps.items():
        for n in (int(x) for x in args.scale.split(",")):
            for jitter in (0.0, 0.02):
                best, res = float("inf"), None
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    res = replay(cap, n, network=net, parallel=spec, jitter=jitter,
                                 progress=False)
                    best = min(best, time.perf_counter() - t)
                print(f"{name:8} {n:>7,} {res.engine:>7} {best:>8.3f} {best / 10:>9.3f}x "
                      f"{res.iteration_time * 1e3:>13.3f} {res.mean_exposed_comm * 1e3:>11.3f} "
                      f"{res.peak_memory_bytes / 1e6:>8.3f}")


if __name__ == "__main__":
    main()
