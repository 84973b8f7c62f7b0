"""A rank process's stores: handles on the world's stores, which its proxy serves.

A wait blocks the proxy through the scheduler, so a key nobody sets is a hang verdict, as in
thread mode. :class:`StoreClass` stands in for ``TCPStore``/``FileStore``/``HashStore``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from . import rank as _rank


class RemoteStore(dist.Store):
    """A handle on one of the world's stores, served by the proxy (a wait blocks the proxy
    through the scheduler, so a key nobody sets is a hang verdict, as in thread mode)."""

    def __init__(self, kind: str, *args: Any, timeout: datetime.timedelta | None = None,
                 _sid: int | None = None):
        super().__init__()
        if timeout is not None:
            self.set_timeout(timeout)
        if _sid is None:
            _sid = _rank.me().request("store_new", kind, args, self.timeout.total_seconds())
        self._sid = _sid
        _STORES.append(self)  # C++ may hold only the C++ half; keep the Python half alive

    def _call(self, method: str, *args: Any) -> Any:
        return _rank.me().request("store", self._sid, method, args, self.timeout.total_seconds())

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
        sid = _rank.me().request("store_clone", self._sid)
        return RemoteStore("clone", timeout=self.timeout, _sid=sid)


_STORES: list[RemoteStore] = []


class StoreClass:
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
