"""The op registry: one object per collective op, the only place that says what an op is.

Layers above read ops from here (trace export, timing models, the recording process group)::

    from fakepg import ops
    op = ops.get("all_gather_into_tensor")
    op.fr_name        # "_all_gather_base"        (torch Flight Recorder's name)
    op.nccl_optype    # "_ALLGATHER_BASE"         (c10d OpType, as NCCL's watchdog prints it)
    op.cost_kind      # "all_gather"              (which network cost formula applies)
    ops.cost_kind("isend")   # "p2p": also accepts torch API and c10d method aliases

Each op also owns its behaviour (see :class:`~fakepg.ops.base.Op`): local validation,
the fingerprint members must agree on, bytes, written tensors, reference semantics, and
the ``ProcessGroup`` methods that issue it. The ops live in family modules; to add one,
define and ``register`` it (with its ``c10d_method`` entry points) in its family's module,
and its names in :mod:`fakepg.ops.naming`.

The names (``cost_kind``, ``COST_KINDS``) load without torch; the op objects, and torch with
them, load when first asked for (``get``, ``lookup``, ``Op`` ...), so what reads only the names
(simddp's network models replaying a saved capture) runs without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import naming
from .naming import COST_KINDS, NAMES, cost_kind

if TYPE_CHECKING:
    from .base import Op, register

__all__ = ["Op", "get", "lookup", "names", "cost_kind", "c10d_methods", "register", "COST_KINDS"]

_FAMILIES = ("reduce", "gather", "alltoall", "barrier", "p2p")  # each registers its ops


def _registry() -> Any:
    """fakepg.ops.base with every family's ops registered (imports torch)."""
    for family in _FAMILIES:
        importlib.import_module(f".{family}", __name__)
    return importlib.import_module(".base", __name__)


def __getattr__(name: str) -> Any:
    if name in ("Op", "register"):
        return getattr(_registry(), name)
    if name in _FAMILIES:  # ``ops.reduce`` ...: the family module, as after an eager import
        _registry()
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fakepg.ops' has no attribute {name!r}")


def get(name: str) -> Op:
    """The op called ``name`` in fakepg's trace (``CollectiveRecord.op``)."""
    try:
        return _registry().OPS[name]
    except KeyError:
        raise KeyError(f"unknown collective {name!r}; fakepg knows: {', '.join(sorted(NAMES))}") from None


def lookup(name: str) -> Op:
    """The op for ``name``: a trace name, a torch API name or a c10d method name."""
    return _registry().OPS[naming.lookup(name).name]


def names() -> list[str]:
    return list(NAMES)


def c10d_methods() -> dict[str, object]:
    """``ProcessGroup`` method name -> ``fn(pg, *c10d args)`` that issues the op."""
    return dict(_registry().C10D_METHODS)
