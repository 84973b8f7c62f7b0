"""The rank's side of ``isolation="process"``: what runs in each rank's own OS process.

The rank process holds no part of the world. Its default group and every group it makes are
:class:`RemoteProcessGroup`\\ s, registered under the same backend name ``"fakepg"``; each
collective, p2p call, barrier, store operation and ``time.sleep`` is a request over the
rank's pipe to its proxy thread in the parent, which performs it on the parent's fake world
(:mod:`fakepg.process_mode`) -- so matching, validation, rank-order results, hang verdicts
and traces are exactly thread mode's. Works and futures here mirror the proxy's: a work
knows it is done when a reply says so (every reply carries the rank's newly completed
works, so ``then`` callbacks run at the same points as in thread mode).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import sys
import time
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import backends, ops
from .ops.base import below_autograd
from .process_group import (BACKEND_NAME, PythonProcessGroup, _as_is, _creating,
                            _gloo_backend_for_logging, _in_join_shadow, requested_backend)
from .wire import Channel, decode, pack_exception, unpack_exception

# torch's own entry points, as captured when fakepg was imported (not whatever a running
# world has patched in by the time this module is first imported)
from .patches import (_ORIGINAL_GET_BACKEND, _ORIGINAL_INIT, _ORIGINAL_MONITORED_BARRIER,  # noqa: E402
                      _ORIGINAL_PG_HELPER, monitored_barrier_arguments)


class _Rank:
    """This process's rank, its channel to the proxy, and its works (one per process)."""

    def __init__(self, rank: int, nprocs: int, channel: Channel, seed: int = 0):
        self.rank, self.nprocs, self.channel, self.seed = rank, nprocs, channel, seed
        self.backend = "fakepg"  # the world's personality, as the last reply told it
        self.works: dict[int, "RemoteWork"] = {}
        self.released: list[int] = []
        self.initialised_by_program: Any = None
        self.num_threads = 1
        self.nested = False

    def request(self, *msg: Any, tensors_out: list | None = None) -> Any:
        """Send ``msg``; return the reply's value (or raise its error). Works the reply
        reports complete are completed afterwards, here, as thread mode completes them."""
        released, self.released = self.released, []
        tensors, staged = self.channel.send_request((msg, released))
        if tensors_out is not None:
            tensors_out.append(tensors)
            tensors_out.append(staged)
        ok, value, backend, completed = self.channel.recv_reply()
        self.backend = backend
        for wid, state in completed:
            work = self.works.get(wid)
            if work is not None:
                work._apply(state)
        if not ok:
            raise unpack_exception(value)
        return value


_ME: _Rank | None = None


def child_rank() -> int | None:
    """The rank this process runs for the caller's top-level world (None outside a rank
    process, and in the rank processes of a world a rank process started itself)."""
    return None if _ME is None or _ME.nested else _ME.rank


def _me() -> _Rank:
    assert _ME is not None, "not in a rank process"
    return _ME


class RemoteFuture(torch.futures.Future):
    """A rank-side future whose ``wait`` asks the proxy (a wait in C++ would never end)."""

    def __init__(self, work: "RemoteWork | None" = None):
        super().__init__()
        self._work = work

    def wait(self) -> Any:
        if self._work is not None:
            self._work.wait()
        return super().wait()

    def done(self) -> bool:
        if self._work is not None and not super().done():
            self._work.is_completed()
        return super().done()

    def then(self, callback):  # type: ignore[override]
        child = RemoteFuture(self._work)

        def run(fut: torch.futures.Future) -> None:
            try:
                child.set_result(callback(fut))
            except BaseException as e:  # noqa: BLE001 - forwarded to whoever waits on child
                child.set_exception(e)

        self.add_done_callback(run)
        return child


