"""What fakepg's pytest plugin adds to the start-up of a pytest run that uses nothing of fakepg.

    python ci/bench_plugin_startup.py [--rounds 7]

Every pytest run in an environment where fakepg is installed loads the plugin, so its load
must be cheap (goal: <= 50 ms added). Three variants of the same run — one trivial test file,
in a fresh interpreter each — are timed in interleaved rounds, side by side:

- ``without``: ``-p no:fakepg`` (pytest and the other installed plugins only);
- ``with``: the plugin as installed (its light entry module; torch is not imported);
- ``eager``: the plugin plus ``-p fakepg.pytest_plugin`` (what loading it cost when the plugin
  imported torch and fakepg at load time), for reference.

Per run the wall time and the CPU time (user + system of the pytest process), best and
median, and the difference to ``without``. On a shared machine the wall times swing with the
load; the CPU times are the steadier measure of what loading the plugin costs.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRIVIAL_TEST = "def test_nothing_of_fakepg():\n    assert 1 + 1 == 2\n"
VARIANTS = {
    "without": ["-p", "no:fakepg"],
    "with": [],
    "eager": ["-p", "fakepg.pytest_plugin"],
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(folder: Path, extra: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one pytest run in a fresh interpreter."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra,
                           "test_trivial.py"], cwd=folder, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    elapsed, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode:
        raise SystemExit(f"pytest {' '.join(extra)} failed:\n{proc.stdout}")
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = parser.parse_args()
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "test_trivial.py").write_text(TRIVIAL_TEST)
        for extra in VARIANTS.values():  # warm the file system caches once
            one_run(folder, extra)
        for _ in range(args.rounds):
            for name, extra in VARIANTS.items():
                w, c = one_run(folder, extra)
                wall[name].append(w)
                cpu[name].append(c)
    print(f"pytest start-up + one trivial test, {args.rounds} interleaved rounds, "
          f"load average {os.getloadavg()[0]:.1f}; ms, best / median; added: vs 'without'")
    print(f"{'variant':<9} {'wall':>13} {'added wall':>15} {'CPU':>13} {'added CPU':>15}")
    for name in VARIANTS:
        row = [name]
        for times in (wall, cpu):
            best, med = min(times[name]), statistics.median(times[name])
            base_best, base_med = min(times["without"]), statistics.median(times["without"])
            row += [f"{best * 1e3:.0f} / {med * 1e3:.0f}",
                    f"{(best - base_best) * 1e3:+.0f} / {(med - base_med) * 1e3:+.0f}"]
        print(f"{row[0]:<9} {row[1]:>13} {row[2]:>15} {row[3]:>13} {row[4]:>15}")
    added = statistics.median(cpu["with"]) - statistics.median(cpu["without"])
    print(f"loading the plugin adds {added * 1e3:+.0f} ms of CPU time (median; goal <= 50 ms): "
          f"{'met' if added <= 0.050 else 'missed'}; the eager load cost "
          f"{statistics.median(cpu['eager']) / statistics.median(cpu['without']):.1f}x "
          f"pytest's CPU time alone")


if __name__ == "__main__":
    main()
