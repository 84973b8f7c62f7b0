"""Profilers inside a fake world: one session per rank, never a crash.

torch's Kineto profiler drives one process-wide tracer. Two ranks that each open a profiler
overlap (rank 0's session is open while the baton passes to rank 1, which opens its own),
and Kineto then dies with SIGSEGV in ``__exit__``. Sharing one real session among the
ranks (or stopping and restarting it at each hand-off) would tear a session down while
another rank is inside an op it recorded; that op's end then writes into the freed session
once a new one runs, so neither is safe.

While a world runs, a profiler opened on a rank thread therefore runs as torch's
thread-local "legacy" profiler session, which shares nothing between threads: each rank
records exactly its own ops (backward included, since autograd runs on the rank's thread
during a world), sessions of different ranks overlap freely, and an op that spans a
session boundary is dropped instead of corrupting memory. Its records come back as a
``RankProfilerResult`` that stands in for Kineto's result, so ``torch.profiler.profile``
(schedules, ``step()``, ``key_averages()``, ``export_chrome_trace``, ``events()``) and
``torch.autograd.profiler.profile`` work unchanged. Not available per rank: Python stacks
(``with_stack`` records none), device kernels other than the per-op CUDA time the legacy
profiler measures, and Kineto-only outputs (the memory timeline, the event tree).
Outside a world nothing is changed.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import torch
import torch.autograd as _autograd
import torch.autograd.profiler as _aprof
from torch.autograd import DeviceType, ProfilerConfig, ProfilerState

from ..world.binding import current_cluster

_COLLECTIVE_PREFIXES = ("gloo:", "nccl:")
_USER_SCOPE = 7  # at::RecordScope::USER_SCOPE: record_function ranges
_KINETO_STATES = {s for n, s in ProfilerState.__members__.items() if n.startswith("KINETO")}

_local = threading.local()  # per rank thread: .settings (pending), .session (open)


class _Session:
    __slots__ = ("rank", "settings", "metadata")

    def __init__(self, rank: int, settings: dict[str, Any]) -> None:
        self.rank = rank
        self.settings = settings
        self.metadata: dict[str, str] = {}


class _Event:
    """One recorded op or memory event, with the methods torch reads from a KinetoEvent."""

    __slots__ = ("_name", "_start", "_end", "_tid", "_fwd_tid", "_handle", "_seq", "_shapes",
                 "_scope", "_flops", "_nbytes", "_device", "_cuda_us")

    def __init__(self, name: str, start_ns: int, end_ns: int, tid: int, *, fwd_tid: int = 0,
                 handle: int = 0, seq: int = -1, shapes: list | None = None, scope: int = 0,
                 flops: int = 0, nbytes: int = 0, device: int = -1, cuda_us: float = 0.0):
        self._name, self._start, self._end, self._tid = name, start_ns, end_ns, tid
        self._fwd_tid, self._handle, self._seq, self._shapes = fwd_tid, handle, seq, shapes or []
        self._scope, self._flops, self._nbytes = scope, flops, nbytes
        self._device, self._cuda_us = device, cuda_us

    def name(self) -> str: return self._name
    def start_ns(self) -> int: return self._start
    def end_ns(self) -> int: return self._end
    def duration_ns(self) -> int: return self._end - self._start
    def start_thread_id(self) -> int: return self._tid
    def end_thread_id(self) -> int: return self._tid
    def fwd_thread_id(self) -> int: return self._fwd_tid
    def correlation_id(self) -> int: return self._handle
    def linked_correlation_id(self) -> int: return 0
    def sequence_nr(self) -> int: return self._seq
    def shapes(self) -> list: return self._shapes
    def dtypes(self) -> list: return []
    def concrete_inputs(self) -> list: return []
    def kwinputs(self) -> dict: return {}
    def stack(self) -> list: return []
    def scope(self) -> int: return self._scope
    def flops(self) -> int: return self._flops
    def nbytes(self) -> int: return self._nbytes
    # A backend's collective event ends on its worker thread, not the caller's: torch
    # reports gloo's and NCCL's as async, and so do we.
    def is_async(self) -> bool: return self._name.startswith(_COLLECTIVE_PREFIXES)
    def is_user_annotation(self) -> bool: return self._scope == _USER_SCOPE
    def is_python_function(self) -> bool: return False
    def is_hidden_event(self) -> bool: return False
    def overload_name(self) -> str: return ""
    def activity_type(self) -> str: return "user_annotation" if self._scope == _USER_SCOPE else "cpu_op"
    def metadata_json(self) -> str: return ""
    def extra_meta(self) -> dict: return {}
    def cuda_elapsed_us(self) -> float: return self._cuda_us
    def privateuse1_elapsed_us(self) -> float: return 0.0

    def device_type(self) -> DeviceType:
        return DeviceType.CPU if self._device < 0 else DeviceType.CUDA

    def device_index(self) -> int: return max(self._device, 0)

    def __getattr__(self, name: str) -> Any:
        # KinetoEvent methods of other torch versions (flow ids, python ids, structured
        # shapes...): what torch reports for a CPU op without that information.
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: None


class RankProfilerResult:
    """One rank's profile, standing in for torch's ``_ProfilerResult``."""

    def __init__(self, rank: int, records: list[list[Any]], metadata: dict[str, str],
                 use_cuda: bool = False) -> None:
        self.rank = rank
        self.metadata = dict(metadata)
        self._events, self._start_ns = _convert(records, use_cuda)

    def events(self) -> list[_Event]:
        return list(self._events)

    def trace_start_ns(self) -> int:
        return self._start_ns

    def trace_activities(self) -> list:
        return []

    def experimental_event_tree(self) -> list:
        raise RuntimeError("the event tree (memory timeline, profiler analyses) is Kineto's; a "
                           "rank of a fake world is profiled by torch's legacy profiler, which "
                           "has none. Use key_averages(), events() or export_chrome_trace().")

    def save(self, path: str | os.PathLike) -> None:
        """Write the Chrome trace JSON (what Kineto's ``save`` writes, for this rank)."""
        pid = os.getpid()
        tids = sorted({e.start_thread_id() for e in self._events})
        trace: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": f"fakepg rank {self.rank}"}}]
        trace += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t,
                   "args": {"name": f"rank {self.rank}"}} for t in tids]
        for e in self._events:
            if e.name() == "[memory]":
                trace.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]",
                              "pid": pid, "tid": e.start_thread_id(), "ts": e.start_ns() / 1e3,
                              "args": {"Bytes": e.nbytes(), "Device Id": e.device_index()}})
                continue
            args: dict[str, Any] = {"External id": e.correlation_id(), "Record function id":
                                    e.correlation_id(), "Sequence number": e.sequence_nr(),
                                    "Fwd thread id": e.fwd_thread_id()}
            if e.shapes():
                args["Input Dims"] = e.shapes()
            trace.append({"ph": "X", "cat": e.activity_type(), "name": e.name(), "pid": pid,
                          "tid": e.start_thread_id(), "ts": e.start_ns() / 1e3,
                          "dur": (e.end_ns() - e.start_ns()) / 1e3, "args": args})
        doc: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [],
                               "displayTimeUnit": "ms", "traceName": os.fspath(path)}
        for key, value in self.metadata.items():
            try:
                doc[key] = json.loads(value)
            except ValueError:
                doc[key] = value
        doc["traceEvents"] = trace
        with open(path, "w") as f:
            json.dump(doc, f)