class RemoteWork(dist.Work):
    """The rank's handle on a work its proxy holds."""

    def __init__(self, wid: int, tensors: list[torch.Tensor],
                 staged: list[tuple[torch.Tensor, torch.Tensor]], hidden: bool):
        super().__init__()
        self._wid = wid
        self._tensors = tensors
        self._staged = staged
        self._hidden = hidden
        self._done = False
        self._error: BaseException | None = None
        self._result: list[Any] = []
        self._source: int | None = None
        self._waited = False  # the proxy already made the one wait a sync call makes
        self._fake_future: RemoteFuture | None = None
        self._typed_future: torch.futures.Future | None = None
        _me().works[wid] = self

    def __del__(self) -> None:
        me = _ME
        if me is not None:
            me.works.pop(self._wid, None)
            me.released.append(self._wid)

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
        _me().works.pop(self._wid, None)

    def _resolve(self, fut: torch.futures.Future) -> None:
        if self._error is not None:
            fut.set_exception(_copy(self._error))
        else:
            fut.set_result(self._result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: ARG002
        if self._waited and self._done:
            self._waited = False  # that wait was this one; a later wait is another event
        else:
            self._waited = False
            self._apply(_me().request("wait", self._wid))
        if self._error is not None:
            raise _copy(self._error)
        return True

    def is_completed(self) -> bool:
        if not self._done:
            self._apply(_me().request("poll", self._wid))
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        if any(isinstance(x, list) for x in self._result):  # as gloo's AsyncWork::result()
            raise RuntimeError("work result does not support list of lists, use .getFuture() and value()")
        return list(self._result)

    def source_rank(self) -> int:
        if self._source is None:
            from .errors import FakePGError
            raise FakePGError("source_rank() is only available on a completed recv from any source")
        return self._source

    _source_rank = source_rank

    def synchronize(self) -> None:
        pass

    @property
    def _future(self) -> RemoteFuture:
        fut = self._fake_future
        if fut is None:
            fut = self._fake_future = RemoteFuture(self)
            if self._done:
                self._resolve(fut)
        return fut

    def get_future(self) -> torch.futures.Future:
        if self._done and self._error is None and self._hidden:
            # As FakeWork: a settled work of the Reducer gets a future typed List[Tensor].
            if self._typed_future is None:
                res = self._result
                if res and all(isinstance(t, torch.Tensor) for t in res):
                    self._typed_future = torch._C.fork(_as_is, list(res))
                else:
                    self._typed_future = self._future
            return self._typed_future
        return self._future

    _get_future = get_future


def _copy(error: BaseException) -> BaseException:
    """A fresh copy of ``error`` to raise again (tracebacks are per raise)."""
    try:
        new = type(error).__new__(type(error), *error.args)
        new.args = error.args
        vars(new).update(vars(error))
        return new
    except Exception:  # noqa: BLE001
        return error


_group_ids = itertools.count()


class RemoteProcessGroup(PythonProcessGroup):
    """One rank's handle on one group of the parent's fake world."""

    def __init__(self, rank: int, size: int, timeout: datetime.timedelta | None = None):
        super().__init__(rank, size)
        self._gid = next(_group_ids)
        self._timeout = timeout or datetime.timedelta(minutes=30)
        self._requested: str | None = getattr(_creating, "name", None)
        self._desc: tuple | None = None
        self._coalescing = False
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               _gloo_backend_for_logging())

    @property
    def personality(self) -> backends.Personality:
        return backends.get(self._requested or _me().backend)

    @property
    def backend_name(self) -> str:  # type: ignore[override]
        return self.personality.name

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def _describe(self) -> tuple:
        """(id, name, ranks, timeout, requested personality, group rank): what the proxy
        needs to stand in for this group (named as FakeProcessGroup names it)."""
        if self._desc is None:
            mapping = c10d._world.pg_group_ranks.get(self)
            if mapping:
                ranks = tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))
            else:
                ranks = tuple(range(self.size()))
            try:
                name = self.group_name
            except Exception:  # noqa: BLE001
                name = ""
            if not name:
                name = "default" if len(ranks) == _me().nprocs else f"group{list(ranks)}"
            self._desc = (self._gid, name, ranks, self._timeout.total_seconds(), self._requested,
                          self.rank())
        return self._desc

    def _issue(self, method: str, args: tuple, kwargs: dict) -> Any:
        from .sites import user_site

        site = user_site(3)
        in_backward = torch._C._current_graph_task_id() != -1
        hidden = in_backward or _in_join_shadow()
        opts = next((a for a in (*args, *kwargs.values()) if hasattr(a, "asyncOp")), None)
        sync = opts is not None and opts.asyncOp is False and not self._coalescing
        out: list = []
        with _collective_event(self, method, args):
            reply = _me().request("call", self._describe(), method, args, kwargs, site,
                                  (in_backward, hidden), sync, tensors_out=out)
        kind, value = reply
        if kind == "work":
            wid, state = value
            work = RemoteWork(wid, out[0], out[1], hidden)
            work._apply(state)
            return work
        return decode(value, out[0])

    def _start_coalescing(self, device=None):
        self._coalescing = True
        _me().request("pg", self._describe(), "_start_coalescing", (device,))

    def _end_coalescing(self, device=None):
        self._coalescing = False
        wid, state = _me().request("pg", self._describe(), "_end_coalescing", (device,))
        work = RemoteWork(wid, [], [], False)
        work._apply(state)
        return work

    def shutdown(self) -> None:
        _me().request("pg", self._describe(), "shutdown", ())

    def abort(self) -> None:
        _me().request("pg", self._describe(), "abort", ())


