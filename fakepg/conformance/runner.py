"""``run_scenario``: one scenario (or several) on fake ranks or on real gloo/NCCL processes."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pickle
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..torch_private import get_default_group
from ..arguments import integer
from ..world.isolation import ProcessState
from ..launch.spawn import spawn
from .outcome import RecordedCollective, ScenarioOutcome
from .programs import DEFAULT_TRAIN
from .recording import RECORDING_BACKENDS, RECORDS, register_recording_backends

__all__ = ["run_scenario", "BACKENDS"]

BACKENDS = ("fake", "fake-cuda", "gloo", "nccl")

# DDP logging keys that depend on the backend, the launcher or the clock, not on DDP's decisions.
_LOGGING_DROP = frozenset({
    "backend_name", "cuda_visible_devices", "master_addr", "master_port",
    "torch_distributed_debug", "device_ids", "output_device",
})
_LOGGING_DROP_PREFIXES = ("nccl_", "gloo_")


def run_scenario(scenario: Any, world_size: int, backend: str = "fake", *, seed: int = 0,
                 device: str | torch.device = "cpu", train: Callable[..., Any] | None = None,
                 timeout: float = 300.0, personality: str = "fakepg") -> Any:
    """Run ``scenario`` on ``world_size`` ranks of ``backend``; return a :class:`ScenarioOutcome`.

    ``scenario`` may also be a list of scenarios: they then run one after another in *one*
    world (for gloo/NCCL: one set of processes, so process start-up is paid once), and a list
    of outcomes comes back, one per scenario, each with only its own collectives.

    Args:
        backend: ``"fake"``, ``"fake-cuda"``, ``"gloo"`` or ``"nccl"`` (see the package doc).
        seed: for ``"fake"`` the spawn seed; on the real backends each rank's unseeded torch,
            Python and numpy RNGs are set to the same per-rank states fakepg would give them.
        device: tensors' device for ``"fake"`` (``"fake-cuda"`` forces ``cuda:0``; ``"nccl"``
            uses ``cuda:rank``; ``"gloo"`` honours it, CPU by default).
        train: ``train(scenario, rank, world_size, device) -> DDP model``; default
            ``fakepg.zoo.TrainLoop()`` (the zoo's training loop, Join when counts differ). With
            a list of scenarios, also a list: one train function per scenario. Must pickle for
            the multi-process backends.
        timeout: seconds before a multi-process run is declared hung; its processes are then
            killed (the process group's own timeout is the same).
        personality: the fake world's backend personality (``fakepg.spawn``'s ``backend``):
            ``"gloo"`` sums in gloo's order, so its final states are a gloo run's bit for bit;
            the default ``"fakepg"`` sums in rank order, as ``zoo.reference_train`` does.

    Raises:
        RuntimeError: a rank failed on a real backend (the rank's traceback is in the message),
            or the run exceeded ``timeout``.
        fakepg.RankFailedError / CollectiveHangError / ...: the fake run failed.
    """
    single = not isinstance(scenario, (list, tuple))
    scenarios = [scenario] if single else list(scenario)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    world_size = integer("run_scenario: world_size", world_size, minimum=1)
    if isinstance(train, (list, tuple)):
        if single or len(train) != len(scenarios):
            raise ValueError(f"train: a list of train functions needs a list of as many scenarios "
                             f"(got {len(train)} for {len(scenarios) if not single else 'one scenario'})")
        trains = [t or DEFAULT_TRAIN for t in train]
    else:
        trains = [train or DEFAULT_TRAIN] * len(scenarios)
    if backend in ("fake", "fake-cuda"):
        dev = torch.device("cuda", 0) if backend == "fake-cuda" else _normalise_device(device)
        outcomes = [_run_fake(sc, world_size, backend, seed, dev, t, personality)
                    for sc, t in zip(scenarios, trains)]
    else:
        outcomes = _run_multiprocess(scenarios, world_size, backend, seed, device, trains, timeout)
    return outcomes[0] if single else outcomes


def _normalise_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _scenario_name(sc: Any) -> str:
    return str(getattr(sc, "name", type(sc).__name__))


def _rank_result(model: Any, collectives: list[RecordedCollective], wall: float) -> dict[str, Any]:
    """What a rank sends home: logging subset, CPU state, parameter names, trace, time."""
    module = getattr(model, "module", model)
    logging: dict[str, Any] = {}
    if hasattr(model, "_get_ddp_logging_data"):
        logging = {k: v for k, v in model._get_ddp_logging_data().items()
                   if k not in _LOGGING_DROP and "time" not in k
                   and not k.startswith(_LOGGING_DROP_PREFIXES)}
    state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    names = [n for n, _ in module.named_parameters()]
    return {"collectives": collectives, "logging": logging, "state": state, "params": names,
            "wall": wall}


def _outcome(scenario: Any, backend: str, world_size: int, seed: int, device: Any,
             per_rank: list[dict[str, Any]], collectives: list[list[RecordedCollective]],
             wall: float, launch: float) -> ScenarioOutcome:
    return ScenarioOutcome(
        scenario=_scenario_name(scenario), backend=backend, world_size=world_size,
        collectives=collectives, ddp_logging=[r["logging"] for r in per_rank],
        states=[r["state"] for r in per_rank], param_names=frozenset(per_rank[0]["params"]),
        wall_time=wall, launch_time=launch, device=str(device), seed=seed)


# -- fake ranks ------------------------------------------------------------------------------


def _fake_rank(rank: int, scenario: Any, world_size: int, device: torch.device,
               train: Callable[..., Any]) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model = train(scenario, rank, world_size, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _rank_result(model, [], time.perf_counter() - t0)


def _run_fake(scenario: Any, world_size: int, backend: str, seed: int, device: torch.device,
              train: Callable[..., Any], personality: str = "fakepg") -> ScenarioOutcome:
    res = spawn(_fake_rank, args=(scenario, world_size, device, train), nprocs=world_size, seed=seed,
                backend=personality)
    collectives = [[RecordedCollective(r.op, tuple(r.group_ranks), tuple(tuple(s) for s in r.shapes),
                                       tuple(r.dtypes)) for r in recs] for recs in res.trace]
    return _outcome(scenario, backend, world_size, seed, device, res.returns, collectives,
                    res.wall_time, 0.0)


# -- real processes --------------------------------------------------------------------------


def _run_multiprocess(scenarios: list[Any], world_size: int, backend: str, seed: int,
                      device: str | torch.device, trains: list[Callable[..., Any]],
                      timeout: float) -> list[ScenarioOutcome]:
    if backend == "nccl":
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError("backend 'nccl' needs CUDA and a torch built with NCCL")
        n = torch.cuda.device_count()
        if world_size > n:
            raise ValueError(f"backend 'nccl' puts rank r on cuda:r: world_size {world_size} needs "
                             f"{world_size} GPUs, this machine has {n} (NCCL refuses two ranks on one GPU)")
        device = "cuda"
    else:
        device = str(_normalise_device(device)) if torch.device(device).type == "cuda" else str(device)
    try:
        pickle.dumps((scenarios, trains))
    except Exception as e:  # noqa: BLE001 - re-raised with the reason
        raise TypeError(f"run_scenario(backend={backend!r}) sends the scenario and train function to "
                        f"child processes, but they do not pickle: {e}") from e
    names = ", ".join(_scenario_name(s) for s in scenarios)
    tmp = tempfile.mkdtemp(prefix="fakepg-conformance-")
    t0 = time.perf_counter()
    try:
        for attempt in range(3):
            try:
                _start_and_join(world_size, (world_size, backend, scenarios, trains, seed, device,
                                             os.path.join(tmp, f"store{attempt}"), tmp, timeout),
                                timeout, f"{backend} run of [{names}] on {world_size} ranks", tmp)
                break
            except _TeardownAbort:
                if attempt == 2:
                    raise
                t0 = time.perf_counter()
        total = time.perf_counter() - t0
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                    for r in range(world_size)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    busy = sum(max(per_rank[r][i]["wall"] for r in range(world_size)) for i in range(len(scenarios)))
    launch = max(total - busy, 0.0)
    out = []
    for i, sc in enumerate(scenarios):
        rows = [per_rank[r][i] for r in range(world_size)]
        out.append(_outcome(sc, backend, world_size, seed, torch.device(device) if backend == "gloo"
                            else "cuda:rank", rows, [row["collectives"] for row in rows],
                            max(row["wall"] for row in rows), launch))
    return out


class _TeardownAbort(RuntimeError):
    """A rank process died of SIGABRT: real gloo sometimes aborts a process as it tears down
    ("terminate called without an active exception"). The reference run is tried again."""


def _start_and_join(world_size: int, args: tuple, timeout: float, what: str, out_dir: str) -> None:
    """Start one process per rank (spawn start method), wait for all of them; on failure or
    after ``timeout`` seconds raise ``RuntimeError`` naming ``what`` with the failed ranks'
    tracebacks (saved in ``out_dir``). No process outlives it."""
    import torch.multiprocessing as mp

    ctx = None
    try:
        ctx = mp.start_processes(_multiprocess_rank, args=args, nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ctx.join(timeout=0.2):
                    return
            except Exception as e:  # ProcessRaisedException / ProcessExitedException
                text = f"{what} failed: {e}{_rank_tracebacks(out_dir, world_size, str(e))}"
                if getattr(e, "signal_name", None) == "SIGABRT":
                    raise _TeardownAbort(text) from None
                raise RuntimeError(text) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not finish within {timeout:.0f} s (hung?); "
                                   f"its processes were killed")
    finally:
        if ctx is not None:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()


def _rank_tracebacks(out_dir: str, world_size: int, reported: str) -> str:
    """The tracebacks the failed ranks saved that torch's report lacks: when a rank fails, its
    peers fail too (connection closed), and torch reports whichever exit it notices first."""
    out = ""
    for rank in range(world_size):
        with contextlib.suppress(OSError):
            with open(os.path.join(out_dir, f"rank{rank}.error")) as f:
                text = f.read()
            if text.strip().splitlines()[-1] not in reported:  # the exception's own line
                out += f"\n\n-- Rank {rank} failed with:\n{text}"
    return out


def _install_rank_state(rank: int, world_size: int, seed: int) -> None:
    """The RNG states and launcher environment ``fakepg.spawn`` gives rank ``rank``, so both
    sides draw the same; this process's real torch.distributed world is left as it is."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
           "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    state = ProcessState.for_rank(rank, world_size, seed, env)
    state.c10d = {}
    state.install()


def _multiprocess_rank(rank: int, world_size: int, backend: str, scenarios: list[Any],
                       trains: list[Callable[..., Any]], seed: int, device: str, store_path: str,
                       out_dir: str, timeout: float) -> None:
    """Child process body: one rank of a real gloo/NCCL world running every scenario."""
    _install_rank_state(rank, world_size, seed)
    register_recording_backends()
    # One process per rank: share the cores between them (oversubscribed intra-op threads make
    # a 2-rank run on 2 cores ~20x slower), and import DDP before any scenario is timed.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))
    for mod in ("torch.distributed.algorithms.join", "torch.nn.parallel.distributed"):
        importlib.import_module(mod)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    results = []
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend=RECORDING_BACKENDS[backend], store=store, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        inner = get_default_group()._inner
        sync = torch.zeros(1, device=dev if backend == "nccl" else "cpu")
        for sc, train in zip(scenarios, trains):
            inner.allreduce([sync]).wait()  # unrecorded: scenarios start together
            _install_rank_state(rank, world_size, seed)
            RECORDS.clear()
            t0 = time.perf_counter()
            model = train(sc, rank, world_size, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
            results.append(_rank_result(model, list(RECORDS), wall))
            del model
        inner.allreduce([sync]).wait()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception:
        # Saved before the process group is torn down: that can block until the parent kills
        # this process, and torch's own error file, written after, would then be lost.
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
