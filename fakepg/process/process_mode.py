"""``spawn(..., isolation="process")``: every rank is a real OS process, the world stays one.

The parent runs the ordinary thread-mode world (scheduler, cluster, stores, hang detection,
traces) with one change: each rank thread is a *proxy* (:mod:`fakepg.process.rank_proxy`) for a
child process, forked from the warm parent before any rank thread starts. The child runs the
user's function with :class:`fakepg.process.remote.RemoteProcessGroup` groups; everything that can make it wait on
another rank -- collectives, p2p, barriers, the store, ``time.sleep`` -- is a request to its
proxy, which performs it on the real :class:`~fakepg.world.process_group.FakeProcessGroup` from
the rank's thread, where the scheduler sees it. A child only runs while its proxy holds
the baton, so a process-mode run makes exactly the decisions a thread-mode run makes:
same matching, same rank-order results, same hang verdicts and reports, same trace.

What the child owns is really its own: module globals, ``os.environ``, cwd, pid, signal
handlers, the profiler, ``sys.modules``. Tensors move through shared memory
(:mod:`fakepg.process.wire`). A child that dies (``os._exit``, a signal) fails its rank with
:class:`RankProcessDiedError` naming its exit status or signal. No child survives
``spawn``: on return, on an exception, on Ctrl-C (each is SIGKILLed and reaped), and on
the parent's own death (``PR_SET_PDEATHSIG``), and on SIGTERM to the parent (the world ends
as on Ctrl-C, then the parent terminates as SIGTERM asked). Shared-memory segments are unlinked
as they are made; one a child was making when it was killed is unlinked when it is reaped, so
none outlives its processes. A world needs two open files per rank in the parent (its pipe):
past the process's limit ``spawn`` says so, and what to do, before forking anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing import Pipe
from typing import Any, Callable, Iterator, Sequence

from ..errors import FakePGError
from ..world.isolation import ProcessState
from .mp_spawn import StartWorld
from .rank_proxy import KILL_GRACE, Proxy
from .wire import Channel

ISOLATIONS = ("thread", "process")


class RankProcessDiedError(FakePGError):
    """A rank's process ended without returning (``os._exit``, a signal, the OOM killer).
    ``.exitcode`` is its exit status or ``-signal``, as ``multiprocessing`` reports it."""

    ends_world = True

    def __init__(self, message: str, exitcode: int | None = None):
        super().__init__(message)
        self.exitcode = exitcode


def _set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when the thread that forked it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux: close() still reaps
        pass


def _describe_status(status: int) -> tuple[str, int]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"was killed by signal {sig} ({name})", -sig
    code = os.WEXITSTATUS(status)
    return f"exited with status {code}", code


def _wait_for_ended_rank_threads(thread_ids: Sequence[int], limit: float = 2.0) -> None:
    """Wait until the rank threads of earlier worlds have left the OS, not only Python.

    A joined thread still runs its native TLS destructors; MKL's frees its buffers under a
    lock there. Forked at that moment, a child inherits the lock held and spins forever at its
    first matmul (seen: ``mkl_serv_allocate``). fakepg waits for its own threads; a thread
    the program itself ends just before ``spawn`` can still do this (rare)."""
    deadline = time.monotonic() + limit
    for tid in thread_ids:
        while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
            time.sleep(0.0005)


_FILES_PER_RANK = 2  # the parent's end of the rank's socket pair, and the child's until forked
_FILES_SPARE = 32  # what the parent opens besides (received shm fds, logs, the program's own)


def _open_files_error(nprocs: int) -> FakePGError | None:
    """The error for a world whose pipes would pass this process's open-file limit."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        now = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):  # pragma: no cover - not Linux
        return None
    need = now + _FILES_PER_RANK * nprocs + _FILES_SPARE
    if soft == resource.RLIM_INFINITY or need <= soft:
        return None
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    suggest = need if hard == resource.RLIM_INFINITY else min(hard, max(need, 2 * soft))
    fix = (f"raise it (`ulimit -n {suggest}` in the shell that starts Python, or "
           f"resource.setrlimit(resource.RLIMIT_NOFILE, ({suggest}, resource.getrlimit("
           f"resource.RLIMIT_NOFILE)[1])) before spawn)" if need <= hard or
           hard == resource.RLIM_INFINITY else
           f"the hard limit ({hard_text}) is below that too: run fewer ranks per world")
    return FakePGError(
        f"fakepg.spawn(isolation='process') with {nprocs} ranks needs about {need} open files "
        f"in this process ({_FILES_PER_RANK} per rank for its pipe, {now} open now, "
        f"{_FILES_SPARE} to spare), but its limit is {soft} (RLIMIT_NOFILE; hard limit "
        f"{hard_text}): {fix}; or use isolation='thread', which opens no file per rank")