def _collective_event(pg: RemoteProcessGroup, method: str, args: tuple):
    """The profiler range thread mode records for a collective (``gloo:all_reduce``), in this
    rank's own profiler; shapes are those of every tensor argument."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    from .ops.base import tensors_of

    try:
        name = ops.lookup(method).name
    except ValueError:
        name = method
    if method == "recv_anysource":  # gloo's event name, as thread mode records it
        name = "recvAnySource"
    # the event shows the inputs, as thread mode's (and the backends') do: the second argument
    # of the c10d methods that take their outputs first
    inputs = args[1] if method in _OUTPUTS_FIRST and len(args) > 1 else args[:1]
    return _ended_elsewhere(f"{pg.personality.event_prefix}:{name}", tensors_of([inputs]))


_OUTPUTS_FIRST = frozenset({
    "allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base"})


@contextlib.contextmanager
def _ended_elsewhere(name: str, tensors: list[Any]):
    """A profiler range begun on this thread and ended on another, as a backend's collective
    is (gloo's ends on its worker thread): torch's real profiler then reports it async, as
    thread mode's per-rank profiler does."""
    import threading

    handle = torch.autograd._record_function_with_args_enter(
        name, *[t for t in tensors if isinstance(t, torch.Tensor)])
    try:
        yield
    finally:
        ender = threading.Thread(target=torch.autograd._record_function_with_args_exit,
                                 args=(handle,), name="fakepg-collective-end")
        ender.start()
        ender.join()


def _forwarder(name: str) -> Callable[..., Any]:
    def method(self: RemoteProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return self._issue(name, args, kwargs)

    method.__name__ = name
    return method


for _name in ops.c10d_methods():
    setattr(RemoteProcessGroup, _name, _forwarder(_name))


def _create_remote(store, rank, world_size, timeout):
    from .cluster import current_cluster
    from .process_group import _create_fakepg

    if current_cluster() is not None:  # a rank of a world nested in this process (mp.spawn)
        return _create_fakepg(store, rank, world_size, timeout)
    return RemoteProcessGroup(rank, world_size, timeout)


# -- stores -----------------------------------------------------------------------------------

class RemoteStore(dist.Store):
    """A handle on one of the world's stores, served by the proxy (a wait blocks the proxy
    through the scheduler, so a key nobody sets is a hang verdict, as in thread mode)."""

    def __init__(self, kind: str, *args: Any, timeout: datetime.timedelta | None = None,
                 _sid: int | None = None):
        super().__init__()
        if timeout is not None:
            self.set_timeout(timeout)
        self._sid = _sid if _sid is not None else _me().request("store_new", kind, args,
                                                               self.timeout.total_seconds())
        _STORES.append(self)  # C++ may hold only the C++ half; keep the Python half alive

    def _call(self, method: str, *args: Any) -> Any:
        return _me().request("store", self._sid, method, args, self.timeout.total_seconds())

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, value)

    def append(self, key, value):
        return self._call("append", key, value)

    def check(self, keys):
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None):
        return self._call("wait", list(keys), timeout)

    def compare_set(self, key, expected_value, desired_value):
        return self._call("compare_set", key, expected_value, desired_value)

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def list_keys(self):
        return self._call("list_keys")

    def multi_get(self, keys):
        return self._call("multi_get", list(keys))

    def multi_set(self, keys, values):
        return self._call("multi_set", list(keys), list(values))

    def has_extended_api(self):
        return True

    def queue_push(self, key, value):
        return self._call("queue_push", key, value)

    def queue_pop(self, key, block=True):
        return self._call("queue_pop", key, block)

    def queue_len(self, key):
        return self._call("queue_len", key)

    def clone(self):
        sid = _me().request("store_clone", self._sid)
        return RemoteStore("clone", timeout=self.timeout, _sid=sid)


