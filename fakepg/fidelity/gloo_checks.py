"""gloo's own argument checks on a ProcessGroup's methods, with gloo's messages.

A call reaches ``ProcessGroupGloo`` through one of two doors, and each refuses a malformed
call in its own words:

* a ``ProcessGroup`` (what ``init_process_group`` / ``new_group`` give) first goes through
  c10d's dispatcher, which refuses a call with no tensor at all ("There were no tensor
  arguments to this function ... schema c10d::allreduce_."), whatever the backend;
* a bare ``ProcessGroupGloo`` (what a program, a registered backend's creator or torch's own
  c10d tests construct directly) goes straight to gloo's checks.

Past the dispatcher both reach gloo's checks, which :class:`ArgumentChecks` (a checker the
world calls as a ProcessGroup method is called) runs for groups with the gloo personality
before fakepg issues anything: the root rank and root tensor, single-element
lists, list lengths against the group size, layouts, and each tensor's type and size against
the reference tensor. Messages and their order were taken from torch 2.13's real
``ProcessGroupGloo`` called with the same arguments (``tests/test_pg_api_vs_gloo.py``
compares them call by call).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import InvalidCollectiveError
from ..ops.base import reduce_op_of
from ..ops.reductions import op_name
from ..world.checks import Checker
from ..world.process_group import call_site
from .backends import sizes_text, tensor_options_text

# The c10d dispatcher's schema behind each ProcessGroup method (the name in its message).
_SCHEMAS = {"allreduce": "allreduce_", "allreduce_coalesced": "allreduce_coalesced_",
            "broadcast": "broadcast_", "allgather": "allgather_",
            "allgather_coalesced": "allgather_coalesced_", "gather": "gather_",
            "scatter": "scatter_", "reduce": "reduce_", "reduce_scatter": "reduce_scatter_",
            "alltoall": "alltoall_"}


class _Refused(Exception):
    """gloo's message for one call (the method's name is added by :func:`checked`)."""


def _has_tensor(args: Sequence[Any]) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            return True
        if isinstance(a, (list, tuple)) and _has_tensor(a):
            return True
    return False


def _root(root: int, size: int) -> None:
    if not 0 <= root < size:
        raise _Refused(f"invalid root rank: {root}")


def _root_tensor(index: int, count: int) -> None:
    if not 0 <= index < count:
        raise _Refused(f"invalid root tensor: {index}")


def _match(tensors: Sequence[torch.Tensor], ref: torch.Tensor, offset: int = 0) -> None:
    """gloo's assertTypeAndSizesMatch: every tensor has ``ref``'s type and sizes; the index
    is the tensor's place in the list gloo checks (``offset`` -1 where gloo checks
    ``tensors.slice(1)`` against ``tensors[0]``, as allreduce and broadcast do)."""
    for i, t in enumerate(tensors):
        if t.dtype != ref.dtype or t.device != ref.device or t.layout != ref.layout:
            raise _Refused(f"invalid tensor type at index {i + offset} (expected "
                           f"{tensor_options_text(ref)}, got {tensor_options_text(t)})")
        if t.shape != ref.shape:
            raise _Refused(f"invalid tensor size at index {i + offset} (expected {sizes_text(ref)}, "
                           f"got {sizes_text(t)})")


def _layouts_match(tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.layout != tensors[0].layout:
            raise _Refused(f"invalid tensor layout at index {i} (expected "
                           f"{_layout(tensors[0])}, got {_layout(t)})")


def _layout(t: torch.Tensor) -> str:
    return "Sparse" if t.is_sparse else "Strided"


def _opt(opts: Any, name: str, default: int = 0) -> int:
    return default if opts is None or isinstance(opts, int) else getattr(opts, name, default)


def _broadcast(pg: Any, tensors: Any, opts: Any = None, root: Any = None) -> None:
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if root is None:
        root = opts if isinstance(opts, int) else _opt(opts, "rootRank")
    _root(root, pg.size())
    _root_tensor(_opt(opts, "rootTensor"), len(tensors))
    _match(tensors[1:], tensors[0])


def _allreduce(pg: Any, tensors: Any, opts: Any = None) -> None:
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not tensors:
        raise _Refused("requires non-empty tensor list")
    _layouts_match(tensors)
    _match(tensors[1:], tensors[0])
    if tensors[0].is_sparse:
        if op_name(reduce_op_of(opts)) != "SUM":
            raise _Refused("unsupported reduction operation (allreduce of sparse tensors only "
                           "works with ReduceOp.SUM)")


def _allreduce_coalesced(pg: Any, tensors: Any, opts: Any = None) -> None:
    tensors = list(tensors)
    if not tensors:
        raise _Refused("requires non-empty tensor list")
    _layouts_match(tensors)
    if any(t.dtype != tensors[0].dtype for t in tensors):
        raise _Refused("tensors must all have the same type")
    if tensors[0].is_sparse:
        raise _Refused("unsupported layout")


def _reduce(pg: Any, tensors: Any, opts: Any = None) -> None:
    tensors = list(tensors)
    _root(_opt(opts, "rootRank"), pg.size())
    _root_tensor(_opt(opts, "rootTensor"), len(tensors))
    if len(tensors) != 1:
        raise _Refused("requires a single-element tensor list")


def _rooted(pg: Any, singles: Any, lists: Any, opts: Any, single: str, listed: str) -> None:
    """scatter's and gather's checks: one ``single`` tensor on every rank, a list of one list
    per rank of ``listed`` tensors on the root only (scatter: output/input, gather: the other
    way round)."""
    size, root = pg.size(), _opt(opts, "rootRank")
    _root(root, size)
    if len(singles) != 1:
        raise _Refused(f"requires a single-element {single} tensor list")
    if pg.rank() == root:
        if len(lists) != 1:
            raise _Refused(f"requires a single-element {listed} list containing a list with "
                           f"{size} tensors.")
        if len(lists[0]) != size:
            raise _Refused(f"Incorrect {listed} list size {len(lists[0])}. "
                           f"{listed.capitalize()} list size should be {size}, same as size of "
                           f"the process group.")
        _match(lists[0], singles[0])
    elif lists:
        raise _Refused(f"requires empty {listed} on non-root")


def _scatter(pg: Any, outputs: Any, inputs: Any, opts: Any = None) -> None:
    _rooted(pg, outputs, inputs, opts, "output", "input")


def _gather(pg: Any, outputs: Any, inputs: Any, opts: Any = None) -> None:
    _rooted(pg, inputs, outputs, opts, "input", "output")


def _allgather(pg: Any, outputs: Any, inputs: Any, opts: Any = None) -> None:
    if not inputs:
        raise _Refused("requires non-empty input tensor list")
    if len(inputs) != len(outputs):
        raise _Refused("requires input/output tensor lists to have the same length")
    want = len(inputs) * pg.size()
    for i, out in enumerate(outputs):
        if len(out) != want:
            raise _Refused(f"invalid output tensor list at index {i} (expected length {want}, "
                           f"got {len(out)})")
    _match(inputs, inputs[0])
    for out in outputs:
        _match(out, inputs[0])


def _allgather_coalesced(pg: Any, output_lists: Any, inputs: Any, opts: Any = None) -> None:
    if not inputs:
        raise _Refused("requires non-empty input tensor list")
    if len(output_lists) != pg.size():
        raise _Refused("output lists should be equal to world size")
    for outs in output_lists:
        if len(outs) != len(inputs):
            raise _Refused(f"invalid output size: (expected length {len(inputs)}, got "
                           f"{len(outs)})")
        for i, (o, t) in enumerate(zip(outs, inputs)):
            if o.shape != t.shape:
                raise _Refused(f"invalid size of output tensor at index {i} (expected length "
                               f"{sizes_text(t)}, got {sizes_text(o)})")
            if o.dtype != t.dtype or o.device != t.device:
                raise _Refused(f"invalid tensor type at index {i} (expected {t.type()}, got "
                               f"{o.type()})")


_CHECKS: dict[str, Callable[..., None]] = {
    "broadcast": _broadcast, "allreduce": _allreduce, "allreduce_coalesced": _allreduce_coalesced,
    "reduce": _reduce, "scatter": _scatter, "gather": _gather, "allgather": _allgather,
    "allgather_coalesced": _allgather_coalesced}


class ArgumentChecks(Checker):
    """The checks of the door a ProcessGroup method's call comes through, before fakepg
    issues anything: c10d's dispatcher's for a ProcessGroup (a call without tensors), then
    gloo's own for a group with the gloo personality or built as a bare ``ProcessGroupGloo``."""

    def calling(self, pg: Any, method: str, args: tuple, kwargs: dict) -> None:
        schema, check = _SCHEMAS.get(method), _CHECKS.get(method)
        bare = getattr(pg, "_bare_backend", False)
        if schema is not None and not bare and not _has_tensor(args) \
                and not _has_tensor(tuple(kwargs.values())):
            raise NotImplementedError(
                "There were no tensor arguments to this function (e.g., you passed an empty "
                "list of Tensors), but no fallback function is registered for schema "
                f"c10d::{schema}.")
        if check is not None and (bare or pg.personality.name == "gloo"):
            try:
                check(pg, *args, **kwargs)
            except _Refused as e:
                raise InvalidCollectiveError(f"ProcessGroupGloo::{method}: {e} (rank "
                                             f"{pg._global_rank}: {method} at {call_site(2)})") from None


__all__ = ["ArgumentChecks"]
