"""Captures reused across commands: an on-disk cache keyed by everything a capture depends on.

A capture is a pure function of the workload (its model, batches, loss and optimizer), the
layout (the registry's :meth:`~simddp.program.parallel.Parallel.capture_key`), the
:class:`~simddp.program.registry.CaptureOptions`, the timing it ran under (compute and network
models), the seed and device — and of the code that captures it and the torch that runs it.
The key hashes all of those: the source of simddp, fakepg and the zoo (any edit is a new
key), torch's and Python's versions.

Entries live in ``$SIMDDP_CACHE_DIR``, else ``$XDG_CACHE_HOME/simddp``, else
``~/.cache/simddp``, one JSON file per capture (written to a temporary file, then renamed,
so a reader never sees half an entry). An entry that does not load (corrupt, truncated, from
an incompatible writer) is ignored with a note and written anew. ``SIMDDP_NO_CACHE=1`` (the
test suite sets it) or ``simddp whatif --no-cache`` bypasses the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Callable

__all__ = ["cache_dir", "capture_key", "cached", "enabled_by_default", "Unkeyable", "by_ref"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Unkeyable(Exception):
    """Something a capture depends on has no stable description (the capture is not
    cached)."""


def cache_dir() -> Path:
    """Where entries live: ``$SIMDDP_CACHE_DIR``, else ``$XDG_CACHE_HOME/simddp``, else
    ``~/.cache/simddp``."""
    if os.environ.get("SIMDDP_CACHE_DIR"):
        return Path(os.environ["SIMDDP_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "simddp"


def enabled_by_default() -> bool:
    """False when ``$SIMDDP_NO_CACHE`` is set to anything but 0/empty."""
    return os.environ.get("SIMDDP_NO_CACHE", "").strip() in ("", "0")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of the source that captures run (simddp, fakepg, the zoo) and the versions of
    torch and Python: a change to any of them is a new key. torch's version is read from its
    installed metadata, so computing a key imports no torch."""
    from importlib.metadata import version

    h = hashlib.sha256(f"{version('torch')}|{sys.version_info[:3]}".encode())
    roots = []
    # found, not imported, so a key is the same whatever the process loaded so far; the zoo
    # (models/) where it sits beside simddp (a checkout), not a `models` of the working directory
    for name in ("simddp", "fakepg", "models"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith("__init__.py"):
            root = Path(spec.origin).parent
            if name != "models" or root.parent == Path(__file__).resolve().parent.parent:
                roots.append(root)
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def stable(obj: Any, _path: tuple[int, ...] = ()) -> Any:
    """A JSON-able description of ``obj`` that is the same in every process for equal
    objects: functions by module, name, code and closure; partials, dataclasses and containers
    by their parts. Raises :class:`Unkeyable` for an object it cannot describe."""
    if len(_path) > 40:
        raise Unkeyable("nested too deep")
    if id(obj) in _path:  # a recursive function's closure names itself
        return ["cycle", _path.index(id(obj))]
    d = _path + (id(obj),)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [stable(v, d) for v in obj]]
    if isinstance(obj, (set, frozenset)):
        return ["set", sorted(json.dumps(stable(v, d), sort_keys=True) for v in obj)]
    if isinstance(obj, dict):
        return ["dict", sorted([json.dumps(stable(k, d)), stable(v, d)] for k, v in obj.items())]
    if isinstance(obj, functools.partial):
        return ["partial", stable(obj.func, d), stable(obj.args, d), stable(obj.keywords, d)]
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        cells = [c.cell_contents for c in obj.__closure__ or ()]
        return ["function", obj.__module__, obj.__qualname__,
                hashlib.sha256(code.co_code).hexdigest()[:16],
                stable([c for c in code.co_consts if not isinstance(c, types.CodeType)], d),
                stable(cells, d), stable(obj.__defaults__, d)]
    if isinstance(obj, (type, types.BuiltinFunctionType, types.ModuleType)):
        return ["named", getattr(obj, "__module__", ""), getattr(obj, "__qualname__",
                                                                 getattr(obj, "__name__", ""))]
    if dataclasses.is_dataclass(obj):
        return [type(obj).__module__, type(obj).__qualname__,
                {f.name: stable(getattr(obj, f.name), d) for f in dataclasses.fields(obj)}]
    text = repr(obj)
    if _ADDRESS.search(text) is None and type(obj).__repr__ is not object.__repr__:
        return [type(obj).__module__, type(obj).__qualname__, text]
    if hasattr(obj, "__dict__"):
        return [type(obj).__module__, type(obj).__qualname__, stable(vars(obj), d)]
    raise Unkeyable(f"{type(obj).__qualname__} has no stable description")


def capture_key(request: Any, layout_key: str) -> str:
    """The cache key of a :class:`~simddp.program.registry.CaptureRequest` (raises
    :class:`Unkeyable` when part of it cannot be described)."""
    parts = {"scenario": stable(request.scenario), "layout": layout_key,
             "options": stable(request.options), "timing": stable(request.timing),
             "device": request.device, "seed": request.seed, "code": code_version()}
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached(request: Any, layout_key: str, run: Callable[[], Any], *,
           enabled: bool = True, note: Callable[[str], None] = lambda text: None,
           ref: tuple[str, dict[str, Any]] | None = None) -> tuple[Any, bool]:
    """``run()``'s capture for ``request``, from the cache when an entry exists (then
    ``(capture, True)``), else run and stored (``(capture, False)``). ``note`` hears about a
    hit, an entry ignored and a capture that cannot be cached. ``ref``: (a key over the
    request as the user gave it, facts to keep beside it): remembered, so :func:`by_ref` finds
    the capture again without building the request."""
    from .program.captured import CaptureFileError, capture_from_dict

    if not enabled:
        return run(), False
    try:
        key = capture_key(request, layout_key)
    except Unkeyable as e:
        note(f"capture not cached ({e})")
        return run(), False
    path = cache_dir() / f"{key}.json"
    if path.exists():
        try:
            with open(path, encoding="utf-8") as f:
                cap = capture_from_dict(json.load(f))
            note(f"capture loaded from the cache ({path})")
            _remember(ref, key)
            return cap, True
        except (OSError, ValueError, CaptureFileError) as e:
            note(f"ignoring the cache entry {path}: {e}")
    cap = run()
    try:
        _write(path, cap.to_json())
        _remember(ref, key)
    except OSError as e:
        note(f"could not write the cache entry {path} ({e}); the capture is not cached")
    return cap, False


def by_ref(ref: str, *, note: Callable[[str], None] = lambda text: None
           ) -> tuple[Any, dict[str, Any]] | None:
    """The capture and the facts remembered under ``ref`` by :func:`cached` (None when there
    is none, or its entry does not load: the caller then captures through :func:`cached`,
    which notes and replaces a bad entry). Reads JSON only: no workload is built."""
    from .program.captured import CaptureFileError, capture_from_dict

    try:
        with open(cache_dir() / "refs" / f"{ref}.json", encoding="utf-8") as f:
            facts = json.load(f)
        path = cache_dir() / f"{facts.pop('key')}.json"
        with open(path, encoding="utf-8") as f:
            cap = capture_from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CaptureFileError):
        return None
    note(f"capture loaded from the cache ({path})")
    return cap, facts


def _remember(ref: tuple[str, dict[str, Any]] | None, key: str) -> None:
    if ref is not None:  # a shortcut only: one not written costs the next command its build
        with contextlib.suppress(OSError):
            _write(cache_dir() / "refs" / f"{ref[0]}.json", json.dumps({"key": key, **ref[1]}))


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` atomically (a temporary file in its directory, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
