"""Validate simddp's network presets against published nccl-tests bus bandwidths.

Prints, per published figure (8×A100, 8×H100 with NVLS and ring, 2–7 H100s, multi-node A100 and
H100, B300 as a proxy for B200): the configuration, rank count, message size, the algorithm
simddp's "auto" picks (or the forced one), predicted and published busbw (GB/s) and the error.
The presets' parameters come from datasheets and NCCL's constants, not from this table; the
figures and their sources live in simddp/analysis/published.py.

    python ci/validate_published.py [--strict]    # --strict: exit 1 if a goal row misses ±5 %
    python ci/validate_published.py --ddp         # also PyTorch's DDP benchmark table (minutes)

``--ddp`` predicts PyTorch's own DDP benchmark (ResNet-50/101, batch 32, DGX-1 V100 machines,
1–16 GPUs, 25 MB and 1 MB buckets) with ``simddp whatif``: compute calibrated only from the
one-GPU no-DDP step time, the ``dgx1-v100`` preset, torch's real DDP captured on the zoo's
torchvision-equal ResNets (on CPU: ResNet-50 takes ~2 minutes, ResNet-101 longer). It predicts
each cell twice: the preset as is, and "+launch" — a fixed cost per collective on the issuing
rank's compute stream of NCCL's per-collective base latency (8.4 µs, tuning.cc's ``baseLat``).
"""

from __future__ import annotations

import argparse
import sys

from simddp.analysis.published import DDP_BENCHMARK, format_table, validate


def ddp_benchmark() -> list[str]:
    """PyTorch's DDP benchmark table against ``simddp whatif`` (see the module docstring):
    the ``dgx1-v100`` preset as is, and with a fixed compute-stream cost per collective of
    NCCL's own per-collective base latency (:data:`simddp.models.contention.NCCL_BASE_LATENCY_US`,
    tuning.cc's baseLat; cited, not fitted)."""
    from simddp.whatif import whatif
    from simddp.models import Contention, Network
    from simddp.models.contention import NCCL_BASE_LATENCY_US

    plain = Network.preset("dgx1-v100")
    launch = plain.with_(name="dgx1-v100+launch", contention=Contention(
        per_collective_us=NCCL_BASE_LATENCY_US, source="NCCL tuning.cc baseLat (Simple)"))
    lines = [f"per-collective cost (+launch): {NCCL_BASE_LATENCY_US} us on the issuing rank's "
             f"compute stream (NCCL tuning.cc baseLat)",
             "model      GPUs  published s  predicted s  err %  +launch s  err %"
             "   1MB vs 25MB: published  predicted  +launch"]
    errs: dict[str, list[float]] = {"plain": [], "launch": []}
    right = {"plain": 0, "launch": 0}
    for model, pub in DDP_BENCHMARK.items():
        worlds = sorted(pub["iteration_s"])
        rows = whatif(model, world_size=worlds, network=[plain, launch], gpus_per_node=8,
                      bucket_cap_mb=[1, 25], gpu="v100", step_time_s=pub["no_ddp_s"],
                      batch_size=32)
        got = {(r["network"], r["world_size"], r["bucket_cap_mb"]): r["iteration_time_s"]
               for r in rows}
        for n in worlds:
            real = pub["iteration_s"][n]
            cells, dirs = [], []
            for kind, net in (("plain", plain), ("launch", launch)):
                p25, p1 = got[(net.name, n, 25)], got[(net.name, n, 1)]
                err = 100 * (p25 - real) / real
                errs[kind].append(abs(err))
                cells.append(f"{p25:>9.4f}  {err:+5.1f}")
                delta = 100 * (p25 / p1 - 1)  # the table's convention: negative = 1 MB slower
                right[kind] += (delta < 0) == (pub["cap1_vs_cap25_pct"][n] < 0)
                dirs.append(f"{delta:+8.1f} %")
            lines.append(f"{model:<10} {n:>4}  {real:>11.3f}  {cells[0]:>17}  {cells[1]}"
                         f"   {pub['cap1_vs_cap25_pct'][n]:+22.1f} %  {dirs[0]} {dirs[1]}")
    for kind, label in (("plain", "dgx1-v100"), ("launch", "+launch")):
        e = errs[kind]
        lines.append(f"{label}: iteration time {sum(x <= 5 for x in e)} of {len(e)} within "
                     f"±5 %, worst {max(e):.1f} %; 1 MB vs 25 MB direction right in "
                     f"{right[kind]} of {len(e)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 if a goal row misses the goal")
    ap.add_argument("--goal", type=float, default=5.0, help="goal, in %% error (default 5)")
    ap.add_argument("--ddp", action="store_true",
                    help="also PyTorch's DDP benchmark table (ResNet-50/101 on V100; minutes)")
    args = ap.parse_args(argv)
    rows = validate()
    print(format_table(rows, goal_pct=args.goal))
    if args.ddp:
        print()
        print("\n".join(ddp_benchmark()))
    missed = [r for r in rows if r.goal and abs(r.error_pct) > args.goal]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
