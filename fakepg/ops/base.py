"""What every op is: the :class:`Op` base class, the registry tables, and shared helpers.

An op object owns everything fakepg knows about one kind of collective: its names (trace,
Flight Recorder, c10d OpType), its cost kind, what one rank's call must satisfy on its own,
what all members must agree on, its size as nccl-tests counts it, which tensors it writes,
its reference semantics, and the ``ProcessGroup`` methods that issue it. Family modules
(``reduce``, ``gather``, ``alltoall``, ``p2p``, ``barrier``) define the ops; adding one
touches one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..torch_private import AutoDispatchBelowADInplaceOrView
from .naming import NAMES
from .reductions import DTYPE_LIMITED, check_supported

if TYPE_CHECKING:
    from .matching import Call


Fingerprint = tuple  # ((property name, value), ...): what every member must agree on


@dataclass(frozen=True, eq=False)
class Op:
    """One op kind. Subclasses override the behaviour; the defaults suit a collective
    whose inputs are written in place and whose tensors must agree in shape and dtype."""

    name: str  # fakepg's trace name (torch.distributed API name)
    fr_name: str  # torch Flight Recorder's name (the c10d C++ entry point)
    nccl_optype: str  # c10d OpType, as NCCL's watchdog prints it
    cost_kind: str  # which network cost formula applies (one of COST_KINDS)
    aliases: tuple[str, ...] = ()  # torch API, c10d method and functional-API names

    p2p = False  # matched per (src, dst, tag) instead of by sequence number

    @classmethod
    def named(cls, name: str) -> "Op":
        """The op ``name`` with this class's behaviour, called and costed as its row of
        :mod:`fakepg.ops.naming` says."""
        return cls(*NAMES[name])

    # -- one rank on its own --------------------------------------------------------
    def validate(self, call: "Call", group_size: int) -> str | None:
        """Why ``call`` is invalid on its own (None when it is fine)."""
        if call.reduce_op is not None and call.record.reduce_op in DTYPE_LIMITED:
            for t in tensors_of(call.inputs, call.outputs):
                why = check_supported(call.record.reduce_op, t.dtype)
                if why:
                    return why
        if call.root is not None and not 0 <= call.root < group_size:
            return (f"invalid root rank: {call.root} (a group of size {group_size} has ranks "
                    f"0..{group_size - 1})")
        if call.peer is not None and not 0 <= call.peer < group_size:
            return (f"invalid peer rank: {call.peer} (a group of size {group_size} has ranks "
                    f"0..{group_size - 1})")
        return self.validate_shapes(call, group_size)

    def validate_shapes(self, call: "Call", group_size: int) -> str | None:
        return None

    # -- across ranks ---------------------------------------------------------------------
    def fingerprint(self, call: "Call") -> Fingerprint:
        """The properties of ``call`` that every member must agree on."""
        fp: list[tuple[str, Any]] = [("op", call.op)]
        fp += self.agreed(call)
        rec = call.record
        if rec.reduce_op is not None:
            fp.append(("reduce op", rec.reduce_op))
            if rec.reduce_op == "PREMUL_SUM":
                f = call.reduce_op.factor
                fp.append(("premul factor", f.item() if isinstance(f, torch.Tensor) else f))
        if call.root is not None:
            fp.append(("root", call.root))
        return tuple(fp)

    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        """The op's own fingerprint entries (tensor signatures by default)."""
        return [("tensors", signature(call.inputs))]

    def check_members(self, calls: Sequence["Call"]) -> str | None:
        """A cross-rank check beyond equal fingerprints (None when the members fit)."""
        return None

    # -- what it moves and writes -------------------------------------------------------
    def nbytes(self, call: "Call", group_size: int) -> int:
        """Bytes as nccl-tests counts them (all_gather/reduce_scatter: the full buffer)."""
        return sum([tensor_bytes(t) for t in tensors_of(call.inputs)])

    def written(self, call: "Call") -> list[torch.Tensor]:
        """Tensors this call's collective writes on its rank (for race detection)."""
        return [t for t in flatten(call.outputs) if isinstance(t, torch.Tensor)]

    def execute(self, calls: list["Call"]) -> None:
        """Compute the collective from all members' inputs (rank order); write outputs and
        set each call's ``result`` to what gloo's future yields."""
        raise NotImplementedError(self.name)


# --------------------------------------------------------------------------------------
# Registry tables (filled by the family modules through register / c10d_method).
# --------------------------------------------------------------------------------------

OPS: dict[str, Op] = {}
ALIASES: dict[str, Op] = {}
C10D_METHODS: dict[str, Callable[..., Any]] = {}


def register(op: Op) -> Op:
    for n in (op.name, *op.aliases):
        if n in ALIASES and ALIASES[n] is not op:
            raise ValueError(f"op name {n!r} registered twice")
        ALIASES[n] = op
    OPS[op.name] = op
    return op


def c10d_method(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare ``fn(pg, *c10d args)`` as the ``ProcessGroup`` method(s) ``names``."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for n in names:
            C10D_METHODS[n] = fn
        return fn
    return deco


# --------------------------------------------------------------------------------------
# Helpers shared by the families.
# --------------------------------------------------------------------------------------

def flatten(xs: Any) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(flatten(x))
        else:
            out.append(x)
    return out


def tensors_of(*lists: Any) -> list[torch.Tensor]:
    """The tensors in ``lists``, nested lists and tuples flattened, in order (one pass: this
    runs several times on every collective)."""
    out: list[torch.Tensor] = []
    for xs in lists:
        for x in xs:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out.extend(tensors_of(x))
    return out


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (cached: this runs on every collective)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def signature(ts: Sequence[Any]) -> tuple:
    return tuple([(tuple(t.shape), dtype_name(t.dtype), t.device.type) for t in ts])


def tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    if t.is_sparse:
        return t._values().nbytes
    return t.nbytes  # numel() * element_size(), in one call


def below_autograd() -> Any:
    """Where the network writes into the ranks' tensors: below autograd, as a backend's C++
    kernels write — no graph across ranks, no version bump, and leaves that require grad
    accepted (``dist.broadcast(param, 0)``, a recv buffer that requires grad)."""
    return AutoDispatchBelowADInplaceOrView()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        src = src.reshape(dst.shape)
    dst.copy_(src)


def gloo_future_value(lists: list[list[Any]]) -> list[Any]:
    """What gloo's future yields for a vector of output lists: [] when there is none,
    the one list itself when there is one, else the list of lists (ProcessGroupGloo's
    returnFutureWithOutput)."""
    if not lists:
        return []
    return list(lists[0]) if len(lists) == 1 else [list(x) for x in lists]


def as_list(tensors: Any) -> list[Any]:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


_REDUCE_OP_TYPES = (dist.ReduceOp, dist.ReduceOp.RedOpType)
_SUM = dist.ReduceOp.SUM


def reduce_op_of(opts: Any) -> Any:
    if opts is None:
        return _SUM
    if isinstance(opts, _REDUCE_OP_TYPES):
        return opts
    return opts.reduceOp
