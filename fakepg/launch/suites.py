"""torch's ``MultiProcessTestCase`` suites, unmodified, on the fake cluster.

Projects test distributed code with ``torch.testing._internal.common_distributed.
MultiProcessTestCase`` and its subclasses (``DTensorTestBase``, ``DistributedTest``'s
``TestDistBackend``, their own): the main process starts one OS process per rank, each runs
``cls._run(rank, test_name, file_name, pipe)``, and the main process turns their exit codes
into the test's verdict. Only the start-up is replaced here: the ranks of one test are one
fake world (``fakepg.spawn(..., init_process_group=False)``: threads, or forked processes with
``isolation="process"``), each rank runs the class's own ``_run`` exactly as a process would,
its ``sys.exit`` code (or 0) becomes that rank's exit code, and torch's own
``_check_return_codes`` gives the verdict: ``TEST_SKIPS`` codes skip, exit code 10 fails with
the ranks' tracebacks, ``special_return_code_checks`` and ``skip_return_code_checks`` hold.

Three ways to ask for it, one mechanism:

- ``pytest --fakepg-suites`` (``--fakepg-suites=process`` for process isolation): every
  ``MultiProcessTestCase`` collected in that session;
- ``@fakepg.suites.on_fake_cluster`` (or ``on_fake_cluster(isolation="process")``) on a class;
- :class:`FakeClusterProcesses` first among a test class's bases.

A hang that gloo would sit in until its timeout (``get_timeout``: 300 s) fails at once with
fakepg's hang report in the failing ranks' tracebacks.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, TypeVar

from ..arguments import integer, number
from ..errors import RankOsExit, SpawnTimeoutError
from .spawn import spawn

__all__ = ["FakeClusterProcesses", "on_fake_cluster", "fake_cluster_suites"]

_ISOLATIONS = ("thread", "process")
_C = TypeVar("_C", bound=type)


class _RankProcess:
    """What ``MultiProcessTestCase`` reads of one rank's process: ``pid`` (the key of its
    pipe), ``exitcode`` (None until the world ran, and for a rank stopped by the timeout)."""

    _next_pid = 1 << 22  # above Linux's default pid_max: never a real process's pid

    def __init__(self, rank: int, child_conn: Any):
        self.rank, self.child_conn = rank, child_conn
        self.name = f"process {rank}"
        self.pid = _RankProcess._next_pid
        _RankProcess._next_pid += 1
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return False  # the world has ended whenever the test case can look

    def join(self, timeout: float | None = None) -> None:
        return None

    def terminate(self) -> None:
        return None

    kill = terminate

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.child_conn.close()


def _exit_code(code: object) -> int:
    """A process's exit status for ``sys.exit(code)``, as the interpreter sets it."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


def _class_thread_locals(cls: type) -> list[tuple[threading.local, dict[str, Any]]]:
    """The test class's class-level ``threading.local`` objects with this thread's values.

    A process runs its test on the thread that imported the module, which set them
    (torch's device-type tests keep their precision so); a rank thread starts with them set."""
    found = []
    for klass in cls.__mro__:
        for value in vars(klass).values():
            if isinstance(value, threading.local):
                found.append((value, dict(vars(value))))
    return found


def _start_processes(self: Any, proc: Any) -> None:
    """``MultiProcessTestCase._start_processes``: one rank per process slot, none started yet
    (the world runs when the main process joins them)."""
    import torch.multiprocessing

    self.processes = []
    for rank in range(int(self.world_size)):
        parent_conn, child_conn = torch.multiprocessing.Pipe()
        process = _RankProcess(rank, child_conn)
        self.pid_to_pipe[process.pid] = parent_conn
        self.processes.append(process)


