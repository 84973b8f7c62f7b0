"""A rank process's proxy: the rank thread of the parent's world that stands in for it.

Each request the child sends over its pipe -- a collective, a wait, a store operation, a
sleep -- the proxy performs on the real :class:`~fakepg.world.process_group.FakeProcessGroup` (or
store) from the rank's thread, where the scheduler sees it, and replies with the result and
the works completed meanwhile (:mod:`fakepg.process.remote` is the child's side).
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from ..fidelity import store as _store
from ..errors import copy_to_raise
from ..world.binding import current_cluster
from ..choices.faults import RankCrashed
from ..world.process_group import FakeProcessGroup, FakeWork, forced_call, requested_backend
# the real clock: time.monotonic on a rank thread (this one) is a preemption point in a world
from ..world.scheduler import monotonic as _monotonic
from .wire import RemoteTraceback, encode, pack_exception, unpack_exception

if TYPE_CHECKING:
    from .process_mode import Children

KILL_GRACE = 1.0  # seconds a child that said goodbye gets to exit before SIGKILL
# A child seen asleep this long, using no CPU, with no request on its pipe and no collective in
# flight, waits inside native code (a Rust/C++ client, a socket, a pipe) on something outside
# fakepg -- perhaps on another rank, as torchft's should_commit waits in Rust for every rank
# to call it. As under torchrun, where every process runs at once, the others then run
# meanwhile: the proxy lends the baton, LEND_SLICE seconds at a time, until the child calls in.
LEND_AFTER = 0.1
LEND_SLICE = 0.05


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


def _native_wait(pid: int) -> str:
    """How a report names a rank process's native wait: the kernel function its main thread
    sleeps in (``/proc/PID/wchan``: ``pipe_read``, ``futex_wait_queue``, ``do_epoll_wait``)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            where = f.read().strip()
    except OSError:
        where = ""
    where = f" (in the kernel's {where})" if where and where != "0" else ""
    return (f"a wait inside native code in its process (pid {pid}){where}: every thread "
            f"asleep, no request to fakepg, no collective in flight; the other ranks run meanwhile")


class Proxy:
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
        # The world's inactivity fallback judges the child's CPU use, not this thread's, and
        # the states of the child's threads (one starved of a core on a loaded machine works)
        # -- except while this proxy serves a request, or one waits on the pipe: the child
        # then sleeps waiting for the reply, and it is this thread (perhaps starved of a core
        # or of the GIL) that works.
        self.listening = False  # in _recv's poll, no request received yet
        self._peek = select.poll()  # the watchdog's own (a poll object is not for two threads)
        self._peek.register(self.channel.conn.fileno(), select.POLLIN)
        # whether the child called in (or died) while the baton is lent: read by the thread
        # that hands the baton over, so a poll object and a lock of its own
        self._lent_poll = select.poll()
        self._lent_poll.register(self.channel.conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        self._lent_mu = threading.Lock()
        self.sched.clocks.register(rank, lambda: _child_cpu_seconds(pid), pid, self._serving)

    def run(self) -> Any:
        try:
            self.channel.send_reply(("go",))
        except OSError:
            raise self.children.died(self.rank) from None
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
                raise self.children.died(self.rank) from None

    def _serving(self) -> bool:
        """Whether this proxy works for its child now (called on the watchdog's thread): it
        serves a request, or one waits on the pipe for this thread to be scheduled."""
        return not self.listening or bool(self._peek.poll(0))

    def _recv(self) -> tuple[tuple[Any, list[int]], dict[int, Any]]:
        aborted_at = None
        self.listening = True
        quiet: tuple[float, float] | None = None  # (child CPU, since when) while it sleeps
        wait_ms = 50
        while not self._poller.poll(wait_ms):  # one poll object (conn.poll builds a selector each time)
            wait_ms = 50
            if self.sched.abort_error is not None:
                # The world ended from outside (the inactivity fallback) while the child
                # computes or is stuck in C++: it gets a moment to call in, then it is ended.
                aborted_at = aborted_at or time.monotonic()
                if time.monotonic() - aborted_at > KILL_GRACE:
                    self.children.kill(self.rank)
                    raise copy_to_raise(self.sched.abort_error)
                continue
            quiet = self._quiet(quiet)
            if quiet is not None and _monotonic() - quiet[1] >= LEND_AFTER:
                self._lend()
                wait_ms = 0  # back with the baton: look again at once, lend again if need be
        self.listening = False
        try:
            return self.channel.recv_request()
        except (EOFError, OSError):
            raise self.children.died(self.rank) from None

    def _quiet(self, quiet: tuple[float, float] | None) -> tuple[float, float] | None:
        """The child's quiet episode so far: None while it computes (its CPU clock moves), has
        a thread not asleep (one waiting for a core works), or has a collective in flight (a
        C++ wait on its own Work: the watchdog's verdict, not a lend, is the answer)."""
        if self.cluster.outstanding[self.rank] or not self.sched.clocks.asleep(self.rank):
            return None
        cpu = _child_cpu_seconds(self.children.pids[self.rank])
        if quiet is None or cpu - quiet[0] > 0.002:
            return (cpu, _monotonic())
        return quiet

    def _called_in(self) -> bool:
        with self._lent_mu:
            return bool(self._lent_poll.poll(0))

    def _lend(self) -> None:
        """Let the other ranks run while the child sleeps in a native wait, for LEND_SLICE
        seconds or until it calls in. Parked as a timed Python wait: runnable again at its
        deadline, so the world is never judged hung on it (only a deadline ends a native
        wait nobody answers, as under torchrun)."""
        pid = self.children.pids[self.rank]
        try:
            self.sched.python_wait(self.rank, self._called_in, lambda: _native_wait(pid), LEND_SLICE)
        except Exception:  # noqa: BLE001 - the world ended meanwhile: _recv ends the child
            if self.sched.abort_error is None:
                raise

    # -- requests ----------------------------------------------------------------------
    def _group(self, desc: tuple) -> FakeProcessGroup:
        gid, name, ranks, timeout, requested, grank, bare = desc
        pg = self.groups.get(gid)
        if pg is None:
            with requested_backend(requested):
                pg = FakeProcessGroup(self.cluster, self.rank, grank, len(ranks),
                                      datetime.timedelta(seconds=timeout))
            pg._bare_backend = bare
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
        active = _store.active_stores()
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