_STORES: list[RemoteStore] = []


class _StoreClass:
    """Stands in for TCPStore/FileStore/HashStore in a rank process; isinstance accepts both."""

    def __init__(self, original: type, kind: str):
        self._original, self._kind = original, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.pop("timeout", None)
        if self._kind == "tcp":
            names = ("host_name", "port", "world_size", "is_master", "timeout")
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            timeout = bound.pop("timeout", timeout) or datetime.timedelta(seconds=300)
            return RemoteStore("tcp", bound.get("host_name", "127.0.0.1"), int(bound.get("port", 0)),
                               timeout=timeout)
        if self._kind == "file":
            return RemoteStore("file", *args[:1], *kwargs.values())
        return RemoteStore("hash")

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, (self._original, RemoteStore))

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, (self._original, RemoteStore))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


# -- torch.distributed's entry points in a rank process ------------------------------------------

def _init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                        store=None, group_name="", pg_options=None, device_id=None, **kwargs):
    from .sites import user_site

    me = _me()
    site = user_site()
    if world_size not in (-1, None) and int(world_size) != me.nprocs:
        raise ValueError(f"rank {me.rank}: init_process_group(world_size={world_size}) at {site}, "
                         f"but the fake cluster has {me.nprocs} ranks (nprocs={me.nprocs}); "
                         f"make them agree")
    if rank not in (-1, None) and int(rank) != me.rank:
        raise ValueError(f"rank {me.rank}: init_process_group(rank={rank}) at {site} in the "
                         f"process of rank {me.rank}")
    asked = backends.from_request(backend)
    if asked is not None:
        me.request("set_backend", asked)
    if c10d.is_initialized():
        default = c10d._get_default_group()
        if me.initialised_by_program is default:
            raise ValueError("trying to initialize the default process group twice!")
        me.initialised_by_program = default
        return None
    _start_world(timeout)
    me.initialised_by_program = c10d._get_default_group()
    return None


def _start_world(timeout: datetime.timedelta | None = None) -> None:
    me = _me()
    timeout = timeout or datetime.timedelta(minutes=30)
    _ORIGINAL_INIT(backend=BACKEND_NAME, rank=me.rank, world_size=me.nprocs,
                   store=RemoteStore("world", timeout=timeout), timeout=timeout)


@functools.wraps(_ORIGINAL_PG_HELPER)
def _pg_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
    asked = None if backend == BACKEND_NAME else backends.from_request(backend)
    with requested_backend(asked):
        return _ORIGINAL_PG_HELPER(group_size, group_rank, global_ranks_in_group, BACKEND_NAME,
                                   *args, **kwargs)


