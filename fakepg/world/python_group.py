"""What a ``dist.ProcessGroup`` written in Python needs, in either isolation mode.

:class:`PythonProcessGroup` keeps the identity c10d expects (name, description); a group
gets a real one-rank gloo backend for DDP's logger, the personality it was created with
(:func:`requested_backend`), and can tell whether a call comes from DDP's Join shadow of the
backward pass. :class:`~fakepg.world.process_group.FakeProcessGroup` (thread mode) and a rank
process's :class:`~fakepg.process.remote.RemoteProcessGroup` build on these.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

BACKEND_NAME = "fakepg"


class PythonProcessGroup(dist.ProcessGroup):
    """A ``dist.ProcessGroup`` implemented in Python, with the identity c10d expects of it.

    A Python ProcessGroup has no C++ backend to keep its name and description, so they live
    here (c10d sets them through the C++ trampoline after creating the group).
    """

    backend_name = BACKEND_NAME
    # (global ranks, name) of a group built outside c10d's registry (fakepg.fidelity.foreign_backends)
    _fixed_membership: tuple[tuple[int, ...], str] | None = None

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._group_name = ""
        self._group_desc = ""

    def _ranks_and_name(self, nprocs: int) -> tuple[tuple[int, ...], str]:
        """This group's global ranks (by group rank) and its name in traces and reports:
        c10d's group name, else "default" for the whole world, else its rank list."""
        if self._fixed_membership is not None:
            return self._fixed_membership
        mapping = c10d._world.pg_group_ranks.get(self)
        if mapping:
            ranks = tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))
        else:
            ranks = tuple(range(self.size()))
        try:
            name = self.group_name
        except Exception:  # noqa: BLE001 - unnamed groups get a positional name
            name = ""
        if not name:
            name = "default" if len(ranks) == nprocs else f"group{list(ranks)}"
        return ranks, name

    # -- what a bare ProcessGroupGloo also answers (fakepg.fidelity.foreign_backends builds such groups)
    _bare_backend = False  # built as a bare ProcessGroupGloo: gloo's checks, no dispatcher
    _gloo_options: Any = None  # the ProcessGroupGloo._Options it was built with
    _timeout: datetime.timedelta

    @property
    def options(self) -> Any:
        """gloo's options object, as ``ProcessGroupGloo.options`` gives it (its ``_timeout``
        is the group's)."""
        if self._gloo_options is None:
            self._gloo_options = dist.ProcessGroupGloo._Options()
        self._gloo_options._timeout = self._timeout
        return self._gloo_options

    def _set_default_timeout(self, timeout: datetime.timedelta) -> None:
        """The timeout of this group's later collectives (``ProcessGroupGloo``'s method)."""
        self._timeout = timeout
        self._timeout_set(timeout)

    def _timeout_set(self, timeout: datetime.timedelta) -> None:
        """Where the group's waits learn the new timeout (each mode's group says)."""

    def getBackendName(self) -> str:  # noqa: N802 - C++ trampoline name
        return self.backend_name

    def name(self) -> str:
        return self.backend_name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc


_GLOO_FOR_LOGGING: list[Any] = []


def gloo_backend_for_logging() -> Any:
    """DDP's C++ logger, seeing backend name "gloo", reads the group's GLOO backend for its
    device list: a real (one-rank, never used for collectives) gloo backend to give it."""
    if not _GLOO_FOR_LOGGING:  # one per process, made on first use (about a millisecond)
        _GLOO_FOR_LOGGING.append(dist.ProcessGroupGloo(dist.HashStore(), 0, 1,
                                                       datetime.timedelta(minutes=30)))
    return _GLOO_FOR_LOGGING[0]


_creating = threading.local()


@contextlib.contextmanager
def requested_backend(name: str | None):
    """The personality a group created inside this block asks for (None: the world's)."""
    saved = getattr(_creating, "name", None)
    _creating.name = name
    try:
        yield
    finally:
        _creating.name = saved


def creating_backend() -> str | None:
    """The personality asked for by the :func:`requested_backend` block around this call."""
    return getattr(_creating, "name", None)


_shadow = threading.local()  # per thread: how deep in DDP's Join shadow of the backward pass


def in_join_shadow() -> bool:
    """Whether DDP's Join hook (``_match_all_reduce_for_bwd_pass``) runs on this thread's
    stack (a flag its patched version keeps, see :func:`marking_join_shadow`: a check on
    every collective, cheaper than walking the stack for its frame)."""
    return getattr(_shadow, "depth", 0) > 0


def marking_join_shadow(original: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's ``_match_all_reduce_for_bwd_pass`` that flags its thread while it runs (a
    running world, or a rank process, patches it onto DDP)."""
    @functools.wraps(original)
    def _match_all_reduce_for_bwd_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
        _shadow.depth = getattr(_shadow, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _shadow.depth -= 1

    return _match_all_reduce_for_bwd_pass


def keeping_join_work_alive(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Join.notify_join_context`` that keeps the Work it returns alive on the joinable.

    DDP hands that Work (the forward's all-reduce of "not joined yet") to its C++ Reducer,
    which waits on it in backward. fakepg's Works are Python objects: C++ holds only the
    C++ half, and once the Python half is collected (it sits in a reference cycle with its
    call, so when the cyclic collector happens to run between forward and backward) the
    Reducer's wait falls through to the base ``Work::wait`` and blocks forever on a
    condition nothing signals (seen: ``test_join_training_on_uneven_inputs_...`` hung in a
    run of the ``-k join`` tests). The joinable holds it until its next forward replaces it."""
    @functools.wraps(original)
    def notify_join_context(joinable: Any) -> Any:
        work = original(joinable)
        joinable._fakepg_join_work = work
        return work

    return notify_join_context

