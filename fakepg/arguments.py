"""One way to check a public function's arguments, with errors that say what to pass.

    from fakepg.arguments import function, integer, number, of_type
    nprocs = integer("fakepg.spawn: nprocs", nprocs, minimum=1)
    jitter = number("Timing.jitter", jitter, minimum=0, hint="e.g. 0.05 for 5 %")
    of_type("fakepg.spawn: hooks", hooks, WorldHooks, "a fakepg.WorldHooks or None")
    function("fakepg.explore: check", check, what="a function of the SpawnResult")

Integers accept anything integral (``numpy.int64`` included) but never ``bool``; numbers must
be finite. Both return the plain Python value. A wrong kind of value is a ``TypeError``, a
value out of range a ``ValueError``; each names the argument, what it got and what is accepted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["integer", "number", "of_type", "function"]


def _fail(name: str, what: str, value: Any, hint: str) -> ValueError:
    tail = f"; {hint}" if hint else ""
    return ValueError(f"{name} must be {what}, got {value!r}{tail}")


def integer(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
    """``value`` as an ``int`` (numpy integers too, never bool), at least ``minimum``."""
    what = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, what, value, hint)
    value = int(value)
    if minimum is not None and value < minimum:
        raise _fail(name, what, value, hint)
    return value


def number(name: str, value: Any, *, minimum: float | None = None, positive: bool = False,
           hint: str = "") -> float:
    """``value`` as a finite ``float``, >= ``minimum`` (> 0 with ``positive``)."""
    bound = " > 0" if positive else ("" if minimum is None else f" >= {minimum:g}")
    what = f"a finite number{bound}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, what, value, hint)
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0) \
            or (minimum is not None and value < minimum):
        raise _fail(name, what, value, hint)
    return value


def of_type(name: str, value: Any, accepted: type | tuple[type, ...], what: str, *,
            hint: str = "") -> Any:
    """``value`` itself when it is an instance of ``accepted`` (a ``TypeError`` naming
    ``what`` is accepted otherwise)."""
    if not isinstance(value, accepted):
        tail = f"; {hint}" if hint else ""
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}{tail}")
    return value


def function(name: str, value: Any, *, what: str = "a function", hint: str = "") -> Any:
    """``value`` when it is callable (a ``TypeError`` naming ``what`` otherwise)."""
    if not callable(value):
        tail = f"; {hint}" if hint else ""
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}{tail}")
    return value
