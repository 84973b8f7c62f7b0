"""What fakepg's pytest plugin adds to the start-up of a pytest run that uses nothing of fakepg.

    python ci/bench_plugin_startup.py [--rounds 7]

Every pytest run in an environment where fakepg is installed loads the plugin, so its load
must be cheap (goal: <= 50 ms added). Three variants of the same run — one trivial test file,
in a fresh interpreter each — are timed in interleaved rounds, side by side:

- ``without``: ``-p no:fakepg`` (pytest and the other installed plugins only);
- ``with``: the plugin as installed (its light entry module; torch is not imported);
- ``eager``: the plugin plus ``-p fakepg.pytest_plugin`` (what loading it cost when the plugin
  imported torch and fakepg at load time), for reference.

Wall time per run, best and median, and the difference to ``without``; the machine may be
shared, so read the side-by-side differences, not single figures.
"""

from __future__ import annotations

import argparse
import os
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


def one_run(folder: Path, extra: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra,
                           "test_trivial.py"], cwd=folder, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"pytest {' '.join(extra)} failed:\n{proc.stdout}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "test_trivial.py").write_text(TRIVIAL_TEST)
        for name, extra in VARIANTS.items():  # warm the file system caches once
            one_run(folder, extra)
        for _ in range(args.rounds):
            for name, extra in VARIANTS.items():
                times[name].append(one_run(folder, extra))
    base_best, base_median = min(times["without"]), statistics.median(times["without"])
    print(f"pytest start-up + one trivial test, {args.rounds} interleaved rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<9} {'best ms':>8} {'median ms':>10} {'added (best)':>13} {'added (median)':>15}")
    for name, runs in times.items():
        best, median = min(runs), statistics.median(runs)
        print(f"{name:<9} {best * 1e3:8.0f} {median * 1e3:10.0f} {(best - base_best) * 1e3:+11.0f} ms"
              f" {(median - base_median) * 1e3:+13.0f} ms")
    added = statistics.median(times["with"]) - base_median
    print(f"plugin load adds {added * 1e3:+.0f} ms (median; goal <= 50 ms): "
          f"{'met' if added <= 0.050 else 'missed'}; eager load was "
          f"{statistics.median(times['eager']) / base_median:.1f}x pytest alone")


if __name__ == "__main__":
    main()
