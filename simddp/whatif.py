"""The what-if engine behind ``simddp whatif``: a workload, a compute model (optionally
calibrated to a measured step time), one capture, then a replay per configuration.

::

    from simddp.whatif import whatif
    rows = whatif("mlp", world_size=[64, 1024], network="ib-ndr", gpus_per_node=8,
                  bucket_cap_mb=[1, 25], rank_speed={3: 0.5})
    print(rows.table())

Steps:

1. the workload: a zoo scenario name (``fakepg.zoo.get``, ResNet-50/101 included) or a user
   script defining ``scenario`` (a ``fakepg.zoo.Scenario``, or a function returning one and
   taking the overrides, e.g. ``batch_size``), see :func:`load_workload`;
2. compute: ``Compute.kernels(gpu)``; with ``step_time`` it is scaled so that one rank's
   training step *without DDP* (zero_grad, forward, loss, backward, optimizer step; the last
   of two, so the optimizer's state exists) takes ``step_time`` seconds — the number users
   have from a single-GPU run (:func:`calibrate_compute`), timed on CPU tensors as the capture
   runs; DDP's own work in the capture is then charged at the uncalibrated device's cost
   (:mod:`simddp.models.ddp_overhead`), so a 1-rank DDP iteration is the step plus DDP's
   modelled overhead;
3. one capture (:func:`simddp.replay.capture`, torch's real DDP on ``capture_ranks`` fake
   ranks), then one replay per configuration (:func:`simddp.replay.sweep`'s rows), here or on
   an executor. Straggler ranks a world does not have are left out of that world's row.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import math
import os
import runpy
from typing import Any, Callable, Mapping

import torch

from .analysis.sweeps import SweepResult
from .models import Compute, Network, NetworkModel
from .timing import Timing
from .cosim.capture import capture
from .cosim.meta import in_meta_scope
from .program.knobs import Config, Knobs
from .cosim.simulate import now, simulate
from .sweep import Progress, run_configs

__all__ = ["whatif", "replay_grid", "load_workload", "step_time", "step_phases", "calibrate_compute",
           "network_for"]

def load_workload(spec: Any, **overrides: Any) -> Any:
    """The scenario ``spec`` names: a ``Scenario`` as is, a zoo name, or a ``.py`` script
    defining ``scenario``. ``overrides`` (e.g. ``batch_size=32``) go to the factory."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not isinstance(spec, (str, os.PathLike)):
        if overrides:
            return spec.with_(**overrides)
        return spec
    spec = os.fspath(spec)
    if spec.endswith(".py") or os.path.sep in spec:
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"workload script {spec!r} does not exist")
        ns = runpy.run_path(spec, run_name="__simddp_workload__")
        sc = ns.get("scenario")
        if sc is None:
            raise ValueError(
                f"workload script {spec!r} defines no `scenario`: define "
                f"`scenario = fakepg.zoo.Scenario(...)` (or `zoo.get('mlp', ...)`), or "
                f"`def scenario(**overrides)` returning one")
        if callable(sc) and not hasattr(sc, "build_model"):
            accepted = inspect.signature(sc).parameters
            takes_all = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
            unknown = [k for k in overrides if k not in accepted and not takes_all]
            if unknown:
                raise ValueError(f"workload script {spec!r}: scenario() takes no "
                                 f"{', '.join(unknown)}")
            return sc(**overrides)
        return load_workload(sc, **overrides)
    from fakepg import zoo

    factory = zoo.SCENARIOS.get(spec) or zoo.WORKLOADS.get(spec)
    if factory is None:
        known = sorted(zoo.SCENARIOS) + sorted(zoo.WORKLOADS)
        raise ValueError(f"unknown workload {spec!r}: give a zoo scenario ({', '.join(known)}) "
                         f"or a path to a .py script defining `scenario`")
    accepted = inspect.signature(factory).parameters
    unknown = [k for k in overrides if k not in accepted]
    if unknown:
        raise ValueError(f"workload {spec!r} has no {', '.join(unknown)} parameter "
                         f"(it takes: {', '.join(accepted)})")
    return zoo.get(spec, **overrides)


def _plain_steps(scenario: Any, steps: int, device: str
                 ) -> Callable[[int], list[dict[str, float]]]:
    """Each step's phases (as the capture splits a DDP step): forward (zero_grad, forward,
    loss), backward, optimizer."""
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
    model, factor, _ = _calibrated(scenario, compute, seconds)
    return model, factor