@functools.wraps(_ORIGINAL_GET_BACKEND)
def _get_backend(group=None):
    name = _ORIGINAL_GET_BACKEND(group)
    pg = c10d._get_default_group() if group is None else group
    return dist.Backend(pg.personality.name) if isinstance(pg, RemoteProcessGroup) else name


@functools.wraps(_ORIGINAL_MONITORED_BARRIER)
def _monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    args = monitored_barrier_arguments(group, timeout)
    if args is None:
        return None
    g, timeout = args
    return g._issue("monitored_barrier", (timeout, wait_all_ranks), {})


def _sleep(seconds: float) -> None:
    seconds = float(seconds)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _me().request("sleep", seconds)  # the other ranks run meanwhile (a real sleep would stall them)


def _settling(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def wrapper(futures):
        for f in futures:
            if isinstance(f, RemoteFuture):
                f.wait()
        return original(futures)

    return wrapper


def _set_num_threads(n: int) -> None:
    # A forked child must not start an OpenMP team (libgomp's pool does not survive fork):
    # the count is remembered and reported, the work runs on one thread.
    _me().num_threads = int(n)


def seed() -> int:
    """The seed of the world this rank process belongs to."""
    return _me().seed


def install(rank: int, nprocs: int, channel: Channel, seed: int = 0) -> contextlib.ExitStack:
    """Make this (freshly forked) process rank ``rank`` of the parent's world."""
    global _ME
    nested = _ME is not None  # forked from a rank process: a world that rank started
    _ME = _Rank(rank, nprocs, channel, seed)
    _ME.nested = nested
    _ME.num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stack = contextlib.ExitStack()
    patch = lambda obj, name, value: stack.enter_context(mock.patch.object(obj, name, value))  # noqa: E731
    plugin = dist.Backend._plugins[BACKEND_NAME.upper()]
    dist.Backend._plugins[BACKEND_NAME.upper()] = type(plugin)(_create_remote, plugin.extended_api)
    for mod in (dist, c10d):
        patch(mod, "init_process_group", _init_process_group)
        patch(mod, "monitored_barrier", _monitored_barrier)
        patch(mod, "get_backend", _get_backend)
    patch(c10d, "_new_process_group_helper", _pg_helper)
    if not hasattr(torch._C, "_nccl_version"):
        from torch.cuda import nccl
        patch(nccl, "version", lambda: (0, 0, 0))
    for name in ("wait_all", "collect_all"):
        patch(torch.futures, name, _settling(getattr(torch.futures, name)))
    patch(time, "sleep", _sleep)
    from . import mp_spawn
    mp_spawn.patch(stack, "process")
    patch(torch, "set_num_threads", _set_num_threads)
    patch(torch, "get_num_threads", lambda: _me().num_threads)
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    for mod in (dist, c10d, rendezvous):
        if mod is None:
            continue
        for name, kind in (("TCPStore", "tcp"), ("FileStore", "file"), ("HashStore", "hash")):
            if name in vars(mod):
                patch(mod, name, _StoreClass(vars(mod)[name], kind))
    return stack


def run(fn: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
    """Run the rank's function in an initialised world; (True, pickled return value) or
    (False, packed exception)."""
    import pickle

    me = _me()
    try:
        _start_world()
        value = fn(me.rank, *args)
        try:
            outcome: tuple[bool, Any] = (True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - an unpicklable return value fails the rank
            raise TypeError(f"rank {me.rank}'s return value cannot be sent back from its "
                            f"process (isolation='process'): {e}") from e
    except BaseException as e:  # noqa: BLE001 - every outcome goes back to the proxy
        outcome = (False, pack_exception(e))
    with contextlib.suppress(BaseException):
        if c10d.is_initialized():
            c10d.destroy_process_group()
    return outcome


__all__ = ["RemoteProcessGroup", "RemoteWork", "RemoteFuture", "RemoteStore", "child_rank",
           "install", "run"]
