"""The op registry: one object per collective op, the only place that says what an op is.

Layers above read ops from here (trace export, timing models, the recording process group)::

    from fakepg import ops
    op = ops.get("all_gather_into_tensor")
    op.fr_name        # "_all_gather_base"        (torch Flight Recorder's name)
    op.nccl_optype    # "_ALLGATHER_BASE"         (c10d OpType, as NCCL's watchdog prints it)
    op.cost_kind      # "all_gather"              (which network cost formula applies)
    ops.cost_kind("isend")   # "p2p": also accepts torch API and c10d method aliases

NOTE: metadata-only skeleton; behaviour (validation, fingerprint, bytes, execution) moves in next.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Op", "get", "names", "cost_kind", "COST_KINDS"]

COST_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather",
              "scatter", "all_to_all", "barrier", "p2p")


@dataclass(frozen=True)
class Op:
    name: str  # fakepg's trace name (torch.distributed API name)
    fr_name: str
    nccl_optype: str
    cost_kind: str
    aliases: tuple[str, ...] = ()


_OPS: dict[str, Op] = {}
_ALIASES: dict[str, str] = {}


def _register(op: Op) -> Op:
    _OPS[op.name] = op
    for a in (op.name, *op.aliases):
        _ALIASES[a] = op.cost_kind
    return op


for _op in (
    Op("all_reduce", "all_reduce", "ALLREDUCE", "all_reduce", ("allreduce",)),
    Op("all_reduce_coalesced", "allreduce_coalesced", "ALLREDUCE_COALESCED", "all_reduce",
       ("allreduce_coalesced",)),
    Op("broadcast", "broadcast", "BROADCAST", "broadcast", ("broadcast_object_list",)),
    Op("reduce", "reduce", "REDUCE", "reduce"),
    Op("all_gather", "all_gather", "ALLGATHER", "all_gather",
       ("allgather", "all_gather_coalesced", "allgather_coalesced", "all_gather_object")),
    Op("all_gather_into_tensor", "_all_gather_base", "_ALLGATHER_BASE", "all_gather",
       ("_allgather_base", "all_gather_single")),
    Op("all_gather_into_tensor_coalesced", "all_gather_into_tensor_coalesced", "ALLGATHER_COALESCED",
       "all_gather", ("allgather_into_tensor_coalesced",)),
    Op("gather", "gather", "GATHER", "gather", ("gather_object",)),
    Op("scatter", "scatter", "SCATTER", "scatter", ("scatter_object_list",)),
    Op("reduce_scatter", "reduce_scatter", "REDUCE_SCATTER", "reduce_scatter"),
    Op("reduce_scatter_tensor", "_reduce_scatter_base", "_REDUCE_SCATTER_BASE", "reduce_scatter",
       ("_reduce_scatter_base",)),
    Op("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced",
       "REDUCE_SCATTER_TENSOR_COALESCED", "reduce_scatter"),
    Op("all_to_all", "all_to_all", "ALLTOALL", "all_to_all", ("alltoall",)),
    Op("all_to_all_single", "all_to_all", "ALLTOALL_BASE", "all_to_all", ("alltoall_base",)),
    Op("barrier", "barrier", "BARRIER", "barrier"),
    Op("monitored_barrier", "barrier", "BARRIER", "barrier"),
    Op("send", "send", "SEND", "p2p", ("isend", "batch_isend_irecv")),
    Op("recv", "recv", "RECV", "p2p", ("irecv",)),
):
    _register(_op)


def get(name: str) -> Op:
    """The op called ``name`` in fakepg's trace (``CollectiveRecord.op``)."""
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"unknown collective {name!r}; fakepg knows: {', '.join(sorted(_OPS))}") from None


def names() -> list[str]:
    return list(_OPS)


def cost_kind(name: str) -> str:
    """The network cost formula for ``name`` (a trace name, torch API name or c10d method name)."""
    try:
        return _ALIASES[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; use a torch.distributed name, one of: "
                         f"{', '.join(sorted(_ALIASES))}") from None