def _calibrated(scenario: Any, compute: Any, seconds: float, device: str | None = None
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


def network_for(spec: Any, gpus_per_node: int | None = None,
                contention: Any = "keep") -> NetworkModel:
    """A network model from a preset name or a ``simddp calibrate --json`` file
    (``gpus_per_node`` applied; the file's measured contention kept), or a model as is.
    ``contention``: "keep" (the model's own), None (none) or a
    :class:`~simddp.models.Contention` for every network."""
    if isinstance(spec, str):
        kw = {} if gpus_per_node is None else {"gpus_per_node": gpus_per_node}
        if spec.endswith(".json"):  # a `simddp calibrate --json` file
            net = Network.from_measurements(spec, **kw)
        else:
            net = Network.preset(spec, **kw)
    elif gpus_per_node is not None and isinstance(spec, Network):
        net = spec.with_(gpus_per_node=gpus_per_node)
    else:
        net = spec
    if isinstance(contention, str) and contention == "keep":
        return net
    if not hasattr(net, "with_"):
        raise TypeError(f"contention= needs a simddp.Network or MeasuredNetwork, got {net!r}")
    return net.with_(contention=contention)


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple, range)) else [v]


def replay_grid(captured: Any, *, world_size: Any, network: Any = "ib-ndr",
                gpus_per_node: int | None = None, bucket_cap_mb: Any = None,
                comm_hook: Any = None, rank_speed: Mapping[int, float] | None = None,
                executor: concurrent.futures.Executor | None = None,
                progress: Progress | None = None, title: str | None = None,
                replay_progress: Any = None, contention: Any = "keep",
                **knobs: Any) -> SweepResult:
    """Replay ``captured`` over world sizes × networks × bucket caps × comm hooks (lists or
    single values), stragglers ``rank_speed`` applied where the world has those ranks;
    ``contention``: see :func:`network_for`; ``knobs``: other :func:`~simddp.replay.replay`
    keywords (single values)."""
    nets = [network_for(n, gpus_per_node, contention) for n in _as_list(network)]
    speeds = dict(rank_speed or {})
    base = Knobs.of(**knobs)  # an unknown knob fails before any replay
    configs = []
    for n in _as_list(world_size):
        for net in nets:
            for cap_mb in _as_list(bucket_cap_mb):
                for hook in _as_list(comm_hook):
                    configs.append(Config(n, net, base.replace(
                        bucket_cap_mb=cap_mb, comm_hook=hook,
                        rank_speed={r: s for r, s in speeds.items() if r < n})))
    rows = run_configs(captured, configs, executor=executor, progress=progress,
                       replay_progress=replay_progress)
    return SweepResult(rows, captured=captured, configs=[c.as_kwargs() for c in configs],
                       title=title)


