"""One rank's training step without DDP (zero_grad, forward, loss, backward, optimizer step;
the second of two, so the optimizer's state exists): its virtual time and phases under a
compute model, and that model scaled so the step takes a measured time — the number users have
from a single-GPU run (``simddp whatif --step-time``; :mod:`simddp.whatif`'s step 2)."""

from __future__ import annotations

from typing import Any, Callable

from .timing import Timing

__all__ = ["step_phases", "step_time", "calibrate_compute", "calibrated"]


def _plain_steps(scenario: Any, steps: int, device: str
                 ) -> Callable[[int], list[dict[str, float]]]:
    """Each step's phases (as the capture splits a DDP step): forward (zero_grad, forward,
    loss), backward, optimizer."""
    import torch  # here, not at import: a what-if whose capture is cached runs no torch

    from .cosim.simulate import now

    def run(rank: int) -> list[dict[str, float]]:
        with torch.device(device):  # on meta a real-size model is built without storage
            model = scenario.build_model()
        opt = scenario.optimizer(model.parameters())
        batches = scenario.inputs(0, 1, device=device)
        phases = []
        for i in range(steps):
            t0 = now()
            opt.zero_grad(set_to_none=True)
            loss = scenario.step(model, batches[i % len(batches)])
            t1 = now()
            loss.backward()
            t2 = now()
            opt.step()
            phases.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": now() - t2})
        return phases
    return run


def step_phases(scenario: Any, compute: Any, *, device: str | None = None
                ) -> dict[str, float]:
    """Virtual seconds of one rank's training step without DDP under ``compute`` (the second
    of two steps), per phase: forward, backward, optimizer. ``device``: "cpu" (the default:
    the device the capture runs on, so the plain step runs the very ops the DDP step runs —
    on "meta" some ops decompose differently, e.g. attention, and a transformer's step came
    out 15 % apart) or "meta" (shapes only, no arithmetic)."""
    from .cosim.meta import in_meta_scope
    from .cosim.simulate import simulate

    timing = Timing(compute=compute)
    device = device or "cpu"
    # under the capture's meta scope, so the plain step runs the ops the capture runs
    res = simulate(in_meta_scope(device, _plain_steps(scenario, 2, device)), (), 1,
                   timing=timing, seed=0)
    return dict(res.returns[0][-1])


def step_time(scenario: Any, compute: Any, *, device: str | None = None) -> float:
    """Virtual seconds one rank's training step takes without DDP under ``compute`` (the
    second of two steps; see :func:`step_phases`)."""
    ph = step_phases(scenario, compute, device=device)
    return ph["forward"] + ph["backward"] + ph["optimizer"]


def calibrate_compute(scenario: Any, compute: Any, seconds: float) -> tuple[Any, float]:
    """``compute`` scaled so that :func:`step_time` is ``seconds``; returns (model, factor)."""
    model, factor, _ = calibrated(scenario, compute, seconds)
    return model, factor


def calibrated(scenario: Any, compute: Any, seconds: float, device: str | None = None
                ) -> tuple[Any, float, dict[str, float]]:
    """:func:`calibrate_compute`, and the plain step's phases under the scaled model (each
    op's time × factor, so the phases scale with it); ``device``: :func:`step_phases`'s
    ("meta" for a real-size workload)."""
    if not seconds > 0:
        raise ValueError(f"step_time must be > 0 seconds, got {seconds!r}")
    phases = step_phases(scenario, compute, device=device)
    modelled = sum(phases.values())
    if not modelled > 0:
        raise ValueError(f"the compute model {compute!r} charges nothing for a step of "
                         f"{getattr(scenario, 'name', scenario)!r}, so it cannot be scaled "
                         f"to {seconds} s")
    factor = seconds / modelled
    return compute.scaled(factor), factor, {k: v * factor for k, v in phases.items()}
