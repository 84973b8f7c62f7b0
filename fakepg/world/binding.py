"""Which world, and which of its ranks, the calling thread runs: the fact every layer asks first.

A rank thread is bound to its world's :class:`~fakepg.world.cluster.Cluster` for its whole
life (by :func:`fakepg.spawn`); any other thread is unbound. Patched torch entry points, the
stores, the profilers and ``time.sleep`` ask :func:`current_cluster` to tell a rank's call
from the host's.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cluster import Cluster

_local = threading.local()


def current_cluster() -> tuple["Cluster", int] | None:
    """(cluster, global rank) of the calling rank thread, or None outside a fake world."""
    return getattr(_local, "binding", None)


def bind_thread(cluster: "Cluster | None", rank: int = -1) -> None:
    _local.binding = None if cluster is None else (cluster, rank)
