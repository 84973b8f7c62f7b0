"""Validate simddp's network presets against published nccl-tests bus bandwidths.

Prints, per published figure (8×A100, 8×H100 with NVLS and ring, 2–7 H100s, multi-node A100 and
H100, B300 as a proxy for B200): the configuration, rank count, message size, the algorithm
simddp's "auto" picks (or the forced one), predicted and published busbw (GB/s) and the error.
The presets' parameters come from datasheets and NCCL's constants, not from this table; the
figures and their sources live in simddp/analysis/published.py.

    python ci/validate_published.py [--strict]    # --strict: exit 1 if a goal row misses ±5 %
"""

from __future__ import annotations

import argparse
import sys

from simddp.analysis.published import format_table, validate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 if a goal row misses the goal")
    ap.add_argument("--goal", type=float, default=5.0, help="goal, in %% error (default 5)")
    args = ap.parse_args(argv)
    rows = validate()
    print(format_table(rows, goal_pct=args.goal))
    missed = [r for r in rows if r.goal and abs(r.error_pct) > args.goal]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
