"""Cost of one rank hand-off's process-state swap (save the yielding rank, install the next).

Prints microseconds per hand-off for the full swap and for its parts, and each part's share,
so a change to fakepg.world.isolation can be judged by ratio on any machine:

    .venv/bin/python ci/bench_handoff.py
"""

from __future__ import annotations

import os
import timeit

import numpy
import torch

from fakepg.world.isolation import ProcessState, capture_switches


def per_call_us(fn, number: int = 2000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    a = ProcessState.for_rank(0, 2, 0, {"RANK": "0"})
    b = ProcessState.for_rank(1, 2, 0, {"RANK": "1"})
    pair = [a, b]
    a.install()

    def handoff() -> None:
        pair[0].save()
        pair[1].install()
        pair.reverse()

    def env_change_handoff() -> None:
        os.environ["FAKEPG_BENCH"] = str(len(pair[0].env or ()))
        handoff()

    full = per_call_us(handoff)
    parts = {
        "numpy RNG get+set": per_call_us(lambda: numpy.random.set_state(numpy.random.get_state())),
        "python RNG get+set": per_call_us(lambda: __import__("random").setstate(__import__("random").getstate())),
        "torch RNG get+set": per_call_us(lambda: torch.default_generator.set_state(torch.default_generator.get_state())),
        "torch switches, one snapshot": per_call_us(capture_switches),
    }
    print(f"torch {torch.__version__}, {len(os.environ)} environment variables")
    print(f"save+install per hand-off: {full:.1f} us")
    for name, us in parts.items():
        print(f"  {name:32s} {us:7.1f} us  ({us / full:.0%} of a hand-off)")
    changed = per_call_us(env_change_handoff)
    print(f"hand-off where a rank changed os.environ: {changed:.1f} us ({changed / full:.2f}x)")
    os.environ.pop("FAKEPG_BENCH", None)


if __name__ == "__main__":
    main()
