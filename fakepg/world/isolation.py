"""Per-rank process state, swapped in and out at the hand-offs between rank threads.

Ranks run one at a time, so a rank's "process-global" state (torch's default CPU
generator, Python's and numpy's RNGs, the torch.distributed world, the whole of
``os.environ``, torch's global switches and print options) can live in the real globals
while the rank runs and be saved when it yields. Hand-offs are rare (a rank runs until it
blocks), so this costs far less than intercepting every access; and each piece is only
written back when it differs from what is live (a snapshot compare), because most
hand-offs change nothing but the RNG streams.

What is per rank, what cannot be, and what fakepg does about each: see ``ISOLATION``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.abc
import importlib.machinery
import os
import random
import sys
import types
from typing import Any, Callable, Iterator

import torch
import torch.distributed.distributed_c10d as c10d

from ..torch_private import World
from . import rng_state

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The module globals behind torch.distributed's notion of "this process's world".
_C10D_GLOBALS = ("_world", "_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config",
                 "_group_count", "_tags_to_pg", "_pg_to_tag", "_backend",
                 "_default_pg_init_method")

ISOLATION = """\
Per rank (saved when a rank yields, installed when it resumes; the caller's own values are
saved before spawn and put back after it):
  - torch's default CPU generator, Python's `random`, numpy's global RandomState
  - all of os.environ (each rank starts from the caller's environment plus its launcher
    variables and spawn's extra per-rank variables); C code reading getenv sees it too
  - torch.distributed's default group and group registry
  - torch.set_default_dtype; torch.use_deterministic_algorithms (and warn_only);
    torch.utils.deterministic.fill_uninitialized_memory; torch.set_warn_always
  - torch.backends switches: cudnn enabled/benchmark/deterministic, TF32 and fp32_precision
    (cuda/cudnn/mkldnn, torch.set_float32_matmul_precision), cuBLAS reduced-precision
    reductions, scaled-dot-product-attention backends, mkldnn, nnpack, opt_einsum,
    preferred linalg/BLAS backends
  - torch.autograd.set_detect_anomaly (a process-global switch in torch)
  - torch.set_printoptions
  - sys.argv (each rank starts with its own copy of the caller's: a rank that rewrites it,
    in place or by assignment, changes only its own, as in a separate process)
  - torch.set_num_threads: the value each rank asked for is put back when it resumes
    (ranks never run concurrently, so each rank's ops run with the thread count it asked
    for); a rank starts with the count its OMP_NUM_THREADS gives (spawn's env, else the
    caller's) or, unset, 1 in a world of several ranks, as torchrun starts its workers
  - training libraries' process singletons, once imported: accelerate's PartialState,
    AcceleratorState and GradientState; Lightning's rank_zero_only.rank; DeepSpeed's
    communication backend, groups and comm state (deepspeed.comm, deepspeed.utils.groups, ...);
    and the module globals a program declares with fakepg.per_rank_globals (each rank starts
    with what a fresh process would have)
Per rank already, because torch keeps it per thread and each rank is a thread:
  grad mode (torch.no_grad, set_grad_enabled), inference mode, autocast, the default
  device (torch.set_default_device), torch.set_flush_denormal, CUDA's current device.
  A rank starts with torch's defaults for these, as a new process does.
Not isolated (one per process; a rank that changes it changes it for all):
  - other module globals of libraries (and of torch outside the list above); a process
    group one rank reaches through such a global fails the other rank with an error that
    names the global and isolation="process" (docs/threads-and-waits.md)
  - the current directory (os.chdir), signal handlers, sys.path, sys.modules, open files
  - the inter-op thread pool size (torch refuses to change it once work has run)
  - CUDA generators and CUDA caching-allocator settings
  - numpy's print options are per thread (a context variable): a rank starts from numpy's
    defaults, not the caller's
"""


def derive_seed(seed: int, rank: int, stream: str = "torch") -> int:
    """A 63-bit seed that is a fixed function of (spawn seed, rank, stream)."""
    digest = hashlib.sha256(f"fakepg:{seed}:{rank}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def fresh_c10d_globals() -> dict[str, Any]:
    return {"_world": World(), "_pg_map": {}, "_pg_names": {}, "_pg_group_ranks": {},
            "_pg_backend_config": {}, "_group_count": 0, "_tags_to_pg": {}, "_pg_to_tag": {},
            "_backend": None, "_default_pg_init_method": None}


def capture_c10d_globals() -> dict[str, Any]:
    g = vars(c10d)
    return {k: g[k] for k in _C10D_GLOBALS if k in g}


def install_c10d_globals(values: dict[str, Any]) -> None:
    vars(c10d).update(values)


# -- os.environ ---------------------------------------------------------------------------
# os.environ keeps its encoded contents in ``_data`` (what putenv was given); copying and
# comparing that dict runs at C speed, where dict(os.environ) decodes every entry.

def _environ_data() -> dict:
    return os.environ._data  # type: ignore[attr-defined]


def _install_environ(target: dict) -> None:
    data = _environ_data()
    # Set differences of the (bytes) items run at C speed; ranks differ in a few keys.
    for key in data.keys() - target.keys():
        os.unsetenv(key)
        del data[key]
    for key, value in target.items() - data.items():
        os.putenv(key, value)
        data[key] = value


def environ_with(overrides: dict[str, str | None]) -> dict:
    """The live environment plus ``overrides`` (None unsets), in os.environ's encoding."""
    env = dict(_environ_data())
    encode_key, encode_value = os.environ.encodekey, os.environ.encodevalue  # type: ignore[attr-defined]
    for key, value in overrides.items():
        if value is None:
            env.pop(encode_key(key), None)
        else:
            env[encode_key(key)] = encode_value(str(value))
    return env


# -- torch's process-global switches --------------------------------------------------------

def _switches() -> list[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """(name, getter, setter) for each process-global torch switch this build has."""
    C = torch._C
    out: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = [
        ("default_dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("deterministic", lambda: (torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        ("anomaly", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
         lambda v: torch.set_anomaly_enabled(*v)),
        # Before the fp32_precision entries: it sets some of them as a side effect.
        ("float32_matmul_precision", torch.get_float32_matmul_precision,
         torch.set_float32_matmul_precision),
    ]
    if hasattr(C, "_get_fp32_precision_getter"):
        # The fp32_precision table is the truth behind every TF32 switch; the legacy
        # allow_tf32 getters raise once the new API has been used, so they are not read.
        for backend in ("generic", "cuda", "mkldnn"):
            for op in ("all", "matmul", "conv", "rnn"):
                try:
                    C._get_fp32_precision_getter(backend, op)
                except Exception:  # noqa: BLE001 - not a valid pair in this build
                    continue
                out.append((f"fp32_precision.{backend}.{op}",
                            lambda b=backend, o=op: C._get_fp32_precision_getter(b, o),
                            lambda v, b=backend, o=op: C._set_fp32_precision_setter(b, o, v)))
    else:  # pragma: no cover - torch before the fp32_precision API
        out += [("cublas_allow_tf32", C._get_cublas_allow_tf32, C._set_cublas_allow_tf32),
                ("cudnn_allow_tf32", C._get_cudnn_allow_tf32, C._set_cudnn_allow_tf32)]
    plain = ["cudnn_enabled", "cudnn_benchmark", "cudnn_deterministic", "mkldnn_enabled",
             "nnpack_enabled", "mkldnn_deterministic", "miopen_immediate",
             "cublas_allow_fp16_reduced_precision_reduction",
             "cublas_allow_bf16_reduced_precision_reduction", "cublas_allow_fp16_accumulation",
             "cpu_allow_fp16_reduced_precision_reduction", "math_sdp_allow_fp16_bf16_reduction",
             "deterministic_fill_uninitialized_memory", "warnAlways",
             "linalg_preferred_backend", "blas_preferred_backend", "rocm_fa_preferred_backend",
             "sm_carveout_experimental"]
    for name in plain:
        get, put = getattr(C, f"_get_{name}", None), getattr(C, f"_set_{name}", None)
        if get is not None and put is not None and _readable(get):
            out.append((name, get, (lambda v, put=put: put(*v)) if isinstance(get(), tuple) else put))
    for kind in ("flash", "mem_efficient", "math", "cudnn", "overrideable"):
        get, put = getattr(C, f"_get_{kind}_sdp_enabled", None), getattr(C, f"_set_sdp_use_{kind}", None)
        if get is not None and put is not None and _readable(get):
            out.append((f"{kind}_sdp", get, put))
    einsum = sys.modules.get("torch.backends.opt_einsum")
    if einsum is not None:
        # Its properties cost ~10 us a read; the module behind them holds the same values.
        g = vars(getattr(einsum, "m", einsum))
        if "enabled" in g and "strategy" in g:
            out.append(("opt_einsum", lambda: (g["enabled"], g["strategy"]), _set_opt_einsum))
        else:  # pragma: no cover - another layout of torch.backends.opt_einsum
            out.append(("opt_einsum", lambda: (einsum.enabled, einsum.strategy), _set_opt_einsum))
    return out


def _readable(get: Callable[[], Any]) -> bool:
    try:
        get()
        return True
    except Exception:  # noqa: BLE001 - a switch this build cannot report is left alone
        return False


def _set_opt_einsum(value: tuple[bool, Any]) -> None:
    import torch.backends.opt_einsum as einsum
    einsum.enabled = value[0]
    if value[0] and value[1] is not None:
        einsum.strategy = value[1]


_SWITCHES = _switches()
_GETTERS = tuple(get for _, get, _ in _SWITCHES)
_PRINT_OPTS = torch._tensor_str.PRINT_OPTS


_live_switches: tuple | None = None  # as last captured or installed: hand-offs save, then install


def capture_switches() -> tuple:
    global _live_switches
    _live_switches = tuple([get() for get in _GETTERS])
    return _live_switches


def install_switches(target: tuple) -> None:
    if target == _live_switches:
        return
    # Some setters move others (the matmul precision sets fp32_precision entries): a
    # second pass puts back what the first one moved.
    for _ in range(3):
        live = capture_switches()
        if live == target:
            return
        for (_, _, put), have, want in zip(_SWITCHES, live, target):
            if have != want:
                put(want)


# torch.set_num_threads stores a process-wide count (read by threads that have not yet run
# parallel work) and the calling thread's OpenMP count. This is the process-wide one as
# fakepg last left it, so a rank that resumes puts back both.
_process_threads: int | None = None


def _install_num_threads(want: int) -> None:
    global _process_threads
    if want != _process_threads or want != torch.get_num_threads():
        torch.set_num_threads(want)
    _process_threads = want


def rank_threads(omp: str | None, nprocs: int, callers: int) -> int:
    """The intra-op thread count a rank starts with: what its ``OMP_NUM_THREADS`` (spawn's
    ``env`` first, then the caller's environment) says, as a process sizes its pool at start;
    unset, 1 in a world of several ranks, as torchrun starts its workers, else the caller's.

    Why 1 and not the caller's count: OpenMP keeps one pool per thread that opens a parallel
    region, so each rank thread gets its own; ranks run one at a time, so the pools of the
    ranks that wait fall asleep and nearly every parallel region of the running rank pays to
    wake one (libgomp spins only briefly when its threads outnumber the cores). One thread per
    rank, as under torchrun, costs no pool at all."""
    first = (omp or "").split(",")[0].strip()  # OpenMP's list form: the outermost level's
    if first.isdigit() and int(first) > 0:
        return int(first)
    return 1 if nprocs > 1 else callers


def _lightning_rank() -> int:
    """What Lightning's ``rank_zero_only.rank`` is in a fresh process (set on import from the
    launcher's variables: lightning.fabric.utilities.rank_zero._get_rank)."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


# Process-wide singletons of libraries that training stacks build on, as (module, owner
# attribute, attribute, value in a fresh process). Each rank gets its own, as a process
# would: accelerate's Borg states (whose rank, device and data sharding every Accelerator
# reads) and Lightning's rank_zero_only.rank (which decides where rank-zero output goes).
# An owner of None is the module itself; an attribute of None is every data global of the
# module (see _is_data); a fresh value of None is a copy of what the module's import left
# there (see _fresh). Swapped only once their module is imported; per_rank_globals() adds
# entries. Libraries not listed need isolation="process".
_SINGLETONS: list[tuple[str, str | None, str | None, Callable[[], Any] | None]] = [
    ("accelerate.state", "PartialState", "_shared_state", dict),
    ("accelerate.state", "AcceleratorState", "_shared_state", dict),
    ("accelerate.state", "GradientState", "_shared_state", dict),
    ("lightning_utilities.core.rank_zero", "rank_zero_only", "rank", _lightning_rank),
    # DeepSpeed keeps its communication backend (deepspeed.comm's ``cdb``), its world, data-,
    # model-, expert- and sequence-parallel groups, and its activation checkpointing and
    # pipeline state in module globals: shared, every rank used rank 0's groups ("Group ...
    # is not registered").
    *((module, None, None, None) for module in (
        "deepspeed.comm.comm", "deepspeed.comm.torch", "deepspeed.utils.groups",
        "deepspeed.runtime.activation_checkpointing.checkpointing", "deepspeed.runtime.pipe.p2p",
        "deepspeed.runtime.sequence_parallel.parallel_state_sp",
        "deepspeed.runtime.comm.coalesced_collectives", "deepspeed.runtime.utils")),
]
_UNSET = object()
_IMPORTED: dict[str, dict[str, Any]] = {}  # module -> its data globals as its import left them


def per_rank_globals(module: str, *names: str) -> None:
    """Give each rank of a thread-mode world its own value of ``module``'s globals ``names``
    (all its data globals when none are named), as separate processes would have.

    A rank starts from the values a fresh import of ``module`` gives (from the caller's
    values when the module was imported before ``spawn``), and keeps its own from then on:
    they are swapped at hand-offs like the RNGs. Call it before the world starts, e.g. at the
    top of the test module or in ``conftest.py``::

        fakepg.per_rank_globals("mylib.state", "_GROUP", "_CACHE")
    """
    if not isinstance(module, str) or not module:
        raise TypeError(f"fakepg.per_rank_globals: module must be a module name (str), got {module!r}")
    bad = [n for n in names if not (isinstance(n, str) and n.isidentifier())]
    if bad:
        raise TypeError(f"fakepg.per_rank_globals: names must be global names of {module} "
                        f"(identifiers), got {bad!r}")
    for entry in ([(module, None, None, None)] if not names else
                  [(module, None, n, None) for n in names]):
        if entry not in _SINGLETONS:
            _SINGLETONS.append(entry)


def _is_data(name: str, value: Any) -> bool:
    """A module global that is state (not a function, class, module or dunder)."""
    return not (name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType,
                                                           types.BuiltinFunctionType, type)))


def _data_globals(mod: types.ModuleType) -> dict[str, Any]:
    return {k: v for k, v in vars(mod).items() if _is_data(k, v)}


def _copy(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - a lock, a C object: one shared object, as before
        return value


def _fresh(module: str, attr: str | None) -> Any:
    """A rank's first value of a per-rank module global: a copy of what the import left."""
    snapshot = _IMPORTED.get(module)
    if snapshot is None:  # imported where the hook did not see it: what is there now
        mod = sys.modules[module]
        snapshot = _IMPORTED[module] = {k: _copy(v) for k, v in _data_globals(mod).items()}
    if attr is None:
        return {k: _copy(v) for k, v in snapshot.items()}
    value = snapshot.get(attr, _UNSET)
    return value if value is _UNSET else _copy(value)


class _ImportSnapshots(importlib.abc.MetaPathFinder):
    """Records the data globals of a per-rank module as its import leaves them, before the
    rank that imported it changes them: the state every other rank starts from."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in _IMPORTED or not any(e[0] == name and e[1] is None for e in _SINGLETONS):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(mod: types.ModuleType) -> None:
            run(mod)
            _IMPORTED[name] = {k: _copy(v) for k, v in _data_globals(mod).items()}

        loader.exec_module = exec_module
        return spec


@contextlib.contextmanager
def import_snapshots() -> Iterator[None]:
    """While a world runs: note the import-time globals of per-rank modules."""
    finder = _ImportSnapshots()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _singleton_owner(module: str, owner: str | None) -> Any:
    mod = sys.modules.get(module)
    return None if mod is None or owner is None else getattr(mod, owner, None)


def _get(obj: Any, attr: str | None) -> Any:
    return _data_globals(obj) if attr is None else getattr(obj, attr, _UNSET)


def _put(obj: Any, attr: str | None, value: Any) -> None:
    if attr is not None:
        if value is _UNSET:
            if hasattr(obj, attr):
                delattr(obj, attr)
        elif getattr(obj, attr, _UNSET) is not value:
            setattr(obj, attr, value)
        return
    live = vars(obj)
    for k in [k for k, v in live.items() if k not in value and _is_data(k, v)]:
        del live[k]  # a global this rank never had (another rank created it)
    for k, v in value.items():
        if live.get(k, _UNSET) is not v:
            live[k] = v


class ProcessState:
    """Everything a separate process would own, for one rank (or for the host)."""

    __slots__ = ("torch_rng", "py_rng", "np_rng", "env", "c10d", "switches", "print_opts",
                 "num_threads", "singletons", "argv")

    def __init__(self) -> None:
        self.torch_rng: torch.Tensor | None = None
        self.py_rng: Any = None
        self.np_rng: Any = None
        self.env: dict | None = None  # os.environ's encoded contents
        self.c10d: dict[str, Any] = {}
        self.switches: tuple | None = None
        self.print_opts: dict[str, Any] | None = None
        self.num_threads: int | None = None
        self.singletons: list[Any] = []
        self.argv: list[str] | None = None

    @classmethod
    def for_rank(cls, rank: int, nprocs: int, seed: int,
                 env: dict[str, str | None]) -> "ProcessState":
        """A rank's state at start: the caller's (live) process state, fresh RNG streams fixed
        by (seed, rank), a fresh torch.distributed world, and ``env`` added to the caller's
        environment (a None value unsets the variable)."""
        st = cls()
        st.torch_rng = torch.Generator().manual_seed(derive_seed(seed, rank)).get_state()
        st.py_rng = rng_state.python_state(random.Random(derive_seed(seed, rank, "python")))
        st.np_rng = rng_state.numpy_seeded(derive_seed(seed, rank, "numpy") % (1 << 32))
        st.env = environ_with(env)
        st.c10d = fresh_c10d_globals()
        st.switches = capture_switches()
        st.print_opts = dict(vars(_PRINT_OPTS))
        st.num_threads = torch.get_num_threads()
        st.argv = list(sys.argv)
        st.num_threads = rank_threads(env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS")),
                                      nprocs, st.num_threads)
        return st

    def save(self) -> None:
        """Copy the live globals into this state (the owner is about to yield)."""
        global _process_threads
        self.torch_rng = torch.default_generator.get_state()
        self.py_rng = rng_state.python_state()
        self.np_rng = rng_state.numpy_state(self.np_rng)
        data = _environ_data()
        if self.env != data:
            self.env = dict(data)
        self.c10d = capture_c10d_globals()
        self.switches = capture_switches()
        opts = vars(_PRINT_OPTS)
        if self.print_opts != opts:
            self.print_opts = dict(opts)
        self.num_threads = _process_threads = torch.get_num_threads()
        if len(self.singletons) < len(_SINGLETONS):
            self.singletons += [_UNSET] * (len(_SINGLETONS) - len(self.singletons))
        self.argv = sys.argv
        for i, (module, owner, attr, _) in enumerate(_SINGLETONS):
            obj = sys.modules.get(module) if owner is None else _singleton_owner(module, owner)
            if obj is not None:
                if owner is None and module not in _IMPORTED:
                    _fresh(module, attr)  # first seen here: what it holds is the fresh state
                self.singletons[i] = _get(obj, attr)

    def install(self) -> None:
        """Make this state the live one (the owner is about to run)."""
        if self.torch_rng is not None:
            torch.default_generator.set_state(self.torch_rng)
        if self.py_rng is not None:
            rng_state.set_python_state(self.py_rng)
        rng_state.set_numpy_state(self.np_rng)
        if self.env is not None and self.env != _environ_data():
            _install_environ(self.env)
        if self.c10d:
            install_c10d_globals(self.c10d)
        if self.switches is not None:
            install_switches(self.switches)
        if self.print_opts is not None and self.print_opts != vars(_PRINT_OPTS):
            vars(_PRINT_OPTS).clear()
            vars(_PRINT_OPTS).update(self.print_opts)
        if self.num_threads is not None:
            _install_num_threads(self.num_threads)
        if self.argv is not None:
            sys.argv = self.argv
        if len(self.singletons) < len(_SINGLETONS):
            self.singletons += [_UNSET] * (len(_SINGLETONS) - len(self.singletons))
        for i, (module, owner, attr, fresh) in enumerate(_SINGLETONS):
            obj = sys.modules.get(module) if owner is None else _singleton_owner(module, owner)
            if obj is not None:
                if self.singletons[i] is _UNSET:  # first run since its import: a fresh one
                    self.singletons[i] = fresh() if fresh is not None else _fresh(module, attr)
                _put(obj, attr, self.singletons[i])


# -- what thread mode cannot isolate: say so ------------------------------------------------

def _holder_of(obj: Any) -> str | None:
    """``module.name`` of a module global that holds ``obj`` (directly or in a dict, list or
    tuple it holds), or None."""
    for modname, mod in list(sys.modules.items()):
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for name, value in items:
            if value is obj:
                return f"{modname}.{name}"
            kind = type(value)  # not isinstance: it reads __class__, which some globals warn on
            if kind is dict:
                inner = list(value.values())
            elif kind is list or kind is tuple:
                inner = list(value)
            else:
                continue
            if any(v is obj for v in inner):
                return f"{modname}.{name}"
    return None


def shared_object_message(what: str, obj: Any, owner: int, rank: int) -> str:
    """Why rank ``rank`` holds ``obj`` (``what``) that rank ``owner`` made, and what to do."""
    holder = _holder_of(obj)
    where = (f"it is held by {holder}, a module global" if holder is not None
             else "it reached rank " f"{rank} through an object")
    fix = (f"declare it per rank with fakepg.per_rank_globals({holder.rsplit('.', 1)[0]!r}, "
           f"{holder.rsplit('.', 1)[1]!r}) before the world starts, or "
           if holder is not None else "")
    return (f"fakepg: rank {rank} used {what} that rank {owner} created: {where} that all "
            f"ranks share in thread mode (under torchrun every process has its own). Thread "
            f"mode cannot isolate it: {fix}run the ranks as processes "
            f"(fakerun --isolation process, or fakepg.spawn(..., isolation='process')).")


def foreign_group_note(exc: BaseException, rank: int, group_type: type) -> str | None:
    """For a rank's exception raised while it used a process group (a ``group_type``, the
    world's ProcessGroup class: handed in, since the group's module imports this one's
    users) that another rank created (a library's module global, shared by rank threads):
    the explanation, else None."""
    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, group_type) and value._global_rank != rank:
                return shared_object_message("a process group", value, value._global_rank, rank)
        tb = tb.tb_next
    return None
