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
   ranks), then one replay per configuration (:func:`simddp.sweep`'s rows), here or on
   an executor. Straggler ranks a world does not have are left out of that world's row.

Step 2's plain step and calibration are :mod:`simddp.plain_step`'s; what each option applies
to (refused otherwise) is :mod:`simddp.whatif_checks`'.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import inspect
import json
import os
import runpy
from typing import Any, Callable, Mapping

from .analysis.sweeps import SweepResult
from .models import Network, NetworkModel
from .timing import Timing
from .program.knobs import Config, Knobs
from .program.parallel import UsageError
from .program.registry import CaptureOptions
from .sweep import Progress, run_configs
from .plain_step import calibrate_compute, calibrated, step_phases, step_time
from .whatif_checks import AC_POLICIES  # noqa: F401 - importable from here, as before
from .whatif_checks import ac_policy, as_list, fitting, refuse_what_does_not_apply, with_options

__all__ = ["whatif", "replay_grid", "load_workload", "step_time", "step_phases", "calibrate_compute",
           "network_for"]


def load_workload(spec: Any, **overrides: Any) -> Any:
    """The scenario ``spec`` names: a ``Scenario`` as is, a zoo name, a ``.py`` script
    defining ``scenario``, or any model :func:`simddp.jobs.resolve_model` takes (a Hugging
    Face config.json, a torchtitan flavor, a shape). ``overrides`` (e.g. ``batch_size=32``)
    go to the factory."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not isinstance(spec, (str, os.PathLike)):
        if overrides:
            return spec.with_(**overrides)
        return spec
    spec = os.fspath(spec)
    if spec.endswith(".py") or (os.path.sep in spec and not spec.endswith(".json")
                                and not os.path.isdir(spec)):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"workload script {spec!r} does not exist")
        try:
            ns = runpy.run_path(spec, run_name="__simddp_workload__")
        except Exception as e:  # the user's script failed: say where, without a traceback
            raise RuntimeError(f"workload script {spec!r} failed: {type(e).__name__}: "
                               f"{e}") from e
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
            made = sc(**overrides)
            if not hasattr(made, "build_model"):
                raise ValueError(f"workload script {spec!r}: scenario() returned a "
                                 f"{type(made).__name__}, not a fakepg.zoo.Scenario")
            return made
        if not (callable(sc) or hasattr(sc, "build_model")):
            raise ValueError(f"workload script {spec!r}: `scenario` is a {type(sc).__name__} "
                             f"({sc!r:.40}); define `scenario = fakepg.zoo.Scenario(...)` (or "
                             f"`zoo.get('mlp', ...)`), or `def scenario(**overrides)` returning one")
        return load_workload(sc, **overrides)
    from fakepg import zoo

    factory = zoo.SCENARIOS.get(spec) or zoo.WORKLOADS.get(spec)
    if factory is None:
        from .jobs.models import resolve_model, zoo_key

        if zoo_key(spec) is not None:  # the other spelling: llama3_8b, bert-base
            return load_workload(zoo_key(spec), **overrides)
        # a Hugging Face config.json, a torchtitan flavor, a shape (simddp.jobs); its error
        # names every form a workload takes
        sc = resolve_model(spec)
        return sc.with_(**overrides) if overrides else sc
    accepted = inspect.signature(factory).parameters
    unknown = [k for k in overrides if k not in accepted]
    if unknown:
        raise ValueError(f"workload {spec!r} has no {', '.join(unknown)} parameter "
                         f"(it takes: {', '.join(accepted)})")
    return zoo.get(spec, **overrides)


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
    nets = [network_for(n, gpus_per_node, contention) for n in as_list(network)]
    speeds = dict(rank_speed or {})
    base = Knobs.of(**knobs)  # an unknown knob fails before any replay
    configs = []
    for n in as_list(world_size):
        for net in nets:
            for cap_mb in as_list(bucket_cap_mb):
                for hook in as_list(comm_hook):
                    configs.append(Config(n, net, base.replace(
                        bucket_cap_mb=cap_mb, comm_hook=hook,
                        rank_speed={r: s for r, s in speeds.items() if r < n})))
    rows = run_configs(captured, configs, executor=executor, progress=progress,
                       replay_progress=replay_progress)
    return SweepResult(rows, captured=captured, configs=[c.as_kwargs() for c in configs],
                       title=title)


def _pipeline_variants(workload: Any, par: Any, schedules: Any, microbatches: Any,
                       stages_per_rank: int | None, batch_size: int | None,
                       base: CaptureOptions) -> list[tuple[int | None, CaptureOptions,
                                                           list[dict[str, Any]]]]:
    """A pipeline layout's captures: one per schedule and microbatch size (torch's real
    pipelining, FSDP2 / TP inside the stages), each replayed per microbatch count: a list of
    (the batch the workload is built with — None: the what-if's own scenario —, capture
    options, [replay knobs per microbatch count])."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from .program.schedules import schedule_class

    out = []
    for name in as_list(schedules) if schedules is not None else ["1F1B"]:
        single = issubclass(schedule_class(name), PipelineScheduleSingle)
        if single and stages_per_rank not in (None, 1):
            raise UsageError(f"--stages-per-rank {stages_per_rank}: {name} runs one stage per "
                             f"rank; virtual stages apply to the multi-stage schedules "
                             f"(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                             f"ZBVZeroBubble, DualPipeV)")
        v = 1 if single else (stages_per_rank or 2)
        # the fewest microbatches every schedule takes at this depth (DualPipeV: one a stage)
        cap_m = max(2, par.pp * (v if "dualpipe" in name.lower() else 1))
        counts = as_list(microbatches) if microbatches is not None else [cap_m]
        by_size: dict[int, list[int]] = {}
        for m in counts:
            if batch_size is not None and batch_size % m:
                raise UsageError(f"--microbatches {m} does not divide --batch-size {batch_size} "
                                 f"(a replica's batch per step)")
            by_size.setdefault(1 if batch_size is None else batch_size // m, []).append(m)
        for size, ms in by_size.items():
            # a name, or a workload that resizes itself (simddp.jobs.ModelScenario)
            batch = cap_m * size \
                if isinstance(workload, (str, os.PathLike)) or hasattr(workload, "recipe") \
                else None
            opts = base.replace(pp_schedule=name, microbatches=cap_m, microbatch_size=size,
                                stages_per_rank=v)
            out.append((batch, opts, [dict(pp_schedule=name, microbatches=m,
                                              stages_per_rank=v) for m in ms]))
    return out


def whatif(workload: Any, *, world_size: Any, network: Any = "ib-ndr",
           gpus_per_node: int | None = None, bucket_cap_mb: Any = None, comm_hook: Any = None,
           rank_speed: Mapping[int, float] | None = None, gpu: str = "a100",
           compute: Any = None, step_time_s: float | None = None,
           batch_size: int | None = None, capture_ranks: int | None = None, iterations: int = 1,
           jitter: float = 0.0, seed: int = 0, parallel: Any = None,
           reshard_after_forward: Any = None, forward_prefetch: int | None = None,
           backward_prefetch: int | None = None, param_dtype: str | None = None,
           reduce_dtype: str | None = None, gpu_memory_gb: float | None = None,
           capture_device: str | None = None, activation_checkpointing: Any = None,
           sequence_parallel: bool = True, compile: bool = False, float8: bool = False,
           async_tp: bool = False, cache: bool | None = None,
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
    ``"fsdp"``, ``"hsdp:8"``, ``"dp:8,tp:8"``, ``"zero3"``, ``"fsdp:32,tp:8"``; default DDP),
    each parsed once against the parallelism registry (:mod:`simddp.program.registry`), which
    names its capture (:mod:`simddp.parallelisms`) and planner; every layout and option is
    checked before the first capture runs, and an option that does not apply to a layout is
    refused (:class:`~simddp.program.parallel.UsageError`). With ``tp:T`` the capture
    runs torchtitan's TP plan over T ranks under FSDP2 (2 × T fake ranks, 4 × T for HSDP;
    ``sequence_parallel=False``: the plain colwise/rowwise plan).
    Each FSDP2 layout is captured with torch's real ``fully_shard`` once per
    ``reshard_after_forward`` value (and ``param_dtype`` / ``reduce_dtype``, its
    ``MixedPrecisionPolicy``), then replayed at every world size; a world
    size the layout does not divide is left out (``status`` says so). ``gpu_memory_gb``: the
    device memory for each row's OOM verdict (default: the ``gpu`` preset's).
    ``activation_checkpointing``: FSDP2 (with or without TP) and pipeline layouts run their
    blocks under torchtitan's policy (:mod:`simddp.cosim.checkpointing`: "full" or True,
    "selective-op", "selective-layer:N"; None/"none": off). ``compile``, ``float8``,
    ``async_tp``: priced by a compute model with ``with_options``, refused otherwise.
    ``cache``: reuse captures from the on-disk cache (:mod:`simddp.capture_cache`; None: unless
    ``$SIMDDP_NO_CACHE`` is set). ``capture_device``: "cpu" or "meta"
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
    from .capture_cache import by_ref, cached, enabled_by_default
    from .parallelisms import describe
    from .program.registry import CaptureRequest

    say = status or (lambda text: None)
    specs = as_list(parallel) if parallel is not None else ["ddp"]
    worlds_all = as_list(world_size)
    layouts = [(spec, *fitting(spec, worlds_all, say)) for spec in specs]
    given = dict(reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype,
                 param_dtype=param_dtype,
                 forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
                 pp_schedule=pp_schedule, microbatches=microbatches,
                 stages_per_rank=stages_per_rank, bucket_cap_mb=bucket_cap_mb,
                 comm_hook=comm_hook, capture_ranks=capture_ranks,
                 sequence_parallel=sequence_parallel, async_tp=async_tp)
    for spec, par, _ in layouts:  # every layout is checked before the first capture runs
        why = par.not_replayed()
        if why:
            raise UsageError(f"--parallel {spec}: {why}")
        refuse_what_does_not_apply(spec, par, given)
    ac = ac_policy(activation_checkpointing)
    # FSDP2's default prefetch (one unit ahead); None above meant "not given"
    forward_prefetch = 1 if forward_prefetch is None else forward_prefetch
    backward_prefetch = 1 if backward_prefetch is None else backward_prefetch
    enabled = enabled_by_default() if cache is None else bool(cache)
    first_net = network_for(as_list(network)[0], gpus_per_node, contention)
    built: dict[str, Any] = {}  # the workload, compute model and device: built on first need

    def workload_and_model() -> tuple[Any, Any, str]:
        if not built:
            sc = load_workload(workload, batch_size=batch_size)
            # a real-size workload (Llama 3 8B/70B) is captured on the meta device: shapes only
            built["device"] = capture_device or (
                "meta" if "real-size" in getattr(sc, "features", ()) else "cpu")
            if compute is None:  # the default: kernels as they run, torch.compile/Float8 priced
                from .models import Compute

                built["model"] = with_options(Compute.kernels(gpu, compile=compile,
                                                               float8=float8), async_tp=async_tp)
            else:
                built["model"] = with_options(compute, compile=compile, float8=float8,
                                               async_tp=async_tp)
            built["sc"] = sc
        return built["sc"], built["model"], built["device"]

    # the rows say which compute options were priced (the compute model read them)
    knobs.update({k: True for k, v in (("compile", compile), ("float8", float8),
                                        ("async_tp", async_tp)) if v})
    factor = None
    if step_time_s is not None:
        say(f"calibrating compute: one rank's step without DDP = {step_time_s * 1e3:g} ms")
        sc, model, device = workload_and_model()
        built["model"], factor, plain = calibrated(sc, model, step_time_s,
                                                    device if device == "meta" else None)
    if gpu_memory_gb is None and compute is None:
        from .models.devices import gpu_spec

        gpu_memory_gb = gpu_spec(gpu).memory_GB
    # what a capture found in the cache by the request as given tells instead of a build
    facts: dict[str, Any] = {}

    def fact(name: str) -> Any:
        if not built and name in facts:
            return facts[name]
        sc, model, device = workload_and_model()
        return {"workload": sc.name, "compute": repr(model), "device": device}[name]

    def title() -> str:
        return f"{fact('workload')}, {gpu if compute is None else 'custom'} compute" + (
            f" ×{factor:.3g} ({step_time_s * 1e3:g} ms step)" if factor else "")

    common = dict(network=network, gpus_per_node=gpus_per_node, rank_speed=rank_speed,
                  executor=executor, progress=progress,
                  replay_progress=replay_progress, contention=contention,
                  iterations=iterations, jitter=jitter, seed=seed, gpu_memory_gb=gpu_memory_gb,
                  **knobs)
    base = CaptureOptions(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                          activation_checkpointing=ac, sequence_parallel=sequence_parallel,
                          capture_ranks=capture_ranks or 1)
    parts = []
    for spec, par, worlds in layouts:
        owner = par.owner()
        if owner.name == "pp":
            variants = _pipeline_variants(workload, par, pp_schedule, microbatches,
                                          stages_per_rank, batch_size, base)
        # FSDP2's capture options and knobs: its flavours', and context parallelism's (FSDP2
        # over shard × cp)
        elif (owner.data in ("fsdp", "hsdp") or owner.name == "cp") and \
                par.reshard_after_forward is None:
            variants = [(None, base.replace(reshard_after_forward=bool(raf)),
                         [dict(reshard_after_forward=bool(raf),
                               forward_prefetch=forward_prefetch,
                               backward_prefetch=backward_prefetch)])
                        for raf in (as_list(reshard_after_forward)
                                    if reshard_after_forward is not None else [True])]
        elif owner.data in ("fsdp", "hsdp") or owner.name == "cp":
            variants = [(None, base.replace(reshard_after_forward=par.reshard_after_forward),
                         [dict(reshard_after_forward=par.reshard_after_forward,
                               forward_prefetch=forward_prefetch,
                               backward_prefetch=backward_prefetch)])]
        else:
            variants = [(None, base, [dict(bucket_cap_mb=bucket_cap_mb, comm_hook=comm_hook)])]
        for batch, opts, replays in variants:
            ref = _request_key(workload, batch_size if batch is None else batch, par, opts,
                               first_net, seed, capture_device,
                               [gpu, compile, float8, async_tp]) \
                if enabled and compute is None and step_time_s is None else None
            found = by_ref(ref, note=say) if ref is not None else None
            if found is not None:
                cap, more_facts = found
                facts.update(more_facts)
            else:
                sc, model, device = workload_and_model()
                scenario = sc if batch is None else load_workload(workload, batch_size=batch)
                req = CaptureRequest(scenario, par, Timing(network=first_net, compute=model),
                                     device, seed, opts)

                def run(req: CaptureRequest = req) -> Any:
                    say(describe(req))
                    return owner.load("capture")(req)

                cap, _ = cached(req, par.capture_key(), run, note=say, enabled=enabled,
                                ref=None if ref is None else (ref, {
                                    "workload": sc.name, "compute": repr(model),
                                    "device": device}))
            if owner.name == "ddp" and factor is not None and ddp_work_at_device_cost:
                # DDP's own work is proportional to the parameters, not the calibrated compute
                cap = cap.with_ddp_work_at_device_cost(plain, factor)
            for more in replays:
                parts.append(replay_grid(cap, world_size=worlds,
                                         parallel=None if spec == "ddp" else spec,
                                         **more, **common, title=title()))
    res = parts[0] if len(parts) == 1 else SweepResult.concat(parts, title=title())
    res.meta = {"workload": fact("workload"), "compute": fact("compute"),
                "calibration_factor": factor, "step_time_s": step_time_s,
                "capture_ranks": capture_ranks, "gpu_memory_gb": gpu_memory_gb,
                "capture_device": fact("device")}
    return res


