"""In-process c10d stores whose blocking calls pass the baton.

A real multi-process job shares a key-value store (TCPStore on MASTER_ADDR:MASTER_PORT, a
FileStore on one path) and waits on it inside C++, where fakepg could not see a hang. Here
every such store is a :class:`FakeStore` handle over shared, in-process data: a ``get`` of a
missing key, ``wait``, ``multi_get`` or a blocking ``queue_pop`` block the calling rank
through the scheduler, so a key nobody will ever set is an immediate hang verdict naming the
key and the waiting ranks, and a wait outliving the store's timeout (while another rank
still runs) raises :class:`~fakepg.errors.StoreTimeoutError`, a ``DistStoreError`` worded
as the real store words it.

While a world runs, ``TCPStore``/``FileStore``/``HashStore`` constructed on a rank thread
resolve here: TCPStore on the world's master port is the world's default store, others are
shared per address or per path; a HashStore stays private to its rank, as it is per process.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import os
import threading
import weakref
import sys
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as dist

from ..errors import NativeWaitError, StoreTimeoutError

_ACTIVE: "WorldStores | None" = None  # the running world's stores (one world at a time)
_private = itertools.count()


class _Data:
    """The shared contents of one logical store."""

    def __init__(self, name: str):
        self.name = name
        self.kv: dict[str, bytes] = {}
        self.queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # bytearray, list of ints (as pybind accepts)


def _expired_message(flavour: str, op: str, keys: Sequence[str], seconds: float) -> str:
    """The store's own words for a timed-out wait (captured from torch 2.13)."""
    ms = int(seconds * 1000)
    if flavour == "tcp":
        return f"wait timeout after {ms}ms, keys: " + ", ".join("/" + k for k in keys)
    if flavour == "file" and op == "get":
        return f"Timeout waiting for key: {keys[0]} after {ms} ms"
    return "Wait timeout"  # HashStore; FileStore.wait


