"""Point-to-point ops: send and recv, matched per (src, dst, tag) in FIFO order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from .base import Op, c10d_method, copy_into, register

if TYPE_CHECKING:
    from .matching import Call


class PointToPoint(Op):
    p2p = True

    def agreed(self, call: "Call") -> list[tuple[str, Any]]:
        return []  # pairs are checked by check_members, not by sequence number

    def written(self, call: "Call") -> list[torch.Tensor]:
        return [t for t in call.inputs if isinstance(t, torch.Tensor)] if call.op == "recv" else []

    def check_members(self, calls: Sequence["Call"]) -> str | None:
        send, recv = calls
        s, r = send.inputs[0], recv.inputs[0]
        if s.numel() != r.numel() or s.dtype != r.dtype:
            return "numel/dtype"
        return None

    def execute(self, calls: list["Call"]) -> None:
        send, recv = calls
        copy_into(recv.inputs[0], send.inputs[0])
        recv.source = send.grank
        send.result, recv.result = list(send.inputs), list(recv.inputs)


SEND = register(PointToPoint.named("send"))
RECV = register(PointToPoint.named("recv"))


@c10d_method("send")
def _send(pg, tensors, dst, tag=0):
    return pg.issue(SEND, tensors, peer=dst, tag=tag)


@c10d_method("recv")
def _recv(pg, tensors, src, tag=0):
    return pg.issue(RECV, tensors, peer=src, tag=tag)


@c10d_method("recv_anysource")
def _recv_anysource(pg, tensors, tag=0):
    return pg.issue(RECV, tensors, peer=None, tag=tag)