def _unlink_segments_of(pids: Sequence[int]) -> None:
    """Unlink torch's shm segments named after these (ended) processes: one a child was
    making (``/dev/shm/torch_<pid>_...``, unlinked by torch right after mapping it) when it
    was killed would outlive it."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:  # pragma: no cover - no /dev/shm
        return
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    for name in names:
        if name.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))


# What a rank process imports on first use, imported once in this (the parent) process before
# its first fork: else every child imports it on its own, one after the other (a child runs
# only while it holds the baton), and a fresh interpreter's first world pays it nprocs times.
# torch._dynamo is what DDP's constructor imports (~2 s); a thread-mode world imports it into
# this process as well.
WARM_MODULES = ("fakepg.process.remote", "torch.nn.parallel.distributed", "torch._dynamo")
_warmed = False


def warm_parent() -> None:
    """Import :data:`WARM_MODULES` here, once per process (the parent is the ranks' template)."""
    global _warmed
    if _warmed:
        return
    import importlib
    with _signals_held():
        for name in WARM_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a child that needs it raises it where it is used
                pass
        _warmed = True


@contextlib.contextmanager
def forked_ranks(fn: Callable[..., Any], args: Sequence[Any], processes: list[ProcessState],
                 seed: int, ended_threads: Sequence[int], start_world: StartWorld,
                 init: bool = True) -> Iterator["Children"]:
    """The world's rank processes while the block runs; every one killed and reaped after it.
    A SIGTERM to this process meanwhile (in its main thread, where no handler of the program's
    is installed) ends the world as Ctrl-C does, then terminates the process as SIGTERM would."""
    error = _open_files_error(len(processes))
    if error is not None:
        raise error
    warm_parent()
    handle = (threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt("SIGTERM")

    if handle:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        children = Children(fn, args, processes, seed, ended_threads, start_world, init)
        try:
            yield children
        finally:
            children.close()
    finally:
        if handle:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if terminated:
                os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _signals_held() -> Iterator[Callable[[], None]]:
    """Hold Ctrl-C (and SIGTERM) while the main thread forks or warms up, and deliver it after.

    ``os.fork`` runs Python's at-fork callbacks (logging's ``_acquireLock``/``_releaseLock``);
    a KeyboardInterrupt raised inside one is "ignored" (printed, then dropped) -- the interrupt
    was lost and the world ran on (seen under load: a Ctrl-C test waited forever on a rank
    sleeping 3600 s), and logging's lock could be left held. Importing torch._dynamo (the
    first world's warm-up) lost one silently too (a library's broad ``except`` around an import).
    Handlers that only record the signal stand in meanwhile; the yielded function restores
    the real ones (in a child)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None  # signals are handled on the main thread only
        return
    held: list[int] = []
    saved: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):  # a Python handler (default_int_handler, forked_ranks' SIGTERM)
            saved[signum] = handler
            signal.signal(signum, lambda num, frame: held.append(num))

    def restore() -> None:
        for num, handler in saved.items():
            signal.signal(num, handler)

    try:
        yield restore
    finally:
        restore()
        for num in held[:1]:  # as it would have been handled, now that nothing can drop it
            saved[num](num, sys._getframe())


class Children:
    """The rank processes of one world, forked at construction; ``serve`` is each proxy.

    ``ended_threads``: the OS ids of the last world's rank threads (waited for before forking);
    ``start_world`` runs a world a rank process starts (``torch.multiprocessing.spawn``);
    ``init``: whether each child initialises the world before ``fn`` (False: ``fn`` does)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], processes: list[ProcessState],
                 seed: int, ended_threads: Sequence[int], start_world: StartWorld,
                 init: bool = True):
        self.nprocs = len(processes)
        self.pids: list[int] = []
        self.channels: list[Channel] = []
        self.reaped: dict[int, int] = {}  # rank -> wait status
        self.said_goodbye: set[int] = set()
        for stream in (sys.stdout, sys.stderr):  # else buffered text is printed once per child
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        pipes = []  # (parent end, child end): socket pairs
        try:
            for _ in range(self.nprocs):
                pipes.append(Pipe())
        except OSError as e:
            for ends in pipes:
                for end in ends:
                    end.close()
            if e.errno == errno.EMFILE:  # the estimate was short: the same advice
                raise _open_files_error(self.nprocs) or e from None
            raise
        parent = os.getpid()
        _wait_for_ended_rank_threads(ended_threads)
        try:
            with _signals_held() as restore_in_child:
                for rank in range(self.nprocs):
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - runs in the child, which never returns
                        restore_in_child()
                        _child_main(rank, self.nprocs, pipes, fn, tuple(args), processes[rank],
                                    parent, seed, start_world, init)
                    self.pids.append(pid)
        except BaseException:
            self.channels = [Channel(p) for p, _ in pipes]
            self.close()
            raise
        finally:
            for _, child_end in pipes:
                child_end.close()
        self.channels = [Channel(p) for p, _ in pipes]

    def serve(self, rank: int) -> Any:
        """The rank thread's body: serve the child until it returns (its value) or fails."""
        return Proxy(self, rank).run()

    def wait_status(self, rank: int, block: float) -> int | None:
        """The child's wait status once it has ended (waiting up to ``block`` seconds)."""
        if rank in self.reaped:
            return self.reaped[rank]
        give_up = time.monotonic() + block
        while True:
            try:
                pid, status = os.waitpid(self.pids[rank], os.WNOHANG)
            except ChildProcessError:
                return self.reaped.setdefault(rank, 0)
            if pid:
                self.reaped[rank] = status
                return status
            if time.monotonic() >= give_up:
                return None
            time.sleep(0.001)

    def kill(self, rank: int) -> None:
        if rank not in self.reaped:
            try:
                os.kill(self.pids[rank], signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait_status(rank, 10.0)

    def died(self, rank: int) -> RankProcessDiedError:
        """The error for rank ``rank``'s process, which closed its pipe (reaped, or killed)."""
        status = self.wait_status(rank, 5.0)
        if status is None:
            self.kill(rank)
            return RankProcessDiedError(f"rank {rank}'s process (pid {self.pids[rank]}) closed "
                                        f"its pipe without exiting; it was killed")
        text, code = _describe_status(status)
        return RankProcessDiedError(f"rank {rank}'s process (pid {self.pids[rank]}) {text} "
                                    f"before its function returned", code)

    def close(self) -> None:
        """End and reap every child (after a goodbye, give it a moment to exit by itself)."""
        for rank in range(len(self.pids)):
            if rank in self.said_goodbye:
                self.wait_status(rank, KILL_GRACE)
            self.kill(rank)
        for ch in self.channels:
            try:
                ch.close()
            except OSError:
                pass
        _unlink_segments_of(self.pids)


def _child_main(rank: int, nprocs: int, pipes: list, fn: Callable[..., Any], args: tuple,
                state: ProcessState, parent: int, seed: int, start_world: StartWorld,
                init: bool) -> None:  # pragma: no cover - in the child
    """The forked child's whole life; never returns."""
    code = 0
    try:
        _set_parent_death_signal()
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
        try:  # every storage in a collective keeps its shm fd open: allow as many as we may
            import resource
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ImportError, ValueError, OSError):
            pass
        for i, (parent_end, child_end) in enumerate(pipes):
            parent_end.close()
            if i != rank:
                child_end.close()
        from . import remote

        state.install()
        # forked from a rank process (a nested world): its groups are not this process's
        from ..torch_private import unregister_all_process_groups
        unregister_all_process_groups() if unregister_all_process_groups else None
        channel = Channel(pipes[rank][1])
        remote.install(rank, nprocs, channel, seed, start_world)
        try:
            channel.recv_reply()  # "go": the proxy holds the baton
        except (EOFError, OSError):  # the world ended before this rank started (Ctrl-C): quietly
            os._exit(1)
        ok, payload = remote.run(fn, args, init)
        for stream in (sys.stdout, sys.stderr):
            closer = getattr(stream, "close_rank", None)
            try:
                if closer is not None:
                    closer(rank)
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        channel.send_request((("exit", ok, payload), []))
    except BaseException:  # noqa: BLE001 - the harness itself failed in the child
        try:
            traceback.print_exc()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        code = 70
    finally:
        os._exit(code)
