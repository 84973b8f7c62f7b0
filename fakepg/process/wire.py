"""The pipe between a rank's process and its proxy thread (``isolation="process"``).

Messages are pickles over a Unix socket pair. Tensors never travel by value on the way to
the proxy: a rank's CPU tensor is moved into shared memory *in place* (its storage's data is
copied once into an anonymous, already-unlinked shm segment; every view and every C++ holder
of that storage, DDP's bucket views included, keeps working), the segment's file descriptor
is passed once per storage (SCM_RIGHTS), and from then on a tensor is named by
(storage id, dtype, shape, stride, offset). The proxy builds a tensor over the same pages, so
what the collective writes there is what the rank reads: no copy back.

On the way back (results, errors) plain pickles are used; a result tensor that is one of the
request's tensors is sent as a reference to it (``Ref(k)``), so the rank gets its own object.
Exceptions travel as (class, args, attributes), rebuilt without calling ``__init__`` (many
exception classes take arguments their ``args`` do not hold), with the sender's traceback
text attached.
"""

from __future__ import annotations

import ctypes
import functools
import io
import mmap
import os
import pickle
import socket
import traceback
import weakref
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..torch_private import c10d_C
from ..errors import FakePGError
from ..world.outcome import exception_site

# The c10d option structs (AllreduceOptions, ...) are pybind classes without pickling.
_OPTION_CLASSES = {name: getattr(c10d_C, name) for name in dir(c10d_C)
                   if name.endswith("Options") and not name.startswith("_")}
_OPTION_FIELDS: dict[str, tuple[str, ...]] = {}


def _option_fields(name: str) -> tuple[str, ...]:
    fields = _OPTION_FIELDS.get(name)
    if fields is None:
        probe = _OPTION_CLASSES[name]()
        fields = _OPTION_FIELDS[name] = tuple(
            a for a in dir(probe) if not a.startswith("_") and not callable(getattr(probe, a)))
    return fields


