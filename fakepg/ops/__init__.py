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
define and ``register`` it (with its ``c10d_method`` entry points) in its family's module.
"""

from __future__ import annotations

from .base import ALIASES as _ALIASES
from .base import C10D_METHODS as _C10D_METHODS
from .base import COST_KINDS, OPS as _OPS, Op, register
from . import reduce, gather, alltoall, barrier, p2p  # noqa: E402,F401,I001  (they register their ops)

__all__ = ["Op", "get", "lookup", "names", "cost_kind", "c10d_methods", "register", "COST_KINDS"]


def get(name: str) -> Op:
    """The op called ``name`` in fakepg's trace (``CollectiveRecord.op``)."""
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"unknown collective {name!r}; fakepg knows: {', '.join(sorted(_OPS))}") from None


def lookup(name: str) -> Op:
    """The op for ``name``: a trace name, a torch API name or a c10d method name."""
    try:
        return _ALIASES[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; use a torch.distributed name, one of: "
                         f"{', '.join(sorted(_ALIASES))}") from None


def names() -> list[str]:
    return list(_OPS)


def cost_kind(name: str) -> str:
    """The network cost formula for ``name`` (a trace name, torch API name or c10d method name)."""
    return lookup(name).cost_kind


def c10d_methods() -> dict[str, object]:
    """``ProcessGroup`` method name -> ``fn(pg, *c10d args)`` that issues the op."""
    return dict(_C10D_METHODS)