def _join_processes(self: Any, fn: Callable[..., Any]) -> None:
    """``MultiProcessTestCase._join_processes``: run every rank's ``_run`` on one fake world,
    then torch's own ``_check_return_codes``."""
    from torch.testing._internal.common_distributed import get_timeout

    cls, test_name, file_name = type(self), self._current_test_name(), self.file_name
    pipes = [p.child_conn for p in self.processes]
    kwargs = {"fake_pg": getattr(self, "fake_pg", False)}
    thread_locals = _class_thread_locals(cls)

    def rank_process(rank: int) -> int:
        # The body of a rank's process: its exit code is what sys.exit said, 0 when _run
        # returned, 1 for an exception that escaped (multiprocessing prints it and exits 1).
        for tls, values in thread_locals:
            vars(tls).update(values)
        try:
            cls._run(rank, test_name, file_name, pipes[rank], **kwargs)
        except SystemExit as e:
            return _exit_code(e.code)
        except RankOsExit as e:  # os._exit(n) on the rank's thread: its process's exit code
            return e.code
        except BaseException:  # noqa: BLE001 - a process's uncaught exception: printed, exit 1
            traceback.print_exc()
            return 1
        return 0

    timeout = float(self.fakepg_timeout or get_timeout(self.id()))
    start = time.time()
    try:
        result = spawn(rank_process, nprocs=len(self.processes), seed=self.fakepg_seed,
                       timeout=timeout, isolation=self.fakepg_isolation, backend="gloo",
                       init_process_group=False)
        for process, code in zip(self.processes, result.returns):
            process.exitcode = code
    except SpawnTimeoutError as e:  # exit codes stay None: "terminated or timed out"
        print(f"Timing out after {timeout} seconds (fakepg):\n{e.report}", file=sys.stderr)
    try:
        self._check_return_codes(fn, time.time() - start)
    finally:
        for process in self.processes:
            process.close()
        for pipe in self.pid_to_pipe.values():
            pipe.close()


class FakeClusterProcesses:
    """Put first among a ``MultiProcessTestCase`` subclass's bases: its ranks run on the fake
    cluster. ``fakepg_isolation`` (``"thread"`` or ``"process"``), ``fakepg_seed`` and
    ``fakepg_timeout`` (seconds of wall clock per test; None: torch's ``get_timeout``) are class
    attributes to override."""

    fakepg_isolation = "thread"
    fakepg_seed = 0
    fakepg_timeout: float | None = None
    _start_processes = _start_processes
    _join_processes = _join_processes


def _check(isolation: str, seed: int) -> tuple[str, int]:
    if isolation not in _ISOLATIONS:
        raise ValueError(f"fakepg.suites: isolation must be 'thread' or 'process', got "
                         f"{isolation!r}")
    return isolation, integer("fakepg.suites: seed", seed)


def _require_suite_class(cls: object) -> None:
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    if not (isinstance(cls, type) and issubclass(cls, MultiProcessTestCase)):
        raise TypeError(f"fakepg.suites.on_fake_cluster: expected a subclass of torch's "
                        f"MultiProcessTestCase (DTensorTestBase, TestDistBackend, your own), "
                        f"got {cls!r}")


def on_fake_cluster(cls: _C | None = None, *, isolation: str = "thread",
                    seed: int = 0, timeout: float | None = None) -> _C | Callable[[_C], _C]:
    """Class decorator: this ``MultiProcessTestCase`` subclass (and its subclasses) runs its
    ranks on the fake cluster. ``@on_fake_cluster`` or ``@on_fake_cluster(isolation=...)``;
    ``timeout``: seconds of wall clock per test (default: torch's ``get_timeout``)."""
    isolation, seed = _check(isolation, seed)
    if timeout is not None:
        timeout = number("fakepg.suites: timeout", timeout, positive=True, hint="seconds, or None")

    def decorate(klass: _C) -> _C:
        _require_suite_class(klass)
        klass._start_processes = _start_processes  # type: ignore[attr-defined]
        klass._join_processes = _join_processes  # type: ignore[attr-defined]
        klass.fakepg_isolation = isolation  # type: ignore[attr-defined]
        klass.fakepg_seed = seed  # type: ignore[attr-defined]
        klass.fakepg_timeout = timeout  # type: ignore[attr-defined]
        return klass

    return decorate if cls is None else decorate(cls)


@contextlib.contextmanager
def fake_cluster_suites(isolation: str = "thread", seed: int = 0) -> Iterator[None]:
    """While it is entered, every ``MultiProcessTestCase`` runs its ranks on the fake cluster
    (what ``pytest --fakepg-suites`` does for a session)."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    isolation, seed = _check(isolation, seed)
    names = ("_start_processes", "_join_processes", "fakepg_isolation", "fakepg_seed",
             "fakepg_timeout")
    saved = {n: vars(MultiProcessTestCase).get(n) for n in names}
    on_fake_cluster(MultiProcessTestCase, isolation=isolation, seed=seed)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(MultiProcessTestCase, name)
            else:
                setattr(MultiProcessTestCase, name, value)
