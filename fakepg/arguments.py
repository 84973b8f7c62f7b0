"""One way to check a public function's numeric arguments, with errors that say what to pass.

    from fakepg.arguments import integer, number
    nprocs = integer("fakepg.spawn: nprocs", nprocs, minimum=1)
    jitter = number("Timing.jitter", jitter, minimum=0, hint="e.g. 0.05 for 5 %")

Integers accept anything integral (``numpy.int64`` included) but never ``bool``; numbers must
be finite. Both return the plain Python value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["integer", "number"]


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