def _convert(records: list[list[Any]], use_cuda: bool) -> tuple[list[_Event], int]:
    """Legacy push/pop/memory records -> events (an op still open at the end is dropped)."""
    events: list[_Event] = []
    start_ns = None
    for thread_records in records:
        open_ops: dict[int, Any] = {}
        for r in thread_records:
            kind = r.kind()
            t_ns = int(r.start_us() * 1000)
            if kind == "mark":
                if r.name() == "__start_profile" and start_ns is None:
                    start_ns = t_ns
            elif kind == "push":
                open_ops[r.handle()] = r
            elif kind == "pop":
                push = open_ops.pop(r.handle(), None)
                if push is None:  # began before this session
                    continue
                cuda_us = push.cuda_elapsed_us(r) if use_cuda and push.has_cuda() else 0.0
                events.append(_Event(push.name(), int(push.start_us() * 1000), t_ns,
                                     push.thread_id(), fwd_tid=push.fwd_thread_id(),
                                     handle=push.handle(), seq=push.sequence_nr(),
                                     shapes=push.shapes(), scope=push.scope(),
                                     flops=push.flops(), cuda_us=cuda_us))
            elif kind == "memory_alloc":
                events.append(_Event("[memory]", t_ns, t_ns, r.thread_id(),
                                     nbytes=r.cpu_memory_usage() or r.cuda_memory_usage(),
                                     device=r.device()))
    events.sort(key=lambda e: (e.start_ns(), -e.end_ns()))
    if start_ns is None:
        start_ns = events[0].start_ns() if events else 0
    return events, start_ns


