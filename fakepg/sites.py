"""Find the source line that led to a collective: the user's, and the library's under it.

Every frame is one of three kinds, decided once per file name and cached:

- *glue*: torch (except ``torch/testing``, whose test bodies are user code), fakepg, packages
  registered with :func:`skip_package` (simddp), the standard library, ``<frozen ...>``
  modules and ``typing_extensions`` (torch's ``@deprecated`` wrapper lives there);
- *library*: anything else under a ``site-packages``/``dist-packages`` directory
  (Lightning, accelerate, ...);
- *user*: everything else.

The innermost non-glue frame *issued* the collective. If it is library code, the site also
names the innermost user frame outside it: ``train.py:12 (via lightning/fabric/ddp.py:88)``.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
from types import FrameType, TracebackType

import torch

_GLUE, _LIBRARY, _USER = 0, 1, 2

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_TESTING_DIR = _TORCH_DIR + "testing" + os.sep
FAKEPG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
STDLIB_DIRS = tuple({
    os.path.dirname(os.path.abspath(threading.__file__)) + os.sep,
    *(os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")),
})
_PACKAGE_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_extra_skip: list[str] = []
# co_filename -> kind. Keyed by the file name string: its hash is cached on the object, so
# a lookup per frame costs one dict probe (code objects hash by content, which is slower).
_kinds: dict[str, int] = {}


def skip_package(path: str) -> None:
    """Treat frames under ``path`` as library glue, like fakepg's own (simddp registers itself)."""
    _extra_skip.append(os.path.abspath(path) + os.sep)
    _kinds.clear()


def _classify(filename: str) -> int:
    if filename.startswith("<"):  # "<frozen runpy>" is glue; "<string>", "<stdin>" are user code
        return _GLUE if filename.startswith("<frozen") else _USER
    if filename.startswith(_TORCH_TESTING_DIR):
        return _USER
    if (filename.startswith((_TORCH_DIR, FAKEPG_DIR, *_extra_skip))
            or os.path.basename(filename) == "typing_extensions.py"):
        return _GLUE
    if any(d in filename for d in _PACKAGE_DIRS):
        return _LIBRARY  # checked before the stdlib: site-packages may live inside it
    if filename.startswith(STDLIB_DIRS):
        return _GLUE
    return _USER


def _kind(filename: str) -> int:
    kind = _kinds.get(filename)
    if kind is None:
        kind = _kinds[filename] = _classify(filename)
    return kind


def user_site(depth: int = 1, frame: FrameType | None = None) -> str:
    """Where the caller's collective came from: ``file:line`` of the user's frame, with
    ``(via lib/file.py:line)`` when an installed library issued it for the user. ``frame``:
    start there instead of ``depth`` frames up."""
    frame = sys._getframe(depth) if frame is None else frame
    start = frame
    kinds = _kinds
    while frame is not None:
        fn = frame.f_code.co_filename
        kind = kinds.get(fn)
        if kind is None:
            kind = _kind(fn)
        if kind == _USER:
            return f"{short_path(fn)}:{frame.f_lineno}"
        if kind == _LIBRARY:
            return _via_library(frame)
        frame = frame.f_back
    return f"{short_path(start.f_code.co_filename)}:{start.f_lineno}"


def _via_library(lib: FrameType) -> str:
    via = f"{_library_name(lib.f_code.co_filename)}:{lib.f_lineno}"
    frame = lib.f_back
    kinds = _kinds
    while frame is not None:
        fn = frame.f_code.co_filename
        kind = kinds.get(fn)
        if (kind if kind is not None else _kind(fn)) == _USER:
            return f"{short_path(fn)}:{frame.f_lineno} (via {via})"
        frame = frame.f_back
    return via  # launched from an installed tool: no user frame to name


@functools.lru_cache(maxsize=4096)
def _library_name(path: str) -> str:
    """``lightning/fabric/strategies/ddp.py`` for ``.../site-packages/lightning/...``."""
    cut = max(path.rfind(d) + len(d) if d in path else -1 for d in _PACKAGE_DIRS)
    return path[cut:] if cut > 0 else short_path(path)


@functools.lru_cache(maxsize=4096)
def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else as given."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path



def traceback_site(tb: TracebackType | None) -> str | None:
    """``file:line`` of the innermost user frame of a traceback, with ``(via lib/file.py:line)``
    when an installed library raised below it (as :func:`user_site` words it); None when every
    frame is glue: torch, fakepg, the standard library, ``typing_extensions``' ``@deprecated``."""
    user = library = None
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        kind = _kind(fn)
        if kind == _USER:
            user, library = f"{short_path(fn)}:{tb.tb_lineno}", None
        elif kind == _LIBRARY:
            library = f"{_library_name(fn)}:{tb.tb_lineno}"
        tb = tb.tb_next
    if user is None:
        return library
    return user if library is None else f"{user} (via {library})"
