"""Conformance runner: the same DDP scenario on fakepg and on a real backend, compared.

Step 2 of the verification ladder (fake cluster = real gloo, multi-process) and the NCCL legs of
step 4, in one API::

    import fakepg, models
    sc = models.get("grad_order_differs_per_rank")
    fake = fakepg.run_scenario(sc, 2)                         # fakepg.spawn, 2 rank threads
    gloo = fakepg.run_scenario(sc, 2, backend="gloo")         # 2 processes, real gloo
    fakepg.assert_conformant(fake, gloo)    # same collectives, buckets, final parameters

A *scenario* is any object with the attributes of ``models.Scenario`` (duck typing: fakepg does
not import ``models``): ``name``, ``build_model()`` (or ``model()`` plus ``seed``),
``inputs(rank, world_size)``, ``step(model, batch)``, ``optimizer(params)``, ``ddp_kwargs``.
For the multi-process backends it must pickle (zoo scenarios do).

Backends:

* ``"fake"``: :func:`fakepg.spawn`, ranks as threads (tensors on ``device``, CPU by default);
* ``"fake-cuda"``: the same with every rank's tensors on ``cuda:0``;
* ``"gloo"``: one process per rank (``torch.multiprocessing``, spawn start method), rendezvous
  through a ``FileStore`` in a temporary directory;
* ``"nccl"``: the same with NCCL, rank r on ``cuda:r`` (torchrun-style environment); needs
  ``world_size`` GPUs.

On the real backends the default process group is a *recording wrapper*: a Python
``dist.ProcessGroup`` subclass that forwards every collective to the real gloo/NCCL backend and
records it (op named as fakepg's trace names it, group, shapes, dtypes). DDP, its C++ Reducer,
Join and comm hooks all run on that wrapper, exactly as they run on fakepg's process group, so
both sides' collective sequences are observed at the same interface.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .isolation import derive_seed
from .process_group import PythonProcessGroup

__all__ = [
    "run_scenario",
    "ScenarioOutcome",
    "Collective",
    "TrainLoop",
    "CollectiveTour",
    "compare",
    "assert_conformant",
    "default_tolerance",
    "RecordingProcessGroup",
    "BACKENDS",
]

BACKENDS = ("fake", "fake-cuda", "gloo", "nccl")

# Names under which the recording wrappers are registered as torch.distributed backends.
_RECORDING_BACKENDS = {"gloo": "fakepg_recorded_gloo", "nccl": "fakepg_recorded_nccl"}

# DDP logging keys that depend on the backend, the launcher or the clock, not on DDP's decisions.
_LOGGING_DROP = frozenset({
    "backend_name", "cuda_visible_devices", "master_addr", "master_port",
    "torch_distributed_debug", "device_ids", "output_device",
})
_LOGGING_DROP_PREFIXES = ("nccl_", "gloo_")


# ---------------------------------------------------------------------------------------------
# Records and outcomes
# ---------------------------------------------------------------------------------------------


class Collective(NamedTuple):
    """One collective as both sides can observe it: ``(op, group_ranks, shapes, dtypes)``."""

    op: str
    group_ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def describe(self, world_size: int | None = None) -> str:
        """``all_reduce([(90,)], float32)``; the group is named when it is not the whole world."""
        dt = ", ".join(dict.fromkeys(self.dtypes)) or "-"
        text = f"{self.op}({list(self.shapes)}, {dt})"
        if world_size is None or tuple(self.group_ranks) != tuple(range(world_size)):
            text += f" on ranks {list(self.group_ranks)}"
        return text


@dataclass
class ScenarioOutcome:
    """What one run of a scenario left behind, per rank, in a backend-independent form.

    ``collectives``, ``ddp_logging`` and ``states`` may be ``None`` (e.g. an outcome built from
    a single-process reference has only ``states``); :func:`compare` skips what either side
    lacks.
    """

    scenario: str
    backend: str
    world_size: int
    collectives: list[list[Collective]] | None
    ddp_logging: list[dict[str, Any]] | None
    states: list[dict[str, torch.Tensor]] | None
    param_names: frozenset[str] = frozenset()
    wall_time: float = 0.0
    launch_time: float = 0.0
    device: str = "cpu"
    seed: int = 0

    @classmethod
    def from_states(cls, states: Sequence[dict[str, torch.Tensor]], *, backend: str = "reference",
                    scenario: str = "", param_names: Sequence[str] = ()) -> "ScenarioOutcome":
        """An outcome holding final states only (e.g. from ``models.reference_train``)."""
        return cls(scenario=scenario, backend=backend, world_size=len(states), collectives=None,
                   ddp_logging=None, states=[{k: v.detach().cpu() for k, v in s.items()} for s in states],
                   param_names=frozenset(param_names))

    def summary(self) -> str:
        n = [len(c) for c in self.collectives] if self.collectives is not None else None
        return (f"{self.scenario} on {self.backend} x{self.world_size} ({self.device}): "
                f"collectives per rank {n}, {self.wall_time:.2f} s"
                + (f" (+{self.launch_time:.2f} s launch)" if self.launch_time else ""))


# ---------------------------------------------------------------------------------------------
# The default training loop
# ---------------------------------------------------------------------------------------------


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_to_device(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _build_model(scenario: Any) -> torch.nn.Module:
    if hasattr(scenario, "build_model"):
        return scenario.build_model()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(getattr(scenario, "seed", 0))
        return scenario.model()


@dataclass(frozen=True)
class TrainLoop:
    """The training loop of ``models/scenario.py``, picklable, with optional comm hook and Join.

    ``train(scenario, rank, world_size, device) -> DistributedDataParallel``::

        model = DDP(scenario.build_model().to(device), **scenario.ddp_kwargs)
        opt = scenario.optimizer(model.parameters())
        for batch in scenario.inputs(rank, world_size):
            opt.zero_grad(set_to_none=True); scenario.step(model, batch).backward(); opt.step()

    Args:
        comm_hook: registered with ``model.register_comm_hook(state, comm_hook)``; default: the
            scenario's ``comm_hook`` attribute if it has one, else none.
        hook_state: ``hook_state(process_group) -> state`` (e.g.
            ``functools.partial(PowerSGDState, matrix_approximation_rank=1)``); ``None``: state
            ``None``.
        join: run under ``torch.distributed.algorithms.Join``. ``None``: the scenario's ``join``
            attribute if it has one, else exactly when the ranks' batch counts differ.
    """

    comm_hook: Callable[..., Any] | None = None
    hook_state: Callable[[Any], Any] | None = None
    join: bool | None = None

    def __call__(self, scenario: Any, rank: int, world_size: int, device: torch.device) -> Any:
        from torch.distributed.algorithms.join import Join
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = _build_model(scenario).to(device)
        kwargs = dict(getattr(scenario, "ddp_kwargs", None) or {})
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device.index])
        model = DDP(module, **kwargs)
        hook = self.comm_hook or getattr(scenario, "comm_hook", None)
        if hook is not None:
            factory = self.hook_state or getattr(scenario, "hook_state", None)
            model.register_comm_hook(factory(model.process_group) if factory else None, hook)
        opt = scenario.optimizer(model.parameters())
        batches = [_to_device(b, device) for b in scenario.inputs(rank, world_size)]
        join = self.join if self.join is not None else getattr(scenario, "join", None)
        if join is None:
            if hasattr(scenario, "batch_counts"):
                counts = scenario.batch_counts(world_size)
            else:
                counts = [len(scenario.inputs(r, world_size)) for r in range(world_size)]
            join = len(set(counts)) > 1
        with Join([model]) if join else contextlib.nullcontext():
            for batch in batches:
                opt.zero_grad(set_to_none=True)
                scenario.step(model, batch).backward()
                opt.step()
        return model


_DEFAULT_TRAIN = TrainLoop()


@dataclass(frozen=True)
class CollectiveTour:
    """A ``train`` function that runs no DDP: one call of each collective of the Python API
    (plus a subgroup allreduce and a ring of point-to-point messages, where the world allows),
    on integer-valued float tensors so every backend's results are exact whatever its sum order.
    Returns a module whose buffers hold the results, so :func:`compare` checks each op's name,
    shapes and dtypes *and* its results against the other backend's.
    """

    def __call__(self, scenario: Any, rank: int, world_size: int, device: torch.device) -> Any:
        n, dev, f32 = world_size, device, torch.float32
        out = torch.nn.Module()

        def keep(name: str, t: torch.Tensor) -> None:
            out.register_buffer(name, t.detach().clone())

        x = torch.arange(6, dtype=f32, device=dev) + 10 * rank
        t = x.clone(); dist.all_reduce(t); keep("all_reduce_sum", t)  # noqa: E702
        t = x.clone(); dist.all_reduce(t, op=dist.ReduceOp.MAX); keep("all_reduce_max", t)  # noqa: E702
        t = x.clone(); dist.broadcast(t, src=n - 1); keep("broadcast", t)  # noqa: E702
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        keep("all_gather", torch.stack(parts))
        t = torch.empty(6 * n, dtype=f32, device=dev)
        # torch 2.13 renamed these (the old names warn); 2.11 has only the old ones.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(t, x)
        keep("all_gather_into_tensor", t)
        t = torch.empty(2, dtype=f32, device=dev)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            t, torch.arange(2 * n, dtype=f32, device=dev) * (rank + 1))
        keep("reduce_scatter_tensor", t)
        t = torch.empty(2 * n, dtype=f32, device=dev)
        dist.all_to_all_single(t, torch.arange(2 * n, dtype=f32, device=dev) + 100 * rank)
        keep("all_to_all_single", t)
        t = x.clone(); dist.reduce(t, dst=0)  # noqa: E702 - only the destination's result is defined
        keep("reduce", t if rank == 0 else torch.zeros_like(t))
        bucket = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        dist.gather(x, bucket, dst=0)
        keep("gather", torch.stack(bucket) if rank == 0 else torch.zeros(n, 6, device=dev))
        t = torch.empty_like(x)
        src = [torch.full((6,), float(i), device=dev) for i in range(n)] if rank == n - 1 else None
        dist.scatter(t, src, src=n - 1)
        keep("scatter", t)
        objects: list[Any] = [None] * n
        dist.all_gather_object(objects, {"rank": rank, "square": rank * rank})
        keep("all_gather_object", torch.tensor([o["square"] for o in objects]))
        dist.barrier()
        if n >= 3:
            members = list(range(0, n, 2))
            sub = dist.new_group(members)
            t = x.clone()
            if rank in members:
                dist.all_reduce(t, group=sub)
            keep("subgroup_all_reduce", t)
        if n >= 2:
            t = torch.empty_like(x)
            req = dist.isend(x, (rank + 1) % n)
            dist.recv(t, (rank - 1) % n)
            req.wait()
            keep("ring", t)
        return out


def _rank_result(model: Any, collectives: list[Collective], wall: float) -> dict[str, Any]:
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


def _seed_rank(seed: int, rank: int) -> None:
    """Per-rank unseeded RNG state as fakepg.spawn sets it, so both sides draw the same."""
    torch.manual_seed(derive_seed(seed, rank))
    random.seed(derive_seed(seed, rank, "python"))
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(derive_seed(seed, rank, "numpy") % (1 << 32))


# ---------------------------------------------------------------------------------------------
# The recording wrapper around a real backend
# ---------------------------------------------------------------------------------------------


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _flat(xs: Any) -> list[torch.Tensor]:
    if isinstance(xs, torch.Tensor):
        return [xs]
    out: list[torch.Tensor] = []
    for x in xs or ():
        out.extend(_flat(x)) if isinstance(x, (list, tuple)) else (
            out.append(x) if isinstance(x, torch.Tensor) else None)
    return out


_RECORDS: list[Collective] = []  # this process's collectives, all groups, in issue order


class RecordingProcessGroup(PythonProcessGroup):
    """A ``dist.ProcessGroup`` that forwards every collective to a real backend and records it.

    Registered as the backends ``fakepg_recorded_gloo`` / ``fakepg_recorded_nccl``, so that
    ``dist.init_process_group`` makes it the default group and DDP (its C++ Reducer included),
    Join and comm hooks issue their collectives through it. Ops are named and shapes taken as
    fakepg's trace does, so the two sequences compare element by element.
    """

    def __init__(self, inner: Any, rank: int, size: int, backend_name: str,
                 records: list[Collective] | None = None):
        super().__init__(rank, size)
        self._inner = inner
        self.backend_name = backend_name
        self._records = _RECORDS if records is None else records
        self._ranks: tuple[int, ...] | None = None

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._inner.shutdown()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._inner.abort()

    def _group_ranks(self) -> tuple[int, ...]:
        if self._ranks is None:
            mapping = c10d._world.pg_group_ranks.get(self)
            if mapping:
                self._ranks = tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))
            else:
                return tuple(range(self.size()))
        return self._ranks

    def _record(self, op: str, shown: Any) -> None:
        ts = _flat(shown)
        self._records.append(Collective(op, self._group_ranks(), tuple(tuple(t.shape) for t in ts),
                                        tuple(_dtype(t) for t in ts)))

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any, opts: Any = None) -> Any:
        return fn(*args) if opts is None else fn(*args, opts)

    # -- collectives (method names as torch 2.11-2.13 call them; op names as fakepg's trace) --
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            o = dist.AllreduceOptions()
            o.reduceOp = opts
            opts = o
        self._record("all_reduce", tensors)
        return self._call(self._inner.allreduce, tensors, opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        self._record("all_reduce_coalesced", tensors)
        return self._call(self._inner.allreduce_coalesced, tensors, opts=opts)

    def broadcast(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if isinstance(opts, int):
            o = dist.BroadcastOptions()
            o.rootRank = opts
            opts = o
        self._record("broadcast", tensors)
        return self._call(self._inner.broadcast, tensors, opts=opts)

    def reduce(self, tensors, opts=None):
        self._record("reduce", tensors)
        return self._call(self._inner.reduce, tensors, opts=opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._record("all_gather", input_tensors)
        return self._call(self._inner.allgather, output_tensors, input_tensors, opts=opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        self._record("all_gather", input_list)
        return self._call(self._inner.allgather_coalesced, output_lists, input_list, opts=opts)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002
        self._record("all_gather_into_tensor", [input])
        return self._call(self._inner._allgather_base, output, input, opts=opts)

    _allgather_base = all_gather_single

    def gather(self, output_tensors, input_tensors, opts=None):
        self._record("gather", input_tensors)
        return self._call(self._inner.gather, output_tensors, input_tensors, opts=opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        self._record("scatter", output_tensors)
        return self._call(self._inner.scatter, output_tensors, input_tensors, opts=opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._record("reduce_scatter", output_tensors)
        return self._call(self._inner.reduce_scatter, output_tensors, input_tensors, opts=opts)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        self._record("reduce_scatter_tensor", [input])
        return self._call(self._inner._reduce_scatter_base, output, input, opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._record("all_to_all", input_tensors)
        return self._call(self._inner.alltoall, output_tensors, input_tensors, opts=opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        self._record("all_to_all_single", [input])
        return self._call(self._inner.alltoall_base, output, input, list(output_split_sizes),
                          list(input_split_sizes), opts=opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        self._record("barrier", [])
        return self._call(self._inner.barrier, opts=opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._record("monitored_barrier", [])
        if timeout is None:
            return self._inner.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return self._inner.monitored_barrier(timeout, wait_all_ranks)

    def send(self, tensors, dst, tag=0):
        self._record("send", tensors)
        return self._inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        self._record("recv", tensors)
        return self._inner.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        self._record("recv", tensors)
        return self._inner.recv_anysource(tensors, tag)

    def _start_coalescing(self, device=None):
        self._inner._start_coalescing()

    def _end_coalescing(self, device=None):
        return self._inner._end_coalescing()


def _create_recorded_gloo(store, rank, world_size, timeout):
    inner = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    with contextlib.suppress(Exception):
        inner._set_sequence_number_for_group()
    return RecordingProcessGroup(inner, rank, world_size, _RECORDING_BACKENDS["gloo"])


def _create_recorded_nccl(store, rank, world_size, timeout):
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    inner = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    with contextlib.suppress(Exception):
        inner._set_sequence_number_for_group()
    return RecordingProcessGroup(inner, rank, world_size, _RECORDING_BACKENDS["nccl"])


def _register_recording_backends() -> None:
    for real, name, creator, devices in (("gloo", _RECORDING_BACKENDS["gloo"], _create_recorded_gloo, ["cpu", "cuda"]),
                                         ("nccl", _RECORDING_BACKENDS["nccl"], _create_recorded_nccl, ["cuda"])):
        if hasattr(dist.Backend, name.upper()):
            continue
        if real == "nccl" and not dist.is_nccl_available():
            continue
        dist.Backend.register_backend(name, creator, devices=devices)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def run_scenario(scenario: Any, world_size: int, backend: str = "fake", *, seed: int = 0,
                 device: str | torch.device = "cpu", train: Callable[..., Any] | None = None,
                 timeout: float = 300.0) -> Any:
    """Run ``scenario`` on ``world_size`` ranks of ``backend``; return a :class:`ScenarioOutcome`.

    ``scenario`` may also be a list of scenarios: they then run one after another in *one*
    world (for gloo/NCCL: one set of processes, so process start-up is paid once), and a list
    of outcomes comes back, one per scenario, each with only its own collectives.

    Args:
        backend: ``"fake"``, ``"fake-cuda"``, ``"gloo"`` or ``"nccl"`` (see the module doc).
        seed: for ``"fake"`` the spawn seed; on the real backends each rank's unseeded torch,
            Python and numpy RNGs are set to the same per-rank states fakepg would give them.
        device: tensors' device for ``"fake"`` (``"fake-cuda"`` forces ``cuda:0``; ``"nccl"``
            uses ``cuda:rank``; ``"gloo"`` honours it, CPU by default).
        train: ``train(scenario, rank, world_size, device) -> DDP model``; default
            :class:`TrainLoop` ``()`` (the loop of ``models/scenario.py``, Join when counts
            differ). With a list of scenarios, also a list: one train function per scenario.
            Must pickle for the multi-process backends.
        timeout: seconds before a multi-process run is declared hung; its processes are then
            killed (the process group's own timeout is the same).

    Raises:
        RuntimeError: a rank failed on a real backend (the rank's traceback is in the message),
            or the run exceeded ``timeout``.
        fakepg.RankFailedError / CollectiveHangError / ...: the fake run failed.
    """
    single = not isinstance(scenario, (list, tuple))
    scenarios = [scenario] if single else list(scenario)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(train, (list, tuple)):
        if single or len(train) != len(scenarios):
            raise ValueError(f"train: a list of train functions needs a list of as many scenarios "
                             f"(got {len(train)} for {len(scenarios) if not single else 'one scenario'})")
        trains = [t or _DEFAULT_TRAIN for t in train]
    else:
        trains = [train or _DEFAULT_TRAIN] * len(scenarios)
    if backend in ("fake", "fake-cuda"):
        dev = torch.device("cuda", 0) if backend == "fake-cuda" else _normalise_device(device)
        outcomes = [_run_fake(sc, world_size, backend, seed, dev, t) for sc, t in zip(scenarios, trains)]
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
              train: Callable[..., Any]) -> ScenarioOutcome:
    from .world import spawn

    res = spawn(_fake_rank, args=(scenario, world_size, device, train), nprocs=world_size, seed=seed)
    collectives = [[Collective(r.op, tuple(r.group_ranks), tuple(tuple(s) for s in r.shapes),
                               tuple(r.dtypes)) for r in recs] for recs in res.trace]
    return _outcome(scenario, backend, world_size, seed, device, res.returns, collectives,
                    res.wall_time, 0.0)


def _outcome(scenario, backend, world_size, seed, device, per_rank, collectives, wall, launch):
    return ScenarioOutcome(
        scenario=_scenario_name(scenario), backend=backend, world_size=world_size,
        collectives=collectives, ddp_logging=[r["logging"] for r in per_rank],
        states=[r["state"] for r in per_rank], param_names=frozenset(per_rank[0]["params"]),
        wall_time=wall, launch_time=launch, device=str(device), seed=seed)


def _run_multiprocess(scenarios, world_size, backend, seed, device, trains, timeout):
    import torch.multiprocessing as mp

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

    tmp = tempfile.mkdtemp(prefix="fakepg-conformance-")
    ctx = None
    t0 = time.perf_counter()
    try:
        ctx = mp.start_processes(
            _multiprocess_rank,
            args=(world_size, backend, scenarios, trains, seed, device, os.path.join(tmp, "store"),
                  tmp, timeout),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ctx.join(timeout=0.2):
                    break
            except Exception as e:  # ProcessRaisedException / ProcessExitedException
                names = ", ".join(_scenario_name(s) for s in scenarios)
                raise RuntimeError(f"{backend} run of [{names}] on {world_size} ranks failed: {e}") from None
            if time.monotonic() > deadline:
                names = ", ".join(_scenario_name(s) for s in scenarios)
                raise RuntimeError(f"{backend} run of [{names}] on {world_size} ranks did not finish "
                                   f"within {timeout:.0f} s (hung?); its processes were killed")
        total = time.perf_counter() - t0
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                    for r in range(world_size)]
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


def _multiprocess_rank(rank: int, world_size: int, backend: str, scenarios: list[Any],
                       trains: list[Callable[..., Any]], seed: int, device: str, store_path: str,
                       out_dir: str, timeout: float) -> None:
    """Child process body: one rank of a real gloo/NCCL world running every scenario."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
                       "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _register_recording_backends()
    # One process per rank: share the cores between them (oversubscribed intra-op threads make
    # a 2-rank run on 2 cores ~20x slower), and import DDP before any scenario is timed.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))
    for mod in ("torch.distributed.algorithms.join", "torch.nn.parallel.distributed"):
        importlib.import_module(mod)
    if backend == "nccl":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend=_RECORDING_BACKENDS[backend], store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    pg = c10d._get_default_group()
    inner = pg._inner
    sync = torch.zeros(1, device=dev if backend == "nccl" else "cpu")
    results = []
    try:
        for sc, train in zip(scenarios, trains):
            inner.allreduce([sync]).wait()  # unrecorded: scenarios start together
            _seed_rank(seed, rank)
            _RECORDS.clear()
            t0 = time.perf_counter()
            model = train(sc, rank, world_size, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
            results.append(_rank_result(model, list(_RECORDS), wall))
            del model
        inner.allreduce([sync]).wait()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------

_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # float64 layers fed by float32 ones inherit float32-level noise: tighter than float32, not 1e-15.
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
    torch.complex128: (1e-7, 1e-9),
    torch.complex64: (1e-4, 1e-5),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for final states of ``dtype``: reductions in a different order differ in
    the last bits, and a few optimizer steps amplify that a little. Integers: exact."""
    if dtype in _TOLERANCES:
        return _TOLERANCES[dtype]
    if dtype.is_floating_point:
        return (5e-2, 1e-2)  # float8 and friends
    return (0.0, 0.0)


def _labels(a: ScenarioOutcome, b: ScenarioOutcome) -> tuple[str, str]:
    if a.backend != b.backend:
        return a.backend, b.backend
    return f"{a.backend} (a)", f"{b.backend} (b)"


def compare(a: ScenarioOutcome, b: ScenarioOutcome, *, rtol: float | None = None,
            atol: float | None = None) -> list[str]:
    """The differences between two outcomes, in words, the first (most fundamental) first.

    Compared, per rank: the collective sequence (the first differing collective, or the first
    extra one), the DDP logging data both sides have (bucket sizes, rebuilt buckets, grad-ready
    order, ...), then final parameters and buffers (names, shapes, dtypes; values within
    ``rtol``/``atol``, by default :func:`default_tolerance` of the dtype). Parts that either
    outcome lacks (``None``) are skipped. An empty list means conformant.
    """
    la, lb = _labels(a, b)
    diffs: list[str] = []
    if a.world_size != b.world_size:
        return [f"world size: {la} {a.world_size} vs {lb} {b.world_size}"]
    n = a.world_size
    if a.collectives is not None and b.collectives is not None:
        for r in range(n):
            diffs.extend(_compare_collectives(r, a.collectives[r], b.collectives[r], la, lb, n))
    if a.ddp_logging is not None and b.ddp_logging is not None:
        for r in range(n):
            da, db = a.ddp_logging[r], b.ddp_logging[r]
            for key in sorted(set(da) & set(db), key=_logging_key_order):
                if da[key] != db[key]:
                    diffs.append(f"rank {r}: {key} {la} {_short(da[key])} vs {lb} {_short(db[key])}")
    if a.states is not None and b.states is not None:
        params = a.param_names | b.param_names
        for r in range(n):
            diffs.extend(_compare_states(r, a.states[r], b.states[r], la, lb, params, rtol, atol))
    return diffs


# The layout keys first: a layout difference explains the rest.
_KEY_ORDER = ("bucket_cap_bytes", "bucket_sizes", "has_rebuilt_buckets", "rebuilt_bucket_sizes",
              "rebuilt_per_bucket_param_indices", "prev_iteration_grad_ready_order_indices")


def _logging_key_order(key: str) -> tuple[int, str]:
    return (_KEY_ORDER.index(key) if key in _KEY_ORDER else len(_KEY_ORDER), key)


def _short(v: Any, limit: int = 120) -> str:
    text = f"[{v}]" if isinstance(v, str) and ("," in v or " " in v) else repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _compare_collectives(rank, ca, cb, la, lb, n) -> list[str]:
    for i, (x, y) in enumerate(zip(ca, cb)):
        if tuple(x) != tuple(y):
            return [f"rank {rank}, collective #{i}: {la} {_describe(x, n)} vs {lb} {_describe(y, n)}"]
    if len(ca) != len(cb):
        longer, label = (ca, la) if len(ca) > len(cb) else (cb, lb)
        k = min(len(ca), len(cb))
        return [f"rank {rank}: {la} issued {len(ca)} collectives, {lb} {len(cb)}; first extra: "
                f"collective #{k} {label} {_describe(longer[k], n)}"]
    return []


def _describe(c: Any, n: int) -> str:
    return Collective(*c).describe(n)


def _compare_states(rank, sa, sb, la, lb, params, rtol, atol) -> list[str]:
    out: list[str] = []
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if only_a or only_b:
        out.append(f"rank {rank}: state keys differ: only in {la} {only_a}, only in {lb} {only_b}")
    for key in [k for k in sa if k in sb]:
        kind = "parameter" if key in params else "buffer"
        x, y = sa[key], sb[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                out.append(f"rank {rank}: {kind} {key!r}: {la} {x!r} vs {lb} {y!r}")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"rank {rank}: {kind} {key!r}: {la} {tuple(x.shape)} {_dtype(x)} vs "
                       f"{lb} {tuple(y.shape)} {_dtype(y)}")
            continue
        if x.is_sparse:
            x, y = x.to_dense(), y.to_dense()
        drt, dat = default_tolerance(x.dtype)
        rt = drt if rtol is None else rtol
        at = dat if atol is None else atol
        if not (x.dtype.is_floating_point or x.dtype.is_complex) or (rt == 0 and at == 0):
            if not torch.equal(x, y):
                bad = int((x != y).sum())
                out.append(f"rank {rank}: {kind} {key!r} differs in {bad} of {x.numel()} elements "
                           f"({_dtype(x)}, compared exactly)")
            continue
        xd, yd = x.double() if not x.is_complex() else x.cdouble(), y.double() if not y.is_complex() else y.cdouble()
        nan_a, nan_b = torch.isnan(xd), torch.isnan(yd)
        if not torch.equal(nan_a, nan_b):
            out.append(f"rank {rank}: {kind} {key!r}: NaN in {la if nan_a.any() else lb} only")
            continue
        diff = (xd - yd).abs().masked_fill(nan_a, 0)
        limit = at + rt * yd.abs().masked_fill(nan_b, 0)
        over = diff > limit
        if bool(over.any()):
            worst = float(diff.max())
            out.append(f"rank {rank}: {kind} {key!r} differs by {worst:.3g} (max abs) > tolerance "
                       f"for {_dtype(x)} (rtol={rt:g}, atol={at:g}) in {int(over.sum())} of "
                       f"{x.numel()} elements")
    return out


def assert_conformant(a: ScenarioOutcome, b: ScenarioOutcome, *, rtol: float | None = None,
                      atol: float | None = None, max_lines: int = 10) -> None:
    """Raise ``AssertionError`` listing the first differences when :func:`compare` finds any."""
    diffs = compare(a, b, rtol=rtol, atol=atol)
    if diffs:
        la, lb = _labels(a, b)
        shown = diffs[:max_lines]
        more = f"\n  ... and {len(diffs) - max_lines} more" if len(diffs) > max_lines else ""
        raise AssertionError(f"scenario {a.scenario or b.scenario!r} on {a.world_size} ranks: "
                             f"{la} and {lb} differ ({len(diffs)} differences):\n  "
                             + "\n  ".join(shown) + more)
