#!/usr/bin/env python
"""Rung 4 of the verification ladder: the fake cluster against NCCL, on whatever GPUs exist.

* >= 2 GPUs: each scenario under NCCL with one process per GPU (torchrun-style: rank r on
  cuda:r, RANK/LOCAL_RANK/WORLD_SIZE set), compared with the fake cluster on CUDA tensors at the
  same world size; the fake cluster on CUDA is also compared with the fake cluster on CPU.
* 1 GPU (NCCL refuses two ranks on one GPU): NCCL with ONE rank compared with the fake cluster
  at world 1 on CUDA; then the fake cluster with CUDA tensors (all ranks on cuda:0) at worlds
  2-4 compared with the fake cluster on CPU and with the single-process reference.
* no GPU: says so and exits 0 having run nothing; ``--cpu-legs`` runs the CPU rungs instead
  (fake vs multi-process gloo, fake vs reference).

Prints a conformance table (scenario x leg -> OK / DIFF / ERROR), then each failing cell's first
differences, and exits 1 on any difference or error. Works on torch 2.11-2.13.

    python ci/verify_nccl.py                 # what this machine's GPUs allow
    python ci/verify_nccl.py --worlds 2 4    # world sizes for the multi-rank legs
    python ci/verify_nccl.py --cpu-legs      # also (or, without a GPU, only) fake vs gloo
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd  # noqa: E402

from fakepg import zoo  # noqa: E402
from fakepg.conformance import (CollectiveTour, ScenarioOutcome, compare,  # noqa: E402
                                default_tolerance, run_scenario)
from fakepg.zoo import TrainLoop  # noqa: E402


@dataclass(frozen=True)
class Case:
    label: str
    scenario: Any
    train: Any = None  # None: run_scenario's default, fakepg.zoo.TrainLoop()
    lossy: bool = False  # a comm hook that compresses: compare with float16 tolerance

    @property
    def reference_ok(self) -> bool:
        return self.train is None and getattr(self.scenario, "reference_ok", False)


def cases() -> list[Case]:
    """The scenarios of tests/test_conformance_gloo.py (its collective tour included), plus
    PowerSGD. (No sparse_embedding: NCCL has no sparse allreduce.)"""
    fp16 = TrainLoop(comm_hook=default_hooks.fp16_compress_hook)
    # One bucket (default cap): PowerSGD's callbacks wait on nested allreduces, which can
    # deadlock gloo's worker threads when several buckets are in flight.
    psgd = TrainLoop(comm_hook=powersgd.powerSGD_hook, hook_state=functools.partial(
        powersgd.PowerSGDState, matrix_approximation_rank=1, start_powerSGD_iter=2))
    mlp = zoo.get("mlp", depth=4, width=32)
    return [
        Case("grad_order_differs_per_rank", zoo.get("grad_order_differs_per_rank")),
        Case("many_small_few_large", zoo.get("many_small_few_large", bucket_cap_mb=0.01)),
        Case("rank_dependent_unused", zoo.get("rank_dependent_unused")),
        Case("buffers", zoo.get("buffers")),
        Case("uneven_inputs", zoo.get("uneven_inputs")),
        Case("mlp+fp16_compress_hook", mlp.with_ddp(bucket_cap_mb=0.005).with_(name="mlp+fp16"), fp16, True),
        Case("mlp+powerSGD_hook", mlp.with_(name="mlp+powerSGD"), psgd, True),
        # Not DDP: every collective once (subgroup, p2p where the world allows), results kept.
        Case("collective_tour", zoo.get("mlp", depth=2, width=8).with_(name="collective_tour"),
             CollectiveTour()),
    ]


class Runner:
    """Runs each (backend, world) once for all cases, caching outcomes (or the error)."""

    def __init__(self, cases: list[Case], timeout: float):
        self.cases = cases
        self.timeout = timeout
        self.cache: dict[tuple[str, int], dict[str, Any]] = {}
        self.times: dict[str, float] = {}

    def outcomes(self, backend: str, world: int) -> dict[str, Any]:
        key = (backend, world)
        if key in self.cache:
            return self.cache[key]
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        if backend == "reference":
            for c in self.cases:
                if c.reference_ok:
                    out[c.label] = _guard(lambda c=c: ScenarioOutcome.from_states(
                        [zoo.reference_train(c.scenario, world, rank=r) for r in range(world)],
                        scenario=c.scenario.name,
                        param_names=[n for n, _ in c.scenario.build_model().named_parameters()]))
        elif backend in ("fake", "fake-cuda"):
            for c in self.cases:
                out[c.label] = _guard(lambda c=c: run_scenario(c.scenario, world, backend, train=c.train))
        else:  # one set of processes for all cases; on failure, one set per case to localise it
            batch = _guard(lambda: run_scenario([c.scenario for c in self.cases], world, backend,
                                                train=[c.train for c in self.cases], timeout=self.timeout))
            if isinstance(batch, BaseException):
                for c in self.cases:
                    out[c.label] = _guard(lambda c=c: run_scenario(c.scenario, world, backend,
                                                                   train=c.train, timeout=self.timeout))
            else:
                out = {c.label: o for c, o in zip(self.cases, batch)}
        self.times[f"{backend} x{world}"] = time.perf_counter() - t0
        self.cache[key] = out
        return out


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - reported in the table
        if isinstance(e, KeyboardInterrupt):
            raise
        e.__dict__.setdefault("_tb", traceback.format_exc())
        return e


@dataclass
class Leg:
    name: str
    a: tuple[str, int]
    b: tuple[str, int]
    cross_device: bool = False  # CUDA vs CPU kernels: float32 rounding differs a little more


def legs_for(n_gpus: int, worlds: list[int], cpu_legs: bool) -> list[Leg]:
    legs: list[Leg] = []
    if n_gpus >= 2:
        for w in [w for w in worlds if w <= n_gpus] or [min(n_gpus, 4)]:
            legs.append(Leg(f"nccl{w} = fake-cuda{w}", ("nccl", w), ("fake-cuda", w)))
            legs.append(Leg(f"fake-cuda{w} = fake{w}", ("fake-cuda", w), ("fake", w), cross_device=True))
    elif n_gpus == 1:
        legs.append(Leg("nccl1 = fake-cuda1", ("nccl", 1), ("fake-cuda", 1)))
        for w in worlds:
            legs.append(Leg(f"fake-cuda{w} = fake{w}", ("fake-cuda", w), ("fake", w), cross_device=True))
            legs.append(Leg(f"fake-cuda{w} = ref", ("fake-cuda", w), ("reference", w), cross_device=True))
    if cpu_legs:
        for w in worlds:
            legs.append(Leg(f"fake{w} = gloo{w}", ("fake", w), ("gloo", w)))
            legs.append(Leg(f"fake{w} = ref", ("fake", w), ("reference", w)))
    return legs


def _tolerance(case: Case, leg: Leg) -> dict[str, float]:
    if case.lossy:
        rtol, atol = default_tolerance(torch.float16)
        return {"rtol": rtol, "atol": atol}
    if leg.cross_device:
        return {"rtol": 1e-3, "atol": 1e-4}
    return {}


def run_leg(runner: Runner, case: Case, leg: Leg) -> Any:
    """``None`` (not applicable), a list of differences, or the exception that stopped a side."""
    a = runner.outcomes(*leg.a).get(case.label)
    b = runner.outcomes(*leg.b).get(case.label)
    if a is None or b is None:
        return None
    for side in (a, b):
        if isinstance(side, BaseException):
            return side
    return compare(a, b, **_tolerance(case, leg))


def _cell(result: Any) -> str:
    if result is None:
        return "-"
    if isinstance(result, BaseException):
        return "ERROR"
    return "OK" if not result else f"DIFF ({len(result)})"


def _first_line(e: BaseException) -> str:
    """The exception's first line and, for a child's traceback, its last lines."""
    lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    shown = lines if len(lines) <= 4 else lines[:1] + ["..."] + lines[-3:]
    return " | ".join(shown)[:800]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4],
                    help="world sizes of the multi-rank legs (default: 2 3 4; NCCL legs need that many GPUs)")
    ap.add_argument("--cpu-legs", action="store_true",
                    help="also run fake vs multi-process gloo and fake vs reference on CPU")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per multi-process run")
    ap.add_argument("--only", nargs="*", default=None, help="case labels to run (default: all)")
    args = ap.parse_args(argv)

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = n_gpus > 0 and dist.is_available() and dist.is_nccl_available()
    print(f"torch {torch.__version__}; CUDA GPUs: {n_gpus}; NCCL: "
          f"{'yes' if nccl else 'no'}" + (f" {'.'.join(map(str, torch.cuda.nccl.version()))}" if nccl else ""))
    if n_gpus and not nccl:
        print("CUDA is here but torch has no NCCL: the NCCL legs cannot run.")
        n_gpus_for_nccl = 0
    else:
        n_gpus_for_nccl = n_gpus
    if n_gpus == 0 and not args.cpu_legs:
        print("No CUDA GPU on this machine: nothing to verify under NCCL (ran nothing). "
              "Use --cpu-legs for the CPU rungs (fake vs gloo, fake vs reference).")
        return 0

    selected = [c for c in cases() if args.only is None or c.label in args.only]
    legs = legs_for(n_gpus_for_nccl, sorted(set(args.worlds)), args.cpu_legs)
    if n_gpus and not n_gpus_for_nccl:  # fake-cuda legs still make sense without NCCL
        legs = [Leg(f"fake-cuda{w} = fake{w}", ("fake-cuda", w), ("fake", w), cross_device=True)
                for w in sorted(set(args.worlds))] + legs
    if n_gpus >= 2:
        print(f"{n_gpus} GPUs: NCCL with one process per GPU (rank r on cuda:r)")
    elif n_gpus == 1:
        print("1 GPU: NCCL with one rank; the fake cluster with CUDA tensors (all ranks on cuda:0) "
              "at worlds " + ", ".join(map(str, sorted(set(args.worlds)))))

    runner = Runner(selected, args.timeout)
    table: dict[tuple[str, str], Any] = {}
    t0 = time.perf_counter()
    for leg in legs:
        for case in selected:
            table[case.label, leg.name] = run_leg(runner, case, leg)
            print(f"  {case.label:30s} {leg.name:22s} {_cell(table[case.label, leg.name])}", flush=True)
    total = time.perf_counter() - t0

    # The table.
    w0 = max(len(c.label) for c in selected) + 2
    widths = [max(len(leg.name), 8) + 2 for leg in legs]
    print()
    print("scenario".ljust(w0) + "".join(leg.name.ljust(w) for leg, w in zip(legs, widths)))
    print("-" * (w0 + sum(widths)))
    for case in selected:
        print(case.label.ljust(w0) + "".join(_cell(table[case.label, leg.name]).ljust(w)
                                            for leg, w in zip(legs, widths)))
    failed = [(k, v) for k, v in table.items() if v is not None and (isinstance(v, BaseException) or v)]
    if failed:
        print("\nFirst differences:")
        for (label, leg), v in failed:
            if isinstance(v, BaseException):
                print(f"  {label} x {leg}: ERROR {_first_line(v)}")
            else:
                print(f"  {label} x {leg}: {v[0]}" + (f"  (+{len(v) - 1} more)" if len(v) > 1 else ""))
                for line in v[1:4]:
                    print(f"      {line}")
    print("\ntimes: " + ", ".join(f"{k} {v:.1f} s" for k, v in runner.times.items()) + f"; total {total:.1f} s")
    ok = sum(1 for v in table.values() if v == [])
    na = sum(1 for v in table.values() if v is None)
    print(f"{ok} conformant, {len(failed)} failed, {na} not applicable")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
