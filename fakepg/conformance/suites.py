"""A MultiProcessTestCase suite on the fake cluster next to real gloo processes: same verdicts?

Runs pytest on the given test files twice, in subprocesses — once as they are (torch starts one
process per rank, the suites use gloo on a CPU), once with ``--fakepg-suites`` (the ranks of each
test are one fake world, :mod:`fakepg.launch.suites`) — and prints one row per test with both verdicts,
the counts, and the time both spent in the tests themselves (pytest's per-test durations, from
its JUnit XML report)::

    python -m fakepg.conformance.suites path/to/test_dtensor.py -k "test_from_local"
    python -m fakepg.conformance.suites test_a.py test_b.py --isolation process
    python -m fakepg.conformance.suites test_a.py --fake-only

Verdicts: ``pass``, ``skip``, ``fail`` (an assertion or error), ``timeout`` (the run of the
file passed ``--timeout`` seconds); a row is marked ``!=`` where the two differ.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

__all__ = ["Run", "junit_outcomes", "run_pytest", "main"]


@dataclass
class Run:
    """One pytest run of the files: verdict and seconds per test id, and its wall time."""

    outcomes: dict[str, str]
    seconds: dict[str, float]
    wall: float
    timed_out: bool = False


def junit_outcomes(path: str | os.PathLike, seconds: dict[str, float] | None = None) -> dict[str, str]:
    """``{"module.Class.test": "pass"|"fail"|"skip"}`` from a pytest JUnit XML report
    (``seconds``, if given, receives each test's duration)."""
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        tags = {child.tag for child in case}
        out[name] = ("fail" if tags & {"failure", "error"} else
                     "skip" if "skipped" in tags else "pass")
        if seconds is not None:
            seconds[name] = float(case.get("time") or 0.0)
    return out


def run_pytest(files: list[str], patterns: str | None, options: list[str], timeout: float) -> Run:
    """pytest on ``files`` in a subprocess, with ``options`` (e.g. ``--fakepg-suites``)."""
    with tempfile.TemporaryDirectory(prefix="fakepg-suites-") as tmp:
        xml = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *options] + (["-k", patterns] if patterns else [])
        t0 = time.perf_counter()
        try:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return Run({}, {}, time.perf_counter() - t0, timed_out=True)
        wall = time.perf_counter() - t0
        seconds: dict[str, float] = {}
        outcomes = junit_outcomes(xml, seconds) if os.path.exists(xml) else {}
        return Run(outcomes, seconds, wall)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="test files holding MultiProcessTestCase suites")
    ap.add_argument("-k", dest="patterns", default=None, help="pytest -k expression")
    ap.add_argument("--isolation", default="thread", choices=["thread", "process"])
    ap.add_argument("--fake-only", action="store_true", help="skip the real gloo run")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run")
    args = ap.parse_args(argv)

    fake = run_pytest(args.files, args.patterns, [f"--fakepg-suites={args.isolation}"], args.timeout)
    gloo = None if args.fake_only else run_pytest(args.files, args.patterns, [], args.timeout)
    names = sorted(set(fake.outcomes) | set(gloo.outcomes if gloo else ()))
    counts: dict[tuple[str, str], int] = {}
    for name in names:
        f = "timeout" if fake.timed_out else fake.outcomes.get(name, "-")
        g = "" if gloo is None else "timeout" if gloo.timed_out else gloo.outcomes.get(name, "-")
        counts[(f, g)] = counts.get((f, g), 0) + 1
        mark = "!=" if gloo is not None and f != g else "  "
        secs = f"{fake.seconds.get(name, 0.0):6.2f} s"
        if gloo is not None:
            secs += f" / {gloo.seconds.get(name, 0.0):6.1f} s"
        print(f"{mark} {name:<78.78} fakepg: {f:<7}" + (f" gloo: {g:<7}" if gloo else "") + secs)
    print(f"\n{len(names)} tests; verdict counts (fakepg, gloo):")
    for (f, g), n in sorted(counts.items()):
        print(f"  {f:<8} {g or '-':<8} {n}")
    t_fake = sum(fake.seconds.values())
    line = f"time in tests: fakepg ({args.isolation}) {t_fake:.1f} s"
    if gloo is not None:
        t_gloo = sum(gloo.seconds.values())
        same = sum(1 for n in names if fake.outcomes.get(n) == gloo.outcomes.get(n))
        line += f", gloo {t_gloo:.1f} s ({t_gloo / max(t_fake, 1e-9):.0f}x); same verdict: {same}/{len(names)}"
    print(line + f"; wall: fakepg {fake.wall:.1f} s" + (f", gloo {gloo.wall:.1f} s" if gloo else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
