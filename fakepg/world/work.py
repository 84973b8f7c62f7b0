"""What a collective returns: :class:`FakeWork` and its :class:`FakeFuture`.

A work completes on its owner's thread (:meth:`fakepg.world.cluster.Cluster.complete_ready`), so
future callbacks run in the owning rank's context. The future plumbing both isolation modes
share -- a future made on first use, resolved when the work completes, a ``List[Tensor]``-typed
future for C++ consumers, gloo's ``result()`` and ``source_rank()`` -- is :class:`WorkBase` and
:class:`WorkFuture`; a rank process's works (:mod:`fakepg.process.remote.work`) build on them too.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ..errors import copy_to_raise
from .binding import current_cluster
from ..errors import FakePGError
from .checks import running_callback_of

if TYPE_CHECKING:
    from .cluster import Cluster
    from ..ops.matching import Call


class WorkFuture(torch.futures.Future):
    """A work's future whose ``wait`` goes through the work, where fakepg sees it (a wait in
    C++ would stall the baton, or in a rank process never end)."""

    def __init__(self, work: "WorkBase | None" = None):
        super().__init__()
        self._work = work

    def wait(self) -> Any:
        if self._work is not None:  # even when done: the wait is an event (for virtual clocks)
            self._work.wait()
        return super().wait()

    def done(self) -> bool:
        work = self._work
        if work is not None and not super().done():
            work._poll()
        return super().done() and (work is None or work._visible())

    def then(self, callback):  # type: ignore[override]
        child = type(self)(self._work)
        hooks, call = self._work._callback_hooks() if self._work is not None else (None, None)

        def run(fut: torch.futures.Future) -> None:
            if hooks is not None:
                hooks.completion_started(call)
            try:
                with running_callback_of(call):  # gloo runs it on its own thread (gloo_hazards)
                    value = callback(fut)
                child.set_result(value)
            except BaseException as e:  # noqa: BLE001 - forwarded to whoever waits on child
                child.set_exception(e)
            finally:
                if hooks is not None:
                    hooks.completion_finished(call)

        self.add_done_callback(run)
        return child


def _as_is(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


class WorkBase(dist.Work):
    """A ``dist.Work`` whose state fakepg keeps: done, error, and the future made from them.

    A subclass says what its result is (``_value``), which rank sent it (``_sender``), how it
    learns of completion (``_poll``), whether C++ waits on it (``_hidden``) and which future
    type it hands out (``_future_type``)."""

    _future_type: Callable[["WorkBase"], WorkFuture] = WorkFuture
    _copy_error: Callable[[BaseException], BaseException] = staticmethod(lambda e: e)

    def __init__(self) -> None:
        super().__init__()
        self._done = False
        self._error: BaseException | None = None
        # Made on first use: most works (the Reducer's, settled before it asks) never need one.
        self._fake_future: WorkFuture | None = None
        self._typed_future: torch.futures.Future | None = None

    # -- what a subclass provides ------------------------------------------------------
    def _value(self) -> list[Any]:
        raise NotImplementedError

    def _sender(self) -> int | None:
        return None

    def _poll(self) -> None:
        """Learn whether the work completed meanwhile."""

    def _visible(self) -> bool:
        return True

    def _hidden(self) -> bool:
        """Whether its wait happens in C++ (the Reducer's end of backward, Join's shadow)."""
        return False

    def _callback_hooks(self) -> tuple[Any, Any]:
        """(world hooks, call) that see a ``then`` callback run (None, None: none do)."""
        return None, None

    def _note_future(self, fut: torch.futures.Future) -> None:
        """``fut`` completes this work (its callbacks run as the work's)."""

    # -- the future ----------------------------------------------------------------------
    @property
    def _future(self) -> WorkFuture:
        fut = self._fake_future
        if fut is None:
            fut = self._fake_future = self._future_type(self)
            if self._done:
                self._resolve(fut)
        return fut

    def _resolve(self, fut: torch.futures.Future) -> None:
        if self._error is not None:
            fut.set_exception(self._copy_error(self._error))
        else:
            fut.set_result(self._value())

    def get_future(self) -> torch.futures.Future:
        if self._done and self._error is None and self._hidden():
            # Completed: hand out a future typed List[Tensor], as gloo's is. C++ consumers
            # (the built-in FP16_COMPRESS hook) assert on that type; a Python-made future
            # can only hold a PyObject. Pending works keep the WorkFuture, whose wait the
            # scheduler must see; so do works issued from Python outside backward (no C++
            # consumer), whose then-callbacks the world hooks must see (for virtual clocks).
            if self._typed_future is None:
                res = self._value()
                if res and all(isinstance(t, torch.Tensor) for t in res):
                    self._typed_future = torch._C.fork(_as_is, list(res))
                else:
                    self._typed_future = self._future
                self._note_future(self._typed_future)
            return self._typed_future
        return self._future

    _get_future = get_future

    # -- the rest of dist.Work -------------------------------------------------------------
    def is_completed(self) -> bool:
        self._poll()
        return self._done and self._visible()

    def is_success(self) -> bool:
        self._poll()
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        res = self._value()
        if any(isinstance(x, list) for x in res):  # as gloo's AsyncWork::result()
            raise RuntimeError("work result does not support list of lists, use .getFuture() and value()")
        return list(res)

    def source_rank(self) -> int:
        source = self._sender()
        if source is None:
            raise FakePGError("source_rank() is only available on a completed recv from any source")
        return source

    _source_rank = source_rank  # the name torch's dist.recv(src=None) calls

    def synchronize(self) -> None:
        pass


class FakeFuture(WorkFuture):
    """A future whose ``wait`` is visible to the scheduler (a C++ wait would stall the baton);
    world hooks see its ``then`` callbacks run."""


class FakeWork(WorkBase):
    """What every fakepg collective returns; completes on its owner's thread."""

    _future_type = FakeFuture
    _copy_error = staticmethod(copy_to_raise)

    def __init__(self, cluster: "Cluster", call: "Call | None"):
        super().__init__()
        self._cluster = cluster
        self._call = call
        self._done = call is None
        if call is not None:
            call.work = self

    def _value(self) -> list[Any]:
        return self._call.value() if self._call is not None else []

    def _sender(self) -> int | None:
        return None if self._call is None else self._call.source

    def _hidden(self) -> bool:
        return self._call is not None and self._call.hidden_wait

    def _callback_hooks(self) -> tuple[Any, Any]:
        call = self._call
        return (self._cluster.hooks, call) if call is not None else (None, None)

    def _note_future(self, fut: torch.futures.Future) -> None:
        self._cluster.checkers.future_made(fut, self._call)

    def _complete(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error
        if self._fake_future is not None:
            self._resolve(self._fake_future)

    def _poll(self) -> None:
        binding = current_cluster()
        if self._call is not None and binding is not None and binding[1] == self._call.rank:
            self._cluster.complete_ready(self._call.rank)

    def _visible(self) -> bool:
        """Whether a finished collective shows as completed yet (a choice under a schedule:
        on a real backend the peer's data may still be on its way)."""
        sched = self._cluster.scheduler
        return not sched.schedule.active or not sched.schedule.choose("completed", 2)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: ARG002
        if self._call is not None:
            self._cluster.wait(self._call)
        return True


class CoalescedWork(FakeWork):
    """What ``_end_coalescing`` returns: waits on every work issued in the block."""

    def __init__(self, cluster: "Cluster", works: list[FakeWork]):
        super().__init__(cluster, None)
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self._works:
            w.wait()
        return True
