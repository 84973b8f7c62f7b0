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
torchvision-equal ResNets (on CPU: ResNet-50 takes ~2 minutes, ResNet-101 longer).
"""

from __future__ import annotations

import argparse
import sys

from simddp.analysis.published import DDP_BENCHMARK, format_table, validate


def ddp_benchmark() -> list[str]:
    """PyTorch's DDP benchmark table against ``simddp whatif`` (see the module docstring)."""
    from simddp.engines.whatif import whatif

    lines = ["model      GPUs  published s  predicted s  err %   1MB vs 25MB: published  predicted"]
    errs = []
    for model, pub in DDP_BENCHMARK.items():
        worlds = sorted(pub["iteration_s"])
        rows = whatif(model, world_size=worlds, network="dgx1-v100", gpus_per_node=8,
                      bucket_cap_mb=[1, 25], gpu="v100", step_time_s=pub["no_ddp_s"],
                      batch_size=32)
        got = {(r["world_size"], r["bucket_cap_mb"]): r["iteration_time_s"] for r in rows}
        for n in worlds:
            p25, p1 = got[(n, 25)], got[(n, 1)]
            real = pub["iteration_s"][n]
            err = 100 * (p25 - real) / real
            errs.append(abs(err))
            lines.append(f"{model:<10} {n:>4}  {real:>11.3f}  {p25:>11.4f}  {err:+5.1f}"
                         f"   {pub['cap1_vs_cap25_pct'][n]:+22.1f} %  {100 * (p25 / p1 - 1):+8.1f} %")
    lines.append(f"iteration time: {sum(e <= 5 for e in errs)} of {len(errs)} within ±5 %, "
                 f"worst {max(errs):.1f} %")
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