def _pipelines(workload: Any, sc: Any, spec: str, par: Any, worlds: list[int], schedules: Any,
               microbatches: Any, stages_per_rank: int | None, batch_size: int | None,
               timing: Timing, device: str, seed: int, param_dtype: str | None,
               reduce_dtype: str | None, activation_checkpointing: bool,
               say: Callable[[str], None], common: dict[str, Any]) -> list[SweepResult]:
    """A pipeline layout's rows: one capture per schedule and microbatch size (torch's real
    pipelining, FSDP2 / TP inside the stages), replayed per microbatch count."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from .cosim.capture_pp import capture_pp
    from .program.schedules import schedule_class

    if par.data == "ddp" and par.replicate > 1:
        raise ValueError(f"--parallel {spec}: pipeline stages are replicated with FSDP2 "
                         f"(pp:P,fsdp:N or hsdp:S, torchtitan's composition), not DDP")
    mesh: dict[str, int] = {"fsdp": {"shard": 2}, "hsdp": {"replicate": 2, "shard": 2}}.get(
        par.data, {})
    if par.tp > 1:
        mesh["tp"] = par.tp
    parts = []
    for name in _as_list(schedules) if schedules is not None else ["1F1B"]:
        single = issubclass(schedule_class(name), PipelineScheduleSingle)
        v = 1 if single else (stages_per_rank or 2)
        # the fewest microbatches every schedule takes at this depth (DualPipeV: one a stage)
        cap_m = max(2, par.pp * (v if "dualpipe" in name.lower() else 1))
        counts = _as_list(microbatches) if microbatches is not None else [cap_m]
        by_size: dict[int, list[int]] = {}
        for m in counts:
            if batch_size is not None and batch_size % m:
                raise ValueError(f"--microbatches {m} does not divide --batch-size {batch_size} "
                                 f"(a replica's batch per step)")
            by_size.setdefault(1 if batch_size is None else batch_size // m, []).append(m)
        for size, ms in by_size.items():
            scenario = load_workload(workload, batch_size=cap_m * size) \
                if isinstance(workload, (str, os.PathLike)) else sc
            say(f"capturing {sc.name} (torch's pipelining, {name}, {par.pp} × {v} stages, "
                f"{cap_m} microbatches of {size}{_inside(mesh)}) on "
                f"{par.pp * math.prod(mesh.values())} fake ranks")
            cap = capture_pp(scenario, par.pp, schedule=name, microbatches=cap_m,
                             stages_per_rank=v, mesh=mesh, timing=timing, device=device,
                             input_weight=1, output_weight=1,  # torchtitan's default split
                             activation_checkpointing=activation_checkpointing,
                             seed=seed, param_dtype=param_dtype if mesh.keys() - {"tp"} else None,
                             reduce_dtype=reduce_dtype if mesh.keys() - {"tp"} else None)
            for m in ms:
                parts.append(replay_grid(cap, world_size=worlds, parallel=spec,
                                         pp_schedule=name, microbatches=m,
                                         stages_per_rank=v, **common))
    return parts


def _inside(mesh: Mapping[str, int]) -> str:
    words = {"shard": "FSDP2", "tp": "tensor parallel"}
    inside = [f"{words[k]} {v}" for k, v in mesh.items() if k in words]
    return f"; {', '.join(inside)} inside" if inside else ""


def whatif(workload: Any, *, world_size: Any, network: Any = "ib-ndr",
           gpus_per_node: int | None = None, bucket_cap_mb: Any = None, comm_hook: Any = None,
           rank_speed: Mapping[int, float] | None = None, gpu: str = "a100",
           compute: Any = None, step_time_s: float | None = None,
           batch_size: int | None = None, capture_ranks: int = 1, iterations: int = 1,
           jitter: float = 0.0, seed: int = 0, parallel: Any = None,
           reshard_after_forward: Any = None, forward_prefetch: int = 1,
           backward_prefetch: int = 1, param_dtype: str | None = None,
           reduce_dtype: str | None = None, gpu_memory_gb: float | None = None,
           capture_device: str | None = None, activation_checkpointing: bool = False,
           pp_schedule: Any = None, microbatches: Any = None,
           stages_per_rank: int | None = None,
           executor: concurrent.futures.Executor | None = None,
           progress: Progress | None = None,
           status: Callable[[str], None] | None = None,
           replay_progress: Any = None, contention: Any = "keep",
           ddp_work_at_device_cost: bool = True, **knobs: Any) -> SweepResult:
    """One row per configuration of ``workload`` (see the module docstring). ``compute``
    overrides ``Compute.kernels(gpu)``; ``status(text)`` hears each stage as it starts.
    ``contention``: "keep" each network's own :class:`~simddp.models.Contention` (a calibrate
    file's measured one), None to drop it, or one for every network.

    ``parallel``: layouts (:class:`~simddp.program.parallel.Parallel` specs, e.g. ``"ddp"``,
    ``"fsdp"``, ``"hsdp:8"``, ``"fsdp:32,tp:8"``; default DDP); with ``tp:T`` the capture
    runs torchtitan's TP plan over T ranks under FSDP2 (2 × T fake ranks, 4 × T for HSDP).
    Each FSDP2 layout is captured with torch's real ``fully_shard`` once per
    ``reshard_after_forward`` value (and ``param_dtype`` / ``reduce_dtype``, its
    ``MixedPrecisionPolicy``), then replayed at every world size; a world
    size the layout does not divide is left out (``status`` says so). ``gpu_memory_gb``: the
    device memory for each row's OOM verdict (default: the ``gpu`` preset's).
    ``activation_checkpointing``: FSDP2 (with or without TP) and pipeline layouts run every
    block (of every stage) under torch's ``checkpoint_wrapper`` (torchtitan's full AC). ``capture_device``: "cpu" or "meta"
    (default: "meta" for the zoo's real-size workloads, whose step would not fit this
    machine's memory, else "cpu").
    Pipeline layouts (``pp:P,...``): ``pp_schedule`` (torch's schedule names, e.g. "1F1B",
    "Interleaved1F1B"; default 1F1B) and ``microbatches`` (counts) are swept; each schedule is
    captured with torch's real pipelining (:func:`~simddp.cosim.capture_pp.capture_pp`, FSDP2
    and TP inside the stages as the spec says) once per microbatch size, then replayed at every
    microbatch count and world size; blocks are split over stages as torchtitan splits them
    (the embedding and the head weigh one block each). ``batch_size`` is then a data-parallel replica's batch per
    step (default: one sequence per microbatch, torchtitan's default); ``stages_per_rank``: the
    multi-stage schedules' virtual stages (default 2).
    ``ddp_work_at_device_cost``: with ``step_time_s``, DDP's own work (bucket copies, its
    bookkeeping) is charged at the uncalibrated device's cost, not scaled with the model's
    compute (:mod:`simddp.models.ddp_overhead`); False scales it too (as before). ``knobs``:
    further :class:`~simddp.program.knobs.Knobs` fields (single values), e.g. ``overlap=False``.
    The result's ``meta`` dict says what was modelled (compute, calibration factor)."""
    from .cosim.capture_fsdp import capture_fsdp
    from .models.compute import gpu_spec
    from .program.parallel import Parallel

    say = status or (lambda text: None)
    sc = load_workload(workload, batch_size=batch_size)
    # a real-size workload (Llama 3 8B/70B) is captured on the meta device: shapes only
    device = capture_device or ("meta" if "real-size" in getattr(sc, "features", ()) else "cpu")
    model = Compute.kernels(gpu) if compute is None else compute  # the default model
    factor = None
    if step_time_s is not None:
        say(f"calibrating compute: one rank's step without DDP = {step_time_s * 1e3:g} ms")
        model, factor, plain = _calibrated(sc, model, step_time_s,
                                           device if device == "meta" else None)
    if gpu_memory_gb is None and compute is None:
        gpu_memory_gb = gpu_spec(gpu).memory_GB
    first_net = network_for(_as_list(network)[0], gpus_per_node, contention)
    timing = Timing(network=first_net, compute=model)
    title = f"{sc.name}, {gpu if compute is None else 'custom'} compute" + (
        f" ×{factor:.3g} ({step_time_s * 1e3:g} ms step)" if factor else "")
    common = dict(network=network, gpus_per_node=gpus_per_node, rank_speed=rank_speed,
                  executor=executor, progress=progress, title=title,
                  replay_progress=replay_progress, contention=contention,
                  iterations=iterations, jitter=jitter, seed=seed, gpu_memory_gb=gpu_memory_gb,
                  **knobs)
    parts = []
    for spec in _as_list(parallel) if parallel is not None else ["ddp"]:
        worlds = []
        for n in _as_list(world_size):
            try:
                par = Parallel.parse(spec, n)
            except ValueError as e:
                say(f"{spec} at {n} ranks left out: {e}")
                continue
            worlds.append(n)
        if not worlds:
            raise ValueError(f"--parallel {spec}: no world size of {_as_list(world_size)} "
                             f"fits it")
        if par.not_replayed():
            raise ValueError(f"--parallel {spec}: {par.not_replayed()}")
        if par.pp > 1:
            parts.extend(_pipelines(workload, sc, spec, par, worlds, pp_schedule, microbatches,
                                    stages_per_rank, batch_size, timing, device, seed,
                                    param_dtype, reduce_dtype, activation_checkpointing, say,
                                    common))
            continue
        if par.data == "ddp":
            if activation_checkpointing:
                raise ValueError(f"--parallel {spec}: activation checkpointing is captured for "
                                 f"FSDP2, tensor and pipeline layouts (fsdp, hsdp:S, tp:T, "
                                 f"pp:P), not for DDP's")
            say(f"capturing {sc.name} (torch's DDP) on {capture_ranks} fake rank(s)")
            cap = capture(sc, nprocs=capture_ranks, timing=timing, seed=seed,
                          device=device)
            if factor is not None and ddp_work_at_device_cost:
                # DDP's own work is proportional to the parameters, not the calibrated compute
                cap = cap.with_ddp_work_at_device_cost(plain, factor)
            parts.append(replay_grid(cap, world_size=worlds, bucket_cap_mb=bucket_cap_mb,
                                     comm_hook=comm_hook, parallel=None if spec == "ddp"
                                     else spec, **common))
            continue
        # the capture: 2 shards (2 × 2 for HSDP), times the TP degree replayed (each degree
        # has its own shapes and TP collectives)
        mesh = {"shard": 2} if par.data == "fsdp" else {"replicate": 2, "shard": 2}
        if par.tp > 1:
            mesh["tp"] = par.tp
        nranks = math.prod(mesh.values())
        tp_note = f" with tensor parallelism tp={par.tp}" if par.tp > 1 else ""
        for raf in _as_list(reshard_after_forward) if reshard_after_forward is not None \
                else [True]:
            say(f"capturing {sc.name} (torch's FSDP2 fully_shard{tp_note}, "
                f"reshard_after_forward={raf}) on {nranks} fake ranks")
            cap = capture_fsdp(sc, nranks, timing=timing, mesh=mesh,
                               reshard_after_forward=bool(raf), param_dtype=param_dtype,
                               reduce_dtype=reduce_dtype, seed=seed, device=device,
                               activation_checkpointing=activation_checkpointing)
            parts.append(replay_grid(cap, world_size=worlds, parallel=spec,
                                     reshard_after_forward=bool(raf),
                                     forward_prefetch=forward_prefetch,
                                     backward_prefetch=backward_prefetch, **common))
    res = parts[0] if len(parts) == 1 else SweepResult.concat(parts, title=title)
    res.meta = {"workload": sc.name, "compute": repr(model), "calibration_factor": factor,
                "step_time_s": step_time_s, "capture_ranks": capture_ranks,
                "gpu_memory_gb": gpu_memory_gb}
    return res
