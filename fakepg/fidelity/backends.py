"""Backend personalities: the fake world answers as the backend the program asked for.

A program that calls ``init_process_group("gloo")`` (or ``"nccl"``, or
``fakepg.spawn(..., backend="nccl")``) gets a world whose groups report that name
(``dist.get_backend()``, ``pg.name()``), refuse what that backend refuses with its error type
and the gist of its message, and time out in its words (:mod:`fakepg.world.liveness`). ``"fakepg"``
is the permissive personality: everything fakepg can compute is allowed (AVG and PREMUL_SUM
on any dtype, bitwise ops, any-source receives).

Refusals were checked against real gloo on torch 2.13; the NCCL ones follow ProcessGroupNCCL's
and c10d's sources (no GPU here to run them).

    >>> from fakepg.fidelity import backends
    >>> backends.get("gloo").name
    'gloo'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import InvalidCollectiveError
from ..world.checks import Checker

if TYPE_CHECKING:
    from ..ops.matching import Call

_BITWISE = ("BAND", "BOR", "BXOR")


@dataclass(frozen=True)
class Refusal:
    """What a backend raises for a call it refuses: the exception type and its message."""

    error: type[Exception]
    message: str


@dataclass(frozen=True)
class Personality:
    """One backend's identity and what it refuses (``refuse(call)`` -> Refusal or None)."""

    name: str
    refuse: Callable[["Call"], Refusal | None]
    monitored_barrier: bool  # torch implements monitored_barrier for gloo only
    any_source_recv: bool
    event_prefix: str  # profiler events: "<prefix>:all_reduce"


_C10_DTYPE = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
              torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char",
              torch.bool: "bool"}


def tensor_options_text(t: torch.Tensor) -> str:
    """A tensor's options as c10 prints them in gloo's messages."""
    return (f"TensorOptions(dtype={_C10_DTYPE.get(t.dtype, str(t.dtype))}, device={t.device}, "
            f"layout=Strided, requires_grad=false (default), pinned_memory=false (default), "
            f"memory_format=(nullopt))")


def sizes_text(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def _gloo_refusal(call: "Call") -> Refusal | None:
    red = call.record.reduce_op
    if red == "PREMUL_SUM":
        return Refusal(RuntimeError, "Cannot use ReduceOp.PREMUL_SUM with Gloo")
    if red == "AVG":
        for t in call.inputs:
            if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
                name = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                        torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}.get(t.dtype, str(t.dtype))
                return Refusal(RuntimeError,
                               f"result type Float can't be cast to the desired output type {name}")
    root, size = call.root, len(call.record.group_ranks)
    if root is not None and not 0 <= root < size:
        return Refusal(RuntimeError, f"ProcessGroupGloo::{call.spec.fr_name}: invalid root rank: {root}")
    if call.op == "all_to_all":
        # gloo's alltoall moves equal-sized blocks: every tensor must match the first
        tensors = [t for t in (*call.inputs, *call.outputs) if isinstance(t, torch.Tensor)]
        want = tuple(tensors[0].shape) if tensors else ()
        for i, t in enumerate(call.inputs):
            if tuple(t.shape) != want:
                return Refusal(RuntimeError, f"ProcessGroupGloo::alltoall: invalid tensor size at "
                                             f"index {i} (expected {want}, got {tuple(t.shape)})")
    return None


def _nccl_refusal(call: "Call") -> Refusal | None:
    red = call.record.reduce_op
    if red in _BITWISE:
        return Refusal(ValueError, f"Cannot use ReduceOp.{red} with NCCL")
    if call.op == "recv" and call.peer is None:
        return Refusal(RuntimeError, "Backend nccl does not support recvAnysource")
    return None


PERSONALITIES: dict[str, Personality] = {
    "fakepg": Personality("fakepg", lambda call: None, monitored_barrier=True,
                          any_source_recv=True, event_prefix="gloo"),  # fakepg speaks gloo's words
    "gloo": Personality("gloo", _gloo_refusal, monitored_barrier=True, any_source_recv=True,
                        event_prefix="gloo"),
    "nccl": Personality("nccl", _nccl_refusal, monitored_barrier=False, any_source_recv=False,
                        event_prefix="nccl"),
}


def get(name: str) -> Personality:
    """The personality called ``name`` ("gloo", "nccl" or "fakepg")."""
    try:
        return PERSONALITIES[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}: fakepg speaks {', '.join(PERSONALITIES)}") from None


def from_request(backend: object) -> str | None:
    """The personality a backend request means: ``"gloo"``, ``"cpu:gloo,cuda:nccl"`` (the
    accelerator's wins, as the collectives of a GPU job go there), ``dist.Backend.NCCL``...;
    None when the request names none (``init_process_group()``) or another backend."""
    if backend is None:
        return None
    text = str(backend).lower()
    names = [part.split(":")[-1] for part in text.split(",")]
    for name in ("nccl", "gloo", "fakepg"):
        if name in names:
            return name
    return None


def refusal_text(call: "Call", refusal: Refusal) -> str:
    return f"{refusal.message} (rank {call.rank}: {call.op} at {call.site})"


class Refusals(Checker):
    """The world's check that a call is one its group's backend accepts: a call the
    personality refuses raises before it is issued, with that backend's words."""

    def issuing(self, call: "Call") -> None:
        refusal = get(call.personality).refuse(call)
        if refusal is not None:
            raise InvalidCollectiveError(refusal_text(call, refusal))


__all__ = ["Personality", "Refusal", "Refusals", "PERSONALITIES", "get", "from_request"]
