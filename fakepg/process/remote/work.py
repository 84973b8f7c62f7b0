"""A rank process's works and futures: mirrors of the works its proxy holds.

A work knows it is done when a reply says so (every reply carries the rank's newly completed
works, so ``then`` callbacks run at the same points as in thread mode). The future plumbing is
thread mode's (:class:`fakepg.world.work.WorkBase`).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ...ops.base import below_autograd
from ..wire import decode, unpack_exception
from ...world.work import WorkBase, WorkFuture
from . import rank as _rank


class RemoteFuture(WorkFuture):
    """A rank-side future whose ``wait`` asks the proxy (a wait in C++ would never end)."""


def copy_error(error: BaseException) -> BaseException:
    """A fresh copy of ``error`` to raise again (tracebacks are per raise)."""
    try:
        new = type(error).__new__(type(error), *error.args)
        new.args = error.args
        vars(new).update(vars(error))
        return new
    except Exception:  # noqa: BLE001
        return error


class RemoteWork(WorkBase):
    """The rank's handle on a work its proxy holds."""

    _future_type = RemoteFuture
    _copy_error = staticmethod(copy_error)

    def __init__(self, wid: int, tensors: list[torch.Tensor],
                 staged: list[tuple[torch.Tensor, torch.Tensor]], hidden: bool):
        super().__init__()
        self._wid = wid
        self._tensors = tensors
        self._staged = staged
        self._hidden_wait = hidden
        self._result: list[Any] = []
        self._source: int | None = None
        self._waited = False  # the proxy already made the one wait a sync call makes
        _rank.me().works[wid] = self

    def __del__(self) -> None:
        me = _rank.current()
        if me is not None:
            me.works.pop(self._wid, None)
            me.released.append(self._wid)

    def _value(self) -> list[Any]:
        return self._result

    def _sender(self) -> int | None:
        return self._source

    def _hidden(self) -> bool:
        return self._hidden_wait

    def _apply(self, state: tuple) -> None:
        done, error, result, source, waited = state
        self._waited = self._waited or waited
        if not done or self._done:
            return
        self._done = True
        self._source = source
        with below_autograd():
            for orig, copy in self._staged:
                orig.copy_(copy)
        if error is not None:
            self._error = unpack_exception(error)
        else:
            self._result = decode(result, self._tensors)
        fut = self._fake_future
        if fut is not None and not fut.done():
            self._resolve(fut)
        _rank.me().works.pop(self._wid, None)

    def _poll(self) -> None:
        if not self._done:
            self._apply(_rank.me().request("poll", self._wid))

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: ARG002
        if self._waited and self._done:
            self._waited = False  # that wait was this one; a later wait is another event
        else:
            self._waited = False
            self._apply(_rank.me().request("wait", self._wid))
        if self._error is not None:
            raise copy_error(self._error)
        return True
