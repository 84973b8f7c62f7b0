"""Fast snapshots of Python's and numpy's global Mersenne Twister, for per-rank swapping.

``random.getstate()``/``numpy.random.get_state()`` build a 625-element tuple or array each
call (~20-200 µs for a save and an install); ranks hand the baton over several times per DDP
iteration, so that cost would dominate a fake world. Both generators keep their state in one
flat C struct (index + 624 words), so a snapshot here is a 2.5 KB byte copy of it (~1 µs).
The layouts are checked against the slow API at import; where they do not match (another
Python or numpy build), the slow API is used instead, with identical results.

Numpy's legacy ``RandomState`` also caches the second Box-Muller normal (``has_gauss``)
outside the bit generator; whenever that cache is in play the slow API is used.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any, NamedTuple

_MT_WORDS = 624
_PY_HEAD = object.__basicsize__  # PyObject_HEAD; then `int index; uint32_t state[624]`
_PY_SIZE = 4 + 4 * _MT_WORDS


def _py_address(gen: random.Random) -> int:
    return id(gen) + _PY_HEAD


def _python_layout_ok() -> bool:
    probe = random.Random(12345)
    probe.random()
    raw = ctypes.string_at(_py_address(probe), _PY_SIZE)
    index, *words = struct.unpack(f"i{_MT_WORDS}I", raw)
    version, state, _ = probe.getstate()
    return version == 3 and tuple(words) == state[:-1] and index == state[-1]


_PY_FAST = _python_layout_ok()


class PyRNG(NamedTuple):
    raw: Any  # bytes (fast path) or random.getstate()'s tuple
    gauss_next: float | None = None


def python_state(gen: random.Random | None = None) -> PyRNG:
    """A snapshot of ``gen`` (default: the module-level generator ``random`` uses)."""
    gen = random._inst if gen is None else gen  # type: ignore[attr-defined]
    if _PY_FAST:
        return PyRNG(ctypes.string_at(_py_address(gen), _PY_SIZE), gen.gauss_next)
    return PyRNG(gen.getstate())


def set_python_state(snap: PyRNG) -> None:
    gen = random._inst  # type: ignore[attr-defined]
    if isinstance(snap.raw, bytes):
        ctypes.memmove(_py_address(gen), snap.raw, _PY_SIZE)
        gen.gauss_next = snap.gauss_next
    else:
        gen.setstate(snap.raw)


# -- numpy ---------------------------------------------------------------------------------
_NP_SIZE = 4 * _MT_WORDS + 4  # mt19937_state: uint32_t key[624]; int pos


class NumpyRNG(NamedTuple):
    raw: bytes | None  # the bit generator's state struct (None: slow path)
    full: Any = None  # numpy.random.get_state()'s tuple when the gauss cache matters
    has_gauss: bool = False


_np_fast: bool | None = None
_np_live_gauss = False  # whether the live RandomState may hold a cached normal


def _np_address(rs: Any) -> int:
    return rs._bit_generator.ctypes.state_address


def _numpy_layout_ok(np: Any) -> bool:
    try:
        probe = np.random.RandomState(12345)
        probe.random_sample(3)
        raw = ctypes.string_at(_np_address(probe), _NP_SIZE)
        _, key, pos, _, _ = probe.get_state()
        return raw[:-4] == key.astype("<u4").tobytes() and struct.unpack("i", raw[-4:])[0] == pos
    except Exception:  # noqa: BLE001 - any surprise means: use the slow API
        return False


def _numpy() -> Any:
    global _np_fast
    np = sys.modules.get("numpy")
    if np is not None and _np_fast is None:
        _np_fast = _numpy_layout_ok(np)
    return np


def numpy_seeded(seed: int) -> NumpyRNG | None:
    """The state of a fresh ``RandomState(seed)`` (None when numpy is not imported)."""
    np = _numpy()
    if np is None:
        return None
    rs = np.random.RandomState(seed)
    if _np_fast:
        return NumpyRNG(ctypes.string_at(_np_address(rs), _NP_SIZE))
    return NumpyRNG(None, rs.get_state())


def numpy_state(prev: NumpyRNG | None) -> NumpyRNG | None:
    """A snapshot of numpy's global generator; ``prev`` (this owner's last snapshot) is
    returned as is when the generator has not moved since."""
    global _np_live_gauss
    np = _numpy()
    if np is None:
        return None
    if not _np_fast:
        return NumpyRNG(None, np.random.get_state())
    raw = ctypes.string_at(_np_address(np.random.mtrand._rand), _NP_SIZE)
    # A cached normal is consumed without moving the bit generator: then only the slow API knows.
    if prev is not None and raw == prev.raw and not prev.has_gauss and not _np_live_gauss:
        return prev
    full = np.random.get_state()
    _np_live_gauss = bool(full[3])
    return NumpyRNG(raw, full, _np_live_gauss)


def set_numpy_state(snap: NumpyRNG | None) -> None:
    global _np_live_gauss
    np = _numpy()
    if np is None or snap is None:
        return
    if snap.raw is None or snap.has_gauss or _np_live_gauss:
        full = snap.full
        if full is None:  # a fast snapshot without the gauss cache: rebuild the tuple
            key = np.frombuffer(snap.raw[:-4], dtype="<u4")
            full = ("MT19937", key, struct.unpack("i", snap.raw[-4:])[0], 0, 0.0)
        np.random.set_state(full)
        _np_live_gauss = bool(full[3])
        return
    ctypes.memmove(_np_address(np.random.mtrand._rand), snap.raw, _NP_SIZE)
