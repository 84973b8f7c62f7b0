"""``spawn(..., isolation="process")``: every rank is a real OS process, the world stays one.

The parent runs the ordinary thread-mode world (scheduler, cluster, stores, hang detection,
traces) with one change: each rank thread is a *proxy* for a child process, forked from the
warm parent before any rank thread starts. The child runs the user's function with
:class:`fakepg.remote.RemoteProcessGroup` groups; everything that can make it wait on
another rank -- collectives, p2p, barriers, the store, ``time.sleep`` -- is a request to its
proxy, which performs it on the real :class:`~fakepg.process_group.FakeProcessGroup` from
the rank's thread, where the scheduler sees it. A child only runs while its proxy holds
the baton, so a process-mode run makes exactly the decisions a thread-mode run makes:
same matching, same rank-order results, same hang verdicts and reports, same trace.

What the child owns is really its own: module globals, ``os.environ``, cwd, pid, signal
handlers, the profiler, ``sys.modules``. Tensors move through shared memory
(:mod:`fakepg.wire`). A child that dies (``os._exit``, a signal) fails its rank with
:class:`RankProcessDiedError` naming its exit status or signal. No child survives
``spawn``: on return, on an exception, on Ctrl-C (each is SIGKILLed and reaped), and on
the parent's own death (``PR_SET_PDEATHSIG``); shared-memory segments are unlinked as they
are made, so none outlives its processes.
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from multiprocessing import Pipe
from typing import Any, Callable, Sequence

from . import store as _store
from .cluster import _fresh, current_cluster
from .errors import FakePGError
from .faults import RankCrashed
from .isolation import ProcessState
from .process_group import FakeProcessGroup, FakeWork, forced_call, requested_backend
from .wire import Channel, RemoteTraceback, encode, pack_exception, unpack_exception

ISOLATIONS = ("thread", "process")
_KILL_GRACE = 1.0  # seconds a child that said goodbye gets to exit before SIGKILL


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


def _child_cpu_seconds(pid: int) -> float:
    """CPU seconds a child has used: its process CPU clock (ns; Linux's clock id for a pid is
    ``~pid << 3 | CPUCLOCK_SCHED``), else /proc's utime + stime (10 ms ticks)."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return time.monotonic()  # unknown: a value that keeps moving (never mistaken for a wait)


def _wait_for_ended_rank_threads(limit: float = 2.0) -> None:
    """Wait until the rank threads of earlier worlds have left the OS, not only Python.

    A joined thread still runs its native TLS destructors; MKL's frees its buffers under a
    lock there. Forked at that moment, a child inherits the lock held and spins forever at its
    first matmul (seen: ``mkl_serv_allocate``). fakepg waits for its own threads; a thread
    the program itself ends just before ``spawn`` can still do this (rare)."""
    from . import world

    deadline = time.monotonic() + limit
    for tid in world.ended_rank_thread_ids():
        while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
            time.sleep(0.0005)


