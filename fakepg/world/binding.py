"""Which world, and which of its ranks, the calling thread runs: the fact every layer asks first.

A rank thread is bound to its world's :class:`~fakepg.world.cluster.Cluster` for its whole
life (by :func:`fakepg.spawn`); any other thread is unbound. Patched torch entry points, the
stores, the profilers and ``time.sleep`` ask :func:`current_cluster` to tell a rank's call
from the host's.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cluster import Cluster

# per thread: .binding, (cluster, rank) on a rank thread; read inline where a call costs too much
# (the clocks a busy loop reads)
thread_binding = threading.local()


def current_cluster() -> tuple["Cluster", int] | None:
    """(cluster, global rank) of the calling rank thread, or None outside a fake world."""
    return getattr(thread_binding, "binding", None)


def bind_thread(cluster: "Cluster | None", rank: int = -1) -> None:
    thread_binding.binding = None if cluster is None else (cluster, rank)


# A process a rank thread forks (multiprocessing, os.fork) is no rank: its time.sleep and
# waits are the real ones, and it holds no baton (there are no other ranks in it).
os.register_at_fork(after_in_child=lambda: bind_thread(None))
