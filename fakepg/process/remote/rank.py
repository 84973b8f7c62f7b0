"""This process's rank: its number, its channel to the proxy, and the works it holds."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from ..wire import Channel, unpack_exception

if TYPE_CHECKING:
    from .work import RemoteWork


class Rank:
    """This process's rank, its channel to the proxy, and its works (one per process)."""

    def __init__(self, rank: int, nprocs: int, channel: Channel, seed: int = 0):
        self.rank, self.nprocs, self.channel, self.seed = rank, nprocs, channel, seed
        self.pid = os.getpid()  # a process this one forks inherits the object, not the rank
        self.backend = "fakepg"  # the world's personality, as the last reply told it
        self.works: dict[int, "RemoteWork"] = {}
        self.released: list[int] = []
        self.initialised_by_program: Any = None
        self.num_threads = 1
        self.nested = False
        # One request at a time on the channel: threads the program starts in this process
        # (torchft's quorum thread) reach the world's stores and groups through it too, and
        # two threads' messages interleaved on the pipe garbled both (a KeyError: None).
        self._lock = threading.Lock()

    def request(self, *msg: Any, tensors_out: list | None = None) -> Any:
        """Send ``msg``; return the reply's value (or raise its error). Works the reply
        reports complete are completed afterwards, here, as thread mode completes them."""
        with self._lock:
            released, self.released = self.released, []
            tensors, staged = self.channel.send_request((msg, released))
            if tensors_out is not None:
                tensors_out.append(tensors)
                tensors_out.append(staged)
            ok, value, backend, completed = self.channel.recv_reply()
        self.backend = backend
        for wid, state in completed:
            work = self.works.get(wid)
            if work is not None:
                work._apply(state)
        if not ok:
            raise unpack_exception(value)
        return value


_ME: Rank | None = None  # set by fakepg.process.remote.install in a rank process


def current() -> Rank | None:
    """This process's rank (None outside a rank process)."""
    return _ME


def in_rank_process() -> bool:
    """Whether this process is a rank process itself (not one that a rank process forked,
    which must not talk on its channel)."""
    return _ME is not None and _ME.pid == os.getpid()


def me() -> Rank:
    assert _ME is not None, "not in a rank process"
    return _ME


def become(rank: Rank) -> None:
    global _ME
    _ME = rank


def child_rank() -> int | None:
    """The rank this process runs for the caller's top-level world (None outside a rank
    process, and in the rank processes of a world a rank process started itself)."""
    return None if _ME is None or _ME.nested else _ME.rank


def seed() -> int:
    """The seed of the world this rank process belongs to."""
    return me().seed
