"""The recording wrapper around a real backend (gloo, NCCL).

A Python ``dist.ProcessGroup`` that forwards every collective to the real backend and records
it (op named as fakepg's trace names it, group, shapes, dtypes). DDP, its C++ Reducer, Join and
comm hooks all run on that wrapper, exactly as they run on fakepg's process group, so both
sides' collective sequences are observed at the same interface.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..ops.base import dtype_name, flatten
from ..world.process_group import PythonProcessGroup
from .outcome import RecordedCollective

__all__ = ["RecordingProcessGroup", "RECORDING_BACKENDS", "register_recording_backends", "RECORDS"]

# Names under which the recording wrappers are registered as torch.distributed backends.
RECORDING_BACKENDS = {"gloo": "fakepg_recorded_gloo", "nccl": "fakepg_recorded_nccl"}

RECORDS: list[RecordedCollective] = []  # this process's collectives, all groups, in issue order


class RecordingProcessGroup(PythonProcessGroup):
    """A ``dist.ProcessGroup`` that forwards every collective to a real backend and records it.

    Registered as the backends ``fakepg_recorded_gloo`` / ``fakepg_recorded_nccl``, so that
    ``dist.init_process_group`` makes it the default group and DDP (its C++ Reducer included),
    Join and comm hooks issue their collectives through it. Ops are named and shapes taken as
    fakepg's trace does, so the two sequences compare element by element.
    """

    def __init__(self, inner: Any, rank: int, size: int, backend_name: str,
                 records: list[RecordedCollective] | None = None):
        super().__init__(rank, size)
        self._inner = inner
        self.backend_name = backend_name
        self._records = RECORDS if records is None else records
        self._ranks: tuple[int, ...] | None = None

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._inner.shutdown()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._inner.abort()

    def _group_ranks(self) -> tuple[int, ...]:
        if self._ranks is None:
            try:
                self._ranks = tuple(dist.get_process_group_ranks(self))
            except KeyError:  # not registered with c10d (yet)
                return tuple(range(self.size()))
        return self._ranks

    def _record(self, op: str, shown: Any) -> None:
        ts = [t for t in flatten(shown) if isinstance(t, torch.Tensor)]
        self._records.append(RecordedCollective(op, self._group_ranks(),
                                                tuple(tuple(t.shape) for t in ts),
                                                tuple(dtype_name(t.dtype) for t in ts)))

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
    return RecordingProcessGroup(inner, rank, world_size, RECORDING_BACKENDS["gloo"])


def _create_recorded_nccl(store, rank, world_size, timeout):
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    inner = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    with contextlib.suppress(Exception):
        inner._set_sequence_number_for_group()
    return RecordingProcessGroup(inner, rank, world_size, RECORDING_BACKENDS["nccl"])


def register_recording_backends() -> None:
    """Register ``fakepg_recorded_gloo`` (and ``fakepg_recorded_nccl`` where NCCL exists)."""
    for real, creator, devices in (("gloo", _create_recorded_gloo, ["cpu", "cuda"]),
                                   ("nccl", _create_recorded_nccl, ["cuda"])):
        name = RECORDING_BACKENDS[real]
        if hasattr(dist.Backend, name.upper()):
            continue
        if real == "nccl" and not dist.is_nccl_available():
            continue
        dist.Backend.register_backend(name, creator, devices=devices)