class Ref:
    """In a reply: the request's k-th tensor (the rank's own object)."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __reduce__(self):
        return (Ref, (self.k,))


class SparseRef(Ref):
    """In a reply: the request's k-th tensor, a sparse COO tensor, whose new contents (the
    collective changed its indices and values, maybe their number) travel by value."""

    __slots__ = ("value",)

    def __init__(self, k: int, value: torch.Tensor):
        super().__init__(k)
        self.value = value

    def __reduce__(self):
        return (SparseRef, (self.k, self.value))


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a rank's process (shown as its cause)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


# -- exceptions -----------------------------------------------------------------------------

def pack_exception(e: BaseException, with_site: bool = True) -> tuple:
    """(class, args, picklable attributes, traceback text, site) of ``e``. The proxy sends
    its errors without a site: the rank names its own line when it fails with one."""
    state = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:  # noqa: BLE001 - what does not pickle stays behind
            continue
        state[k] = v
    try:
        args = e.args
        pickle.dumps(args)
    except Exception:  # noqa: BLE001
        args = tuple(str(a) for a in e.args)
    cls: Any = type(e)
    try:
        pickle.loads(pickle.dumps(cls))
    except Exception:  # noqa: BLE001 - a local class: rebuilt as a RuntimeError with its name
        cls, args = ("unpicklable", f"{type(e).__module__}.{type(e).__qualname__}"), (str(e),)
    text = "".join(traceback.format_exception(e))
    site = (getattr(e, "_fakepg_site", None) or exception_site(e)) if with_site else None
    state.pop("_fakepg_site", None)
    return (cls, args, state, text, site)


class RankRaised(RuntimeError):
    """Stands for an exception whose class cannot be rebuilt in this process."""


def unpack_exception(packed: tuple) -> BaseException:
    cls, args, state, text, site = packed
    if isinstance(cls, tuple):
        e: BaseException = RankRaised(f"{cls[1]}: {args[0] if args else ''}")
    else:
        try:
            e = cls.__new__(cls, *args)
            e.args = args
            vars(e).update(state)
        except Exception:  # noqa: BLE001
            e = RankRaised(f"{cls.__name__}: {', '.join(map(str, args))}")
    if site is not None:
        e._fakepg_site = site  # type: ignore[attr-defined]
    e._fakepg_traceback = text  # type: ignore[attr-defined]
    return e


# -- the channel ----------------------------------------------------------------------------

class _RankPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, channel: "Channel"):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.channel = channel
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            k = self.index.get(id(obj))
            if k is None:
                k = self.index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
                return ("T", k, *self.channel.describe(obj, self))
            return ("T", k)
        name = type(obj).__name__
        if name in _OPTION_CLASSES and type(obj) is _OPTION_CLASSES[name]:
            return ("O", name, {f: getattr(obj, f) for f in _option_fields(name)})
        return None


class _ProxyUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, channel: "Channel"):
        super().__init__(file)
        self.channel = channel
        self.tensors: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "T":
            k = pid[1]
            if len(pid) == 2:
                return self.tensors[k]
            t = self.tensors[k] = self.channel.rebuild(pid[2:])
            return t
        if pid[0] == "O":
            opts = _OPTION_CLASSES[pid[1]]()
            for f, v in pid[2].items():
                setattr(opts, f, v)
            return opts
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


class Channel:
    """One end of a rank's pipe. The rank's end shares tensors; the proxy's end maps them."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._sock: socket.socket | None = None
        # rank side: storage key -> (storage id, weak ref); proxy side: storage id -> storage
        self._keys: dict[tuple[int, int], tuple[int, StorageWeakRef]] = {}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._next_sid = 0
        self._new: list[tuple[int, int, int]] = []  # (sid, fd, nbytes) to send with a message
        self._dropped: list[int] = []
        self._sends = 0

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(self.conn.fileno()))
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self.conn.close()

    # -- rank side ---------------------------------------------------------------------
    def describe(self, t: torch.Tensor, pickler: _RankPickler) -> tuple:
        """How the proxy finds ``t``: its storage id (shared first if new) and geometry."""
        if t.device.type != "cpu":
            raise FakePGError(f"isolation='process' moves CPU tensors only, got a tensor on "
                              f"{t.device}; use isolation='thread' for {t.device.type} tensors")
        if t.layout == torch.sparse_coo:
            # Its indices and values travel as dense tensors (this pickler shares them); the
            # proxy rebuilds the sparse tensor, and the reply brings its contents back.
            return ("S", t._indices(), t._values(), tuple(t.shape), t.is_coalesced())
        if t.layout != torch.strided:
            raise FakePGError(f"isolation='process' moves dense and sparse COO tensors only, "
                              f"got {t.layout}; use isolation='thread'")
        target = t
        try:
            sid = self._storage_id(t.untyped_storage())
        except RuntimeError:
            # A storage torch cannot move into shared memory (numpy's, from_blob): stage a
            # copy, and copy it back when the work completes.
            target = t.detach().clone()
            pickler.staged.append((t, target))
            sid = self._storage_id(target.untyped_storage())
        return (sid, target.dtype, tuple(target.shape), tuple(target.stride()),
                target.storage_offset())

    def _storage_id(self, storage: torch.UntypedStorage) -> int:
        if storage.nbytes() == 0:
            return -1
        key = (storage._cdata, storage.data_ptr())
        known = self._keys.get(key)
        if known is not None and not known[1].expired():
            return known[0]
        if known is not None:
            self._dropped.append(known[0])
        fd, nbytes = storage._share_fd_cpu_()  # in place: the data moves into shm once
        key = (storage._cdata, storage.data_ptr())  # the data pointer moved
        sid = self._next_sid
        self._next_sid += 1
        self._keys[key] = (sid, StorageWeakRef(storage))
        self._new.append((sid, fd, nbytes))
        return sid

    def _sweep(self) -> None:
        dead = [k for k, (_, ref) in self._keys.items() if ref.expired()]
        for k in dead:
            self._dropped.append(self._keys.pop(k)[0])

    def send_request(self, obj: Any) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Send ``obj`` (rank side); returns the tensors it named, in order, and staged copies."""
        buf = io.BytesIO()
        p = _RankPickler(buf, self)
        p.dump(obj)
        self._sends += 1
        if self._sends % 256 == 0:
            self._sweep()
        new, self._new = self._new, []
        dropped, self._dropped = self._dropped, []
        self.conn.send_bytes(pickle.dumps(([(s, n) for s, _, n in new], dropped, buf.getvalue()),
                                          protocol=pickle.HIGHEST_PROTOCOL))
        if new:
            reduction.sendfds(self._socket(), [fd for _, fd, _ in new])
        return p.tensors, p.staged

    def recv_reply(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    # -- proxy side --------------------------------------------------------------------
    def recv_request(self) -> tuple[Any, dict[int, torch.Tensor]]:
        """A request from the rank, and the tensors it named (k -> the proxy's view)."""
        new, dropped, payload = pickle.loads(self.conn.recv_bytes())
        if new:
            fds = reduction.recvfds(self._socket(), len(new))
            for (sid, nbytes), fd in zip(new, fds):
                try:
                    self._storages[sid] = _map_without_fd(fd, nbytes)
                finally:
                    os.close(fd)
        for sid in dropped:
            self._storages.pop(sid, None)
        u = _ProxyUnpickler(io.BytesIO(payload), self)
        obj = u.load()
        return obj, u.tensors

    def rebuild(self, desc: tuple) -> torch.Tensor:
        if desc[0] == "S":  # a sparse COO tensor over its (already rebuilt) indices and values
            _, indices, values, shape, coalesced = desc
            return torch.sparse_coo_tensor(indices.clone(), values.clone(), shape,
                                           is_coalesced=coalesced)
        sid, dtype, shape, stride, offset = desc
        if sid < 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.empty((0,), dtype=dtype)
        t.set_(self._storages[sid], offset, shape, stride)
        return t

    def send_reply(self, obj: Any) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping(ctypes.Array):  # type: ignore[misc]
    """Bytes of a shared-memory mapping; unmapped when the last tensor over them is gone."""

    _type_ = ctypes.c_uint8
    _length_ = 0


@functools.lru_cache(maxsize=256)
def _mapping_class(nbytes: int) -> type:
    return type("_Mapping", (_Mapping,), {"_length_": nbytes})


def _map_without_fd(fd: int, nbytes: int) -> torch.UntypedStorage:
    """The proxy's storage over a rank's shared segment, holding no file descriptor.

    torch's own ``_new_shared_fd_cpu`` keeps a duplicate of the descriptor per storage, so a
    program with thousands of live storages in collectives (1,000 async all-gathers with fresh
    outputs) ran this process out of descriptors ("recvfds": fewer than sent); a mapping
    outlives the descriptor it was made from."""
    addr = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a rank's shared tensor ({nbytes} bytes): {os.strerror(err)}")
    buf = _mapping_class(nbytes).from_address(addr)
    weakref.finalize(buf, _LIBC.munmap, addr, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


def encode(value: Any, index: dict[int, int]) -> Any:
    """``value`` with the request's tensors (``index``: id -> k) replaced by ``Ref(k)``."""
    if isinstance(value, torch.Tensor):
        k = index.get(id(value))
        if k is not None and value.layout == torch.sparse_coo:
            return SparseRef(k, value.detach().clone())
        return Ref(k) if k is not None else value.detach().clone()
    if isinstance(value, list):
        return [encode(v, index) for v in value]
    if isinstance(value, tuple):
        return tuple(encode(v, index) for v in value)
    return value


def decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, SparseRef):
        own = tensors[value.k]
        with torch.no_grad():
            own.copy_(value.value)  # the rank's own tensor gets the collective's result
        return own
    if isinstance(value, Ref):
        return tensors[value.k]
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v, tensors) for v in value)
    return value