class FakeStore(dist.Store):
    """One handle on an in-process store (each handle has its own timeout, like torch's)."""

    def __init__(self, data: _Data, flavour: str = "tcp",
                 timeout: datetime.timedelta | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__()
        self._data, self._flavour = data, flavour
        self.host, self.port = host, port
        if timeout is not None:
            self.set_timeout(timeout)
        if _ACTIVE is not None:
            # C++ (c10d's PrefixStore, the process group) may hold only the C++ half of this
            # object; its Python half must live as long as the world, or calls reach no method.
            _ACTIVE.handles.append(self)

    def __repr__(self) -> str:
        return f"<fakepg.FakeStore {self._data.name}>"

    # -- blocking, through the scheduler ----------------------------------------------
    def _block(self, op: str, keys: Sequence[str], ready: Callable[[], bool],
               timeout: datetime.timedelta | None = None) -> None:
        if ready():
            return
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        from ..world.binding import current_cluster
        from ..world.liveness import TimedWait
        binding = current_cluster()
        if binding is None:  # outside a world nobody else can set it: time out now
            raise StoreTimeoutError(_expired_message(self._flavour, op, keys, seconds),
                                    f"fakepg: {op} of {list(keys)} on {self._data.name} outside "
                                    f"a running world; no rank can set it", expired=True)
        cluster, rank = binding
        timed = None
        if seconds > 0:  # c10d: a zero timeout means no timeout
            timed = TimedWait(cluster.scheduler, rank, seconds,
                              lambda: _expired_message(self._flavour, op, keys, seconds),
                              StoreTimeoutError)
        missing = lambda: [k for k in keys if k not in self._data.kv]  # noqa: E731
        cluster.scheduler.block(
            rank, ready,
            lambda: f"store {op} on {self._data.name}: key(s) {missing() or list(keys)} "
                    f"that no rank has set", timed)

    def _yield(self) -> None:
        """A poll that found nothing: let the others run once (a real poll runs beside them)."""
        from ..world.binding import current_cluster
        binding = current_cluster()
        if binding is not None:
            binding[0].scheduler.sleep(binding[1], 0.0)

    def _preempt(self) -> None:
        """Another process could have reached the store first: a schedule's choice."""
        from ..world.binding import current_cluster
        binding = current_cluster()
        if binding is not None:
            binding[0].scheduler.preempt(binding[1])

    # -- the Store API -------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._preempt()
        self._data.kv[key] = _bytes(value)

    def get(self, key: str) -> bytes:
        self._preempt()
        self._block("get", [key], lambda: key in self._data.kv)
        return self._data.kv[key]

    def add(self, key: str, value: int) -> int:
        self._preempt()
        new = int(self._data.kv.get(key, b"0")) + int(value)
        self._data.kv[key] = str(new).encode()
        if int(value) == 0:
            self._yield()  # add(key, 0) is how counters are polled
        return new

    def append(self, key: str, value: Any) -> None:
        self._data.kv[key] = self._data.kv.get(key, b"") + _bytes(value)

    def check(self, keys: list[str]) -> bool:
        found = all(k in self._data.kv for k in keys)
        if not found:
            self._yield()
        return found

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        keys = list(keys)
        self._block("wait", keys, lambda: all(k in self._data.kv for k in keys), timeout)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        self._preempt()
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        current = self._data.kv.get(key)
        if current is None:
            if expected:  # as TCPStore: a missing key only matches an empty expected value
                self._yield()
                return expected
            self._data.kv[key] = desired
            return desired
        if current == expected:
            self._data.kv[key] = desired
            return desired
        self._yield()  # a lost compare-and-set is usually retried in a loop
        return current

    def delete_key(self, key: str) -> bool:
        return self._data.kv.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._data.kv)

    def list_keys(self) -> list[str]:
        return list(self._data.kv)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = list(keys)
        self._block("multi_get", keys, lambda: all(k in self._data.kv for k in keys))
        return [self._data.kv[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            self._data.kv[k] = _bytes(v)

    def has_extended_api(self) -> bool:
        return True

    def queue_push(self, key: str, value: Any) -> None:
        self._data.queues[key].append(_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        q = self._data.queues[key]
        if not q and not block:
            raise dist.QueueEmptyError("queue is empty")
        self._block("queue_pop", [key], lambda: bool(q))
        return q.popleft()

    def queue_len(self, key: str) -> int:
        return len(self._data.queues[key])

    def clone(self) -> "FakeStore":
        return FakeStore(self._data, self._flavour, self.timeout, self.host, self.port)


class WorldStores:
    """The stores of one world: the default one and those its ranks construct."""

    def __init__(self, master_addr: str, master_port: int):
        self.master_addr, self.master_port = master_addr, master_port
        self.default = _Data(f"the world store (TCPStore {master_addr}:{master_port})")
        self._shared: dict[tuple[str, Any], _Data] = {}
        self.handles: list[FakeStore] = []

    def world_store(self, timeout: datetime.timedelta | None = None) -> FakeStore:
        return FakeStore(self.default, "tcp", timeout, self.master_addr, self.master_port)

    def tcp(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
            timeout: datetime.timedelta = datetime.timedelta(seconds=300), *args: Any,
            **kwargs: Any) -> FakeStore:
        if int(port) == self.master_port:
            data = self.default
        elif int(port) == 0:  # the server would pick a free port: a store of its own
            data = _Data(f"TCPStore {host_name}:0 #{next(_private)}")
        else:
            data = self._shared.setdefault(("tcp", int(port)), _Data(f"TCPStore {host_name}:{port}"))
        return FakeStore(data, "tcp", timeout, host_name, int(port))

    def file(self, file_name: str, world_size: int = -1) -> FakeStore:
        path = os.path.abspath(os.fspath(file_name))
        data = self._shared.setdefault(("file", path), _Data(f"FileStore {path}"))
        return FakeStore(data, "file")

    def hash(self) -> FakeStore:
        return FakeStore(_Data(f"HashStore #{next(_private)} (private to its rank)"), "hash")


def active_stores() -> WorldStores:
    """The running world's stores."""
    assert _ACTIVE is not None, "no fake world is running"
    return _ACTIVE


def world_store(timeout: datetime.timedelta | None = None) -> FakeStore:
    """A new handle on the running world's default store."""
    return active_stores().world_store(timeout)


class _Constructor:
    """Stands in for a store class: on a rank thread of a running world it builds a
    :class:`FakeStore`, elsewhere the real store; ``isinstance`` accepts both."""

    def __init__(self, original: type, make: Callable[["WorldStores"], Callable[..., FakeStore]]):
        self._original, self._make = original, make

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ..world.binding import current_cluster
        if _ACTIVE is None:
            return self._original(*args, **kwargs)
        if current_cluster() is None:  # a thread the program started (torchft's quorum thread)
            _HELPER_CALL.active = True  # for the refusal's message: the class is the patched one
            try:
                return self._original(*args, **kwargs)
            finally:
                _HELPER_CALL.active = False
        return self._make(_ACTIVE)(*args, **kwargs)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, (self._original, FakeStore))

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, (self._original, FakeStore))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


_HELPER_CALL = threading.local()  # .active: inside _Constructor on a thread that is no rank
_MAKERS = {"TCPStore": lambda w: w.tcp, "FileStore": lambda w: w.file, "HashStore": lambda w: w.hash}


@contextlib.contextmanager
def world_stores(master_addr: str, master_port: int) -> Iterator[WorldStores]:
    """Make this world's stores the ones rank threads get; restore torch's afterwards."""
    global _ACTIVE
    stores = WorldStores(master_addr, master_port)
    modules = [dist, sys.modules["torch.distributed.distributed_c10d"],
               sys.modules.get("torch.distributed.rendezvous")]
    saved = [(m, name, m.__dict__[name]) for m in modules if m is not None
             for name in _MAKERS if name in m.__dict__]
    for m, name, original in saved:
        setattr(m, name, _Constructor(original, _MAKERS[name]))
    outer, _ACTIVE = _ACTIVE, stores  # a world nested in a rank (torch.multiprocessing.spawn)
    try:
        yield stores
    finally:
        _ACTIVE = outer
        for m, name, original in saved:
            setattr(m, name, original)


# -- native clients of the world's store ---------------------------------------------------
_NATIVE_TCPSTORE = dist.TCPStore  # torch's C++ class (the module attribute is patched in worlds)
_TRUE_INIT = _NATIVE_TCPSTORE.__init__
# Threads started in worlds that have ended, still running, with the world addresses they may
# not reach natively. One wrapper of torch's __init__ serves them all: a wrapper per world
# would nest without bound over a long test session.
_ENDED: list[tuple[Any, frozenset]] = []


def _address(args: tuple, kwargs: dict) -> tuple[str, str]:
    host = kwargs.get("host_name", args[0] if args else None)
    port = kwargs.get("port", args[1] if len(args) > 1 else None)
    return str(host), str(port)


def _after_worlds_init(store: Any, *args: Any, **kwargs: Any) -> None:
    if _ENDED:
        _ENDED[:] = [(threads, addresses) for threads, addresses in _ENDED if len(threads)]
        me, address = threading.current_thread(), _address(args, kwargs)
        is_master = kwargs.get("is_master", args[3] if len(args) > 3 else False)
        if not is_master and any(me in threads and address in addresses for threads, addresses in _ENDED):
            raise NativeWaitError(
                f"a thread started in the ended fake world builds torch's native TCPStore "
                f"client for {address[0]}:{address[1]}, that world's store, which is gone")
    _TRUE_INIT(store, *args, **kwargs)


class native_store_guard:
    """While a world runs, a rank that builds torch's *native* TCPStore client for the world's
    own address (MASTER_ADDR:MASTER_PORT) -- through a reference to the class taken before the
    world started, which the patched module attributes do not reach -- fails at once, saying
    why, instead of retrying inside C++ until its timeout. (A class, not a generator: a rank
    process drops the ExitStack it is entered on, and a collected generator would undo it.)"""

    def __init__(self, on_rank: Callable[[], bool],
                 on_helper_refusal: Callable[[BaseException], None] | None = None,
                 world: tuple[str, str] | None = None) -> None:
        self._on_rank = on_rank
        self._on_helper_refusal = on_helper_refusal
        self._original = _NATIVE_TCPSTORE.__init__
        self._world = world  # (MASTER_ADDR, MASTER_PORT), refused to its threads after it too

    def __enter__(self) -> None:
        original, on_rank, on_helper = self._original, self._on_rank, self._on_helper_refusal

        self._threads_before = set(threading.enumerate())
        self._refused: list[tuple[str, str]] = []

        def __init__(store: Any, *args: Any, **kwargs: Any) -> None:
            if on_rank():
                try:
                    _refuse_native_client(args, kwargs)
                except NativeWaitError as e:
                    from ..world.binding import current_cluster
                    self._refused.append(e.address)  # type: ignore[attr-defined]
                    if on_helper is not None and current_cluster() is None:
                        # A thread the program started (torchft's quorum thread): the program
                        # may catch the error and go on down a path torchrun never takes (torchft
                        # then fails with an AttributeError of its own). End the world with it.
                        on_helper(e)
                    raise
            original(store, *args, **kwargs)

        _NATIVE_TCPSTORE.__init__ = __init__

    def __exit__(self, *exc: Any) -> None:
        _NATIVE_TCPSTORE.__init__ = self._original
        # A thread the ranks started outlives the world (another rank's quorum thread, not yet
        # at its store when the world ended, by a refusal or a verdict): its native client of
        # the ended world's address would retry inside C++ until its timeout and hold the
        # process's exit. Refuse it too: only threads started during the world, still running.
        addresses = frozenset(self._refused) | ({self._world} if self._world else frozenset())
        leftover = weakref.WeakSet(set(threading.enumerate()) - self._threads_before)
        if addresses and len(leftover):
            _ENDED.append((leftover, addresses))
        if _ENDED and _NATIVE_TCPSTORE.__init__ is _TRUE_INIT:  # (an outer world's stays)
            _NATIVE_TCPSTORE.__init__ = _after_worlds_init


def _refuse_native_client(args: tuple, kwargs: dict) -> None:
    from ..sites import user_site

    host = kwargs.get("host_name", args[0] if args else None)
    port = kwargs.get("port", args[1] if len(args) > 1 else None)
    is_master = kwargs.get("is_master", args[3] if len(args) > 3 else False)
    world = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    if is_master or host is None or (str(host), str(port)) != world:
        return  # a store of the program's own (a server it runs, another address)
    rank = os.environ.get("RANK", "?")
    if getattr(_HELPER_CALL, "active", False):
        raise _with_address(NativeWaitError(
            f"rank {rank}: {user_site(3)} builds a TCPStore client for {host}:{port}, the fake "
            f"world's store (MASTER_ADDR:MASTER_PORT), on a thread the program started, not on "
            f"the rank's own thread. In thread mode only rank threads reach the world's store "
            f"(it lives inside fakepg, not on a socket); torch's native client would retry "
            f"inside C++ until its timeout. Run the ranks as processes (fakerun --isolation "
            f"process, or fakepg.spawn(..., isolation='process')), where every thread of a "
            f"rank's process reaches the world's store, or run it under torchrun with real "
            f"gloo."), (str(host), str(port)))
    raise _with_address(NativeWaitError(

        f"rank {rank}: {user_site(3)} builds torch's native TCPStore client for {host}:{port}, "
        f"the fake world's store (MASTER_ADDR:MASTER_PORT), through a reference to the class "
        f"taken before the world started (such as `from torch.distributed import TCPStore` at "
        f"import). That store lives inside fakepg, not on a socket: the native client would "
        f"retry inside C++ until its timeout, and code that waits inside native code (C++, "
        f"Rust: a TCPStore client, torchft's quorum over gRPC) cannot be seen or served by the "
        f"fake world, in thread mode and with --isolation process alike. Look the class up "
        f"at call time (torch.distributed.TCPStore), or run this program under torchrun with "
        f"real gloo."), (str(host), str(port)))


def _with_address(e: NativeWaitError, address: tuple[str, str]) -> NativeWaitError:
    e.address = address  # type: ignore[attr-defined]
    rank = os.environ.get("RANK", "")
    e.rank = int(rank) if rank.isdigit() else None  # type: ignore[attr-defined]
    return e