def _request_key(workload: Any, batch_size: int | None, par: Any, opts: CaptureOptions,
                 network: Any, seed: int, capture_device: str | None,
                 compute: list[Any]) -> str | None:
    """A key over a capture request as the user gave it — the workload's name or config
    file, the layout, the options, the default compute model's GPU preset and options
    (``compute``), the network, the
    seed, the code — so a cached capture is found without building the workload (no torch
    model, no transformers); None for a workload given as an object or a script, which only
    its build describes (:func:`~simddp.capture_cache.capture_key` keys those)."""
    from .capture_cache import Unkeyable, code_version, stable

    if not isinstance(workload, (str, os.PathLike)):
        return None
    text = os.fspath(workload)
    if text.endswith(".py") or os.path.isdir(text):
        return None
    if os.path.isfile(text):  # a config file: its name and what it says
        with open(text, "rb") as f:
            described: Any = ["file", os.path.abspath(text), hashlib.sha256(f.read()).hexdigest()]
    elif os.path.sep in text:  # load_workload reads it as a script (and says it is missing)
        return None
    else:  # a zoo name, a torchtitan flavor, a shape
        described = ["name", text]
    try:
        parts = {"workload": described, "batch_size": batch_size, "layout": par.capture_key(),
                 "options": stable(opts), "compute": compute, "network": stable(network),
                 "device": capture_device, "seed": seed, "code": code_version()}
    except Unkeyable:
        return None
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
