"""What each collective is called and which network cost formula it takes: the op registry's
names, readable without torch (simddp's network models read them when a saved capture is
replayed, which needs no torch).

One row per op, in registration order: fakepg's trace name (the torch.distributed API name),
torch Flight Recorder's name (the c10d C++ entry point), c10d's OpType as NCCL's watchdog
prints it, the cost kind (one of :data:`COST_KINDS`) and the aliases (torch API, c10d method
and functional-API names) that mean the same op. The op objects with their behaviour are built
from these rows in the family modules (``Op.named``); a new collective adds its row here.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["COST_KINDS", "OpNames", "NAMES", "ALIASES", "cost_kind", "lookup"]

COST_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather",
              "scatter", "all_to_all", "barrier", "p2p")


class OpNames(NamedTuple):
    name: str  # fakepg's trace name (torch.distributed API name)
    fr_name: str  # torch Flight Recorder's name (the c10d C++ entry point)
    nccl_optype: str  # c10d OpType, as NCCL's watchdog prints it
    cost_kind: str  # which network cost formula applies (one of COST_KINDS)
    aliases: tuple[str, ...] = ()  # torch API, c10d method and functional-API names


_ROWS = (
    OpNames("all_reduce", "all_reduce", "ALLREDUCE", "all_reduce",
            ("allreduce", "all_reduce_inplace")),
    OpNames("all_reduce_coalesced", "allreduce_coalesced", "ALLREDUCE_COALESCED", "all_reduce",
            ("allreduce_coalesced",)),
    OpNames("reduce", "reduce", "REDUCE", "reduce"),
    OpNames("reduce_scatter", "reduce_scatter", "REDUCE_SCATTER", "reduce_scatter"),
    OpNames("reduce_scatter_tensor", "_reduce_scatter_base", "_REDUCE_SCATTER_BASE",
            "reduce_scatter",
            ("_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_autograd",
             "reduce_scatter_tensor_inplace", "reduce_scatter_single_autograd")),
    OpNames("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced",
            "REDUCE_SCATTER_TENSOR_COALESCED", "reduce_scatter",
            ("reduce_scatter_single_coalesced",)),
    OpNames("broadcast", "broadcast", "BROADCAST", "broadcast", ("broadcast_object_list",)),
    OpNames("all_gather", "all_gather", "ALLGATHER", "all_gather",
            ("allgather", "all_gather_coalesced", "allgather_coalesced", "all_gather_object",
             "all_gather_inplace")),
    OpNames("all_gather_into_tensor", "_all_gather_base", "_ALLGATHER_BASE", "all_gather",
            ("_allgather_base", "all_gather_single", "all_gather_tensor",
             "all_gather_tensor_autograd", "all_gather_tensor_inplace",
             "all_gather_single_autograd")),
    OpNames("all_gather_into_tensor_coalesced", "all_gather_into_tensor_coalesced",
            "ALLGATHER_COALESCED", "all_gather",
            ("allgather_into_tensor_coalesced", "all_gather_single_coalesced")),
    OpNames("gather", "gather", "GATHER", "gather", ("gather_object",)),
    OpNames("scatter", "scatter", "SCATTER", "scatter", ("scatter_object_list",)),
    OpNames("all_to_all", "all_to_all", "ALLTOALL", "all_to_all",
            ("alltoall", "all_to_all_inplace")),
    OpNames("all_to_all_single", "all_to_all", "ALLTOALL_BASE", "all_to_all",
            ("alltoall_base", "all_to_all_single_autograd", "permute_tensor")),
    OpNames("barrier", "barrier", "BARRIER", "barrier"),
    OpNames("monitored_barrier", "barrier", "BARRIER", "barrier"),
    OpNames("send", "send", "SEND", "p2p",
            ("isend", "isend_inplace", "batch_isend_irecv", "batch_p2p_ops_inplace",
             "send_object_list")),
    OpNames("recv", "recv", "RECV", "p2p",
            ("irecv", "irecv_inplace", "recv_anysource", "recv_object_list")),
)

NAMES: dict[str, OpNames] = {r.name: r for r in _ROWS}
ALIASES: dict[str, OpNames] = {}  # every name of an op (its own and its aliases) -> its row
for _r in _ROWS:
    for _n in (_r.name, *_r.aliases):
        if _n in ALIASES:
            raise ValueError(f"op name {_n!r} listed twice")
        ALIASES[_n] = _r
    if _r.cost_kind not in COST_KINDS:
        raise ValueError(f"op {_r.name!r}: cost kind {_r.cost_kind!r} is not one of {COST_KINDS}")


def lookup(name: str) -> OpNames:
    """The names of the op ``name`` (a trace name, a torch API name or a c10d method name)."""
    try:
        return ALIASES[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; use a torch.distributed name, one of: "
                         f"{', '.join(sorted(ALIASES))}") from None


def cost_kind(name: str) -> str:
    """The network cost formula for ``name`` (a trace name, torch API name or c10d method name)."""
    return lookup(name).cost_kind
