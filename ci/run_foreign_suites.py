"""torch's own distributed test files under ``--fakepg-suites`` in both modes, beside real gloo.

The files are not in the torch wheel and not in this repository (copy them from
pytorch/pytorch's ``test/distributed/``: ``test_c10d_gloo.py`` needs ``test_c10d_common.py``
next to it). One pytest session per mode, each over all the files; real gloo is the same
session without the option (torch starts one interpreter per rank: an hour and more for
``test_c10d_gloo.py`` on 2 cores), or the JUnit XML of an earlier such run (``--gloo-xml``)::

    python ci/run_foreign_suites.py /work/foreign-suites/distributed \\
        test_c10d_gloo.py tensor/parallel/test_tp_style.py [--gloo-xml gloo.xml] [--no-gloo] \\
        [--modes thread,process] [--outcomes-json out.json]

Prints the verdict counts per mode, every test whose verdicts differ, the wall times and the
1-minute load average seen during each fakepg session (sampled every 5 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from fakepg.conformance.suites import junit_outcomes, run_pytest


def _counts(outcomes: dict[str, str]) -> str:
    n = {v: list(outcomes.values()).count(v) for v in ("pass", "fail", "skip")}
    return f"{n['pass']} passed, {n['fail']} failed, {n['skip']} skipped ({len(outcomes)} tests)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite_dir", help="the directory the test files are relative to")
    ap.add_argument("files", nargs="+", help="test files, relative to suite_dir")
    ap.add_argument("--gloo-xml", help="JUnit XML of an earlier plain pytest run of the files")
    ap.add_argument("--no-gloo", action="store_true", help="compare the two modes only")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per pytest session")
    ap.add_argument("--modes", default="thread,process",
                    help="fakepg modes to run, comma-separated (default: thread,process)")
    ap.add_argument("--outcomes-json", help="write every run's verdict per test to this file")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"thread", "process"}:
        ap.error(f"--modes takes thread and/or process, comma-separated; got {args.modes!r}")
    if args.outcomes_json:
        args.outcomes_json = os.path.abspath(args.outcomes_json)

    os.chdir(args.suite_dir)  # test_c10d_gloo imports test_c10d_common from its directory
    runs: dict[str, tuple[dict[str, str], float | None]] = {}
    loads: dict[str, list[float]] = {}  # the 1-minute load average every 5 s of each session
    for mode in modes:
        loads[mode] = []
        done = threading.Event()

        def sample(into: list[float] = loads[mode]) -> None:
            while not done.wait(5.0):
                into.append(os.getloadavg()[0])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        r = run_pytest(args.files, None, [f"--fakepg-suites={mode}"], args.timeout)
        done.set()
        sampler.join()
        runs[mode] = (r.outcomes, None if r.timed_out else r.wall)
    if args.gloo_xml:
        runs["gloo"] = (junit_outcomes(args.gloo_xml), None)
    elif not args.no_gloo:
        t0 = time.perf_counter()
        r = run_pytest(args.files, None, [], args.timeout)
        runs["gloo"] = (r.outcomes, None if r.timed_out else time.perf_counter() - t0)

    for mode, (outcomes, wall) in runs.items():
        took = "timed out or not measured here" if wall is None else f"wall {wall:.1f} s"
        seen = sorted(loads.get(mode, ()))
        load = (f"; 1-minute load min {seen[0]:.1f}, median {seen[len(seen) // 2]:.1f}, "
                f"max {seen[-1]:.1f}" if seen else "")
        print(f"{mode:<8} {_counts(outcomes)}; {took}{load}")
    if args.outcomes_json:
        with open(args.outcomes_json, "w") as f:
            json.dump({mode: outcomes for mode, (outcomes, _) in runs.items()}, f, indent=1)
    names = sorted(set().union(*(o for o, _ in runs.values())))
    differ = [n for n in names if len({o.get(n, "-") for o, _ in runs.values()}) > 1]
    print(f"\n{len(names) - len(differ)} of {len(names)} tests have one verdict in every run; "
          f"{len(differ)} differ:")
    for n in differ:
        print(f"  {n}: " + ", ".join(f"{m} {o.get(n, '-')}" for m, (o, _) in runs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
