"""Find the user's source line that led to a collective."""

from __future__ import annotations

import functools
import os
import sys
import threading

import torch

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (torch, threading)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
_SKIP_FILES = ("contextlib.py", "functools.py", "threading.py", "<frozen")
_extra_skip: list[str] = []


def skip_package(path: str) -> None:
    """Treat frames under ``path`` as library code (simddp registers itself)."""
    _extra_skip.append(os.path.abspath(path) + os.sep)


def user_site(depth: int = 1) -> str:
    """``file:line`` of the innermost frame outside torch, fakepg and the stdlib glue."""
    frame = sys._getframe(depth)
    fallback = None
    while frame is not None:
        fn = frame.f_code.co_filename
        if fallback is None:
            fallback = frame
        if not (
            fn.startswith(_SKIP_DIRS)
            or any(fn.startswith(p) for p in _extra_skip)
            or fn.endswith(_SKIP_FILES)
            or fn.startswith("<frozen")
        ):
            return f"{_short(fn)}:{frame.f_lineno}"
        frame = frame.f_back
    if fallback is None:
        return "<unknown>"
    return f"{_short(fallback.f_code.co_filename)}:{fallback.f_lineno}"


@functools.lru_cache(maxsize=4096)
def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path
