"""How a collective shows in its rank's own profiler: as the backend it emulates records it.

A real backend records a collective as a range named ``gloo:all_reduce`` (``nccl:…``) with its
input shapes; the data it moves is the network's work, not any rank's ops. The ProcessGroup
opens the range (:func:`collective_event`); the cluster moves the data unrecorded
(:func:`unrecorded`). Per-rank profiler sessions are :mod:`fakepg.fidelity.profiling`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from ..torch_private import (enable_record_function, profiler_enabled, record_function_with_args_enter,
                             record_function_with_args_exit)

_NULL = contextlib.nullcontext()


@contextlib.contextmanager
def _collective_range(name: str, tensors: Iterable[Any]) -> Iterator[None]:
    handle = record_function_with_args_enter(
        name, *[t for t in tensors if isinstance(t, torch.Tensor)])
    try:
        yield
    finally:
        record_function_with_args_exit(handle)


@contextlib.contextmanager
def _unrecorded_range() -> Iterator[None]:
    enable_record_function(False)
    try:
        yield
    finally:
        enable_record_function(True)


def unrecorded():
    """Context: ops run inside are not recorded by a profiler of the calling thread (the
    emulated network's data movement runs on whichever rank completes a collective, and is
    none of that rank's own work)."""
    return _unrecorded_range() if profiler_enabled() else _NULL


def collective_event(op: str, tensors: Iterable[Any] = (), backend: str = "gloo"):
    """A profiler range named as ``backend`` names the collective (``gloo:all_reduce``),
    recording the input shapes; a shared no-op context when no profiler is recording."""
    if not profiler_enabled():
        return _NULL
    return _collective_range(f"{backend}:{op}", tensors)