class Children:
    """The rank processes of one world, forked at construction; ``serve`` is each proxy."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], processes: list[ProcessState],
                 seed: int = 0):
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
        pipes = [Pipe() for _ in range(self.nprocs)]  # (parent end, child end): socket pairs
        parent = os.getpid()
        _wait_for_ended_rank_threads()
        try:
            for rank in range(self.nprocs):
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child, which never returns
                    _child_main(rank, self.nprocs, pipes, fn, tuple(args), processes[rank], parent,
                                seed)
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
        return _Proxy(self, rank).run()

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

    def close(self) -> None:
        """End and reap every child (after a goodbye, give it a moment to exit by itself)."""
        for rank in range(len(self.pids)):
            if rank in self.said_goodbye:
                self.wait_status(rank, _KILL_GRACE)
            self.kill(rank)
        for ch in self.channels:
            try:
                ch.close()
            except OSError:
                pass


class _Proxy:
    """One rank thread standing in for its child: performs the child's requests."""

    def __init__(self, children: Children, rank: int):
        self.children, self.rank = children, rank
        self.channel = children.channels[rank]
        binding = current_cluster()
        assert binding is not None and binding[1] == rank
        self.cluster = binding[0]
        self.sched = self.cluster.scheduler
        self.groups: dict[int, FakeProcessGroup] = {}
        self.works: dict[int, tuple[FakeWork, dict[int, int]]] = {}
        self.pending: list[int] = []  # works the child has not yet been told are done
        self.stores: dict[int, _store.FakeStore] = {}
        self.ids = itertools.count()
        pid = children.pids[rank]
        self._poller = select.poll()
        self._poller.register(self.channel.conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        # the world's inactivity fallback judges the child's CPU use, not this thread's
        threading.current_thread().fakepg_cpu_clock = lambda: _child_cpu_seconds(pid)  # type: ignore[attr-defined]

    def run(self) -> Any:
        try:
            self.channel.send_reply(("go",))
        except OSError:
            raise self._died() from None
        while True:
            (msg, released), tensors = self._recv()
            for wid in released:
                self.works.pop(wid, None)
            kind = msg[0]
            if kind == "exit":
                self.children.said_goodbye.add(self.rank)
                ok, payload = msg[1], msg[2]
                if ok:
                    return pickle.loads(payload)
                error = unpack_exception(payload)
                raise error from RemoteTraceback(error._fakepg_traceback)  # type: ignore[attr-defined]
            try:
                if kind == "call":
                    reply = (True, self._do_call(*msg[1:], tensors=tensors))
                else:
                    reply = (True, getattr(self, "_do_" + kind)(*msg[1:]))
            except RankCrashed:
                self.children.kill(self.rank)  # an injected crash: the process dies for real
                raise
            except Exception as e:  # noqa: BLE001 - raised in the child, where the call was made
                reply = (False, pack_exception(e, with_site=False))
            try:
                self.channel.send_reply((*reply, self.cluster.backend, self._completed()))
            except OSError:
                raise self._died() from None

    def _recv(self) -> tuple[tuple[Any, list[int]], dict[int, Any]]:
        aborted_at = None
        while not self._poller.poll(50):  # ms; one poll object (conn.poll builds a selector each time)
            if self.sched.abort_error is not None:
                # The world ended from outside (the inactivity fallback) while the child
                # computes or is stuck in C++: it gets a moment to call in, then it is ended.
                aborted_at = aborted_at or time.monotonic()
                if time.monotonic() - aborted_at > _KILL_GRACE:
                    self.children.kill(self.rank)
                    raise _fresh(self.sched.abort_error)
        try:
            return self.channel.recv_request()
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> RankProcessDiedError:
        status = self.children.wait_status(self.rank, 5.0)
        if status is None:
            self.children.kill(self.rank)
            return RankProcessDiedError(f"rank {self.rank}'s process (pid "
                                        f"{self.children.pids[self.rank]}) closed its pipe "
                                        f"without exiting; it was killed")
        text, code = _describe_status(status)
        return RankProcessDiedError(
            f"rank {self.rank}'s process (pid {self.children.pids[self.rank]}) {text} before "
            f"its function returned", code)

    # -- requests ----------------------------------------------------------------------
    def _group(self, desc: tuple) -> FakeProcessGroup:
        gid, name, ranks, timeout, requested, grank = desc
        pg = self.groups.get(gid)
        if pg is None:
            with requested_backend(requested):
                pg = FakeProcessGroup(self.cluster, self.rank, grank, len(ranks),
                                      datetime.timedelta(seconds=timeout))
            pg._gstate = self.cluster.group(name, tuple(ranks), timeout)
            self.groups[gid] = pg
        return pg

    def _state(self, wid: int, waited: bool = False) -> tuple:
        work, index = self.works[wid]
        if not work._done:
            return (False, None, None, None, waited)
        call = work._call
        error = None if work._error is None else pack_exception(work._error, with_site=False)
        result = encode(call.result if call is not None else [], index)
        return (True, error, result, getattr(call, "source", None), waited)

    def _register(self, work: FakeWork, tensors: dict[int, Any], waited: bool) -> tuple:
        wid = next(self.ids)
        self.works[wid] = (work, {id(t): k for k, t in tensors.items()})
        state = self._state(wid, waited)
        if not state[0]:
            self.pending.append(wid)
        return wid, state

    def _completed(self) -> list[tuple[int, tuple]]:
        """Works done since the child last heard, in issue order (their callbacks run next)."""
        if not self.pending:
            return []
        out, still = [], []
        for wid in self.pending:
            entry = self.works.get(wid)
            if entry is None:
                continue
            if entry[0]._done:
                out.append((wid, self._state(wid)))
            else:
                still.append(wid)
        self.pending = still
        return out

    def _do_call(self, desc, method, args, kwargs, site, backward, sync, *, tensors=None):
        pg = self._group(desc)
        with forced_call(site, *backward):
            result = getattr(pg, method)(*args, **kwargs)
            waited = False
            if isinstance(result, FakeWork) and sync and not backward[1]:
                result.wait()  # c10d waits at once on a synchronous call: one round trip
                waited = True
        if isinstance(result, FakeWork):
            return ("work", self._register(result, tensors, waited))
        return ("value", encode(result, {id(t): k for k, t in tensors.items()}))

    def _do_wait(self, wid):
        self.works[wid][0].wait()
        return self._state(wid)

    def _do_poll(self, wid):
        self.works[wid][0].is_completed()
        return self._state(wid)

    def _do_pg(self, desc, method, args):
        if method in ("shutdown", "abort") and desc[0] not in self.groups:
            return None  # a group that never issued anything: nothing to end (as FakeProcessGroup)
        result = getattr(self._group(desc), method)(*args)
        if isinstance(result, FakeWork):
            return self._register(result, {}, False)
        return None

    def _do_store_new(self, kind, args, timeout):
        active = _store._ACTIVE
        assert active is not None, "no fake world is running"
        td = datetime.timedelta(seconds=timeout)
        if kind == "world":
            st = active.world_store(td)
        elif kind == "tcp":
            st = active.tcp(*args, timeout=td)
        elif kind == "file":
            st = active.file(*args)
        else:
            st = active.hash()
        sid = next(self.ids)
        self.stores[sid] = st
        return sid

    def _do_store_clone(self, sid):
        new = next(self.ids)
        self.stores[new] = self.stores[sid].clone()
        return new

    def _do_store(self, sid, method, args, timeout):
        st = self.stores[sid]
        if st.timeout.total_seconds() != timeout:
            st.set_timeout(datetime.timedelta(seconds=timeout))
        return getattr(st, method)(*args)

    def _do_sleep(self, seconds):
        self.sched.sleep(self.rank, seconds)

    def _do_set_backend(self, name):
        self.cluster.backend = name


def _child_main(rank: int, nprocs: int, pipes: list, fn: Callable[..., Any], args: tuple,
                state: ProcessState, parent: int, seed: int) -> None:  # pragma: no cover - in the child
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
        import torch.distributed as dist
        dist.distributed_c10d._unregister_all_process_groups() if hasattr(
            dist.distributed_c10d, "_unregister_all_process_groups") else None
        channel = Channel(pipes[rank][1])
        remote.install(rank, nprocs, channel, seed)
        channel.recv_reply()  # "go": the proxy holds the baton
        ok, payload = remote.run(fn, args)
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