def _rank() -> int | None:
    binding = current_cluster()
    return None if binding is None else binding[1]


def _legacy_config(settings: dict[str, Any]) -> ProfilerConfig:
    state = ProfilerState.CUDA if settings["use_cuda"] else ProfilerState.CPU
    args = (state, settings["record_shapes"], settings["profile_memory"], False,
            settings["with_flops"], settings["with_modules"],
            torch._C._profiler._ExperimentalConfig())
    try:
        return ProfilerConfig(*args)
    except TypeError:  # builds whose constructor also takes a trace id
        return ProfilerConfig(*args, "")


class _Patches:
    """torch.autograd.profiler's entry points, routed per rank while a world runs."""

    def __init__(self) -> None:
        self.orig = {name: getattr(_aprof, name) for name in
                     ("_prepare_profiler", "_enable_profiler", "_disable_profiler")}
        self.orig_config = _aprof.profile.config
        self.orig_metadata = _autograd._add_metadata_json

    def __enter__(self) -> "_Patches":
        orig, orig_config, orig_metadata = self.orig, self.orig_config, self.orig_metadata

        def config(prof: Any, *args: Any, **kwargs: Any) -> Any:
            if _rank() is not None:  # remember what this profile asks for
                _local.settings = {
                    "record_shapes": bool(prof.record_shapes),
                    "profile_memory": bool(prof.profile_memory),
                    "with_flops": bool(prof.with_flops),
                    "with_modules": bool(getattr(prof, "with_modules", False)),
                    "use_cuda": prof.use_device == "cuda" and torch.cuda.is_available(),
                    "kineto": prof.profiler_kind in _KINETO_STATES}
            return orig_config(prof, *args, **kwargs)

        def prepare(*args: Any, **kwargs: Any) -> None:
            settings = getattr(_local, "settings", None)
            if _rank() is None or settings is None or not settings["kineto"]:
                return orig["_prepare_profiler"](*args, **kwargs)
            return None

        def enable(*args: Any, **kwargs: Any) -> None:
            rank, settings = _rank(), getattr(_local, "settings", None)
            if rank is None or settings is None or not settings["kineto"]:
                return orig["_enable_profiler"](*args, **kwargs)
            torch.autograd._enable_profiler_legacy(_legacy_config(settings))
            _local.session = _Session(rank, settings)
            return None

        def disable(*args: Any, **kwargs: Any) -> Any:
            session = getattr(_local, "session", None)
            if _rank() is None or session is None:
                return orig["_disable_profiler"](*args, **kwargs)
            _local.session = None
            records = torch.autograd._disable_profiler_legacy()
            return RankProfilerResult(session.rank, records, session.metadata,
                                      session.settings["use_cuda"])

        def add_metadata_json(key: str, value: str) -> None:
            session = getattr(_local, "session", None)
            if _rank() is None or session is None:
                return orig_metadata(key, value)
            session.metadata[key] = value
            return None

        self.host_enabled = getattr(_aprof, "_is_profiler_enabled", None)
        _aprof._prepare_profiler, _aprof._enable_profiler = prepare, enable
        _aprof._disable_profiler = disable
        _aprof.profile.config = config
        _autograd._add_metadata_json = add_metadata_json
        return self

    def __exit__(self, *exc: Any) -> bool:
        for name, fn in self.orig.items():
            setattr(_aprof, name, fn)
        _aprof.profile.config = self.orig_config
        _autograd._add_metadata_json = self.orig_metadata
        if self.host_enabled is not None:
            # torch's Python-side "a profiler is on" flag: a rank that never stopped its
            # profiler (its thread, and the session, are gone) must not leave it set.
            _aprof._is_profiler_enabled = self.host_enabled
        return False


def world_profilers() -> _Patches:
    """Context manager: per-rank profiler sessions for the world it surrounds."""
    return _Patches()
