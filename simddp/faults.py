"""Timing faults from a virtual time: a rank that turns slow, a link that turns slow.

Put them in :attr:`simddp.Timing.faults` (or pass ``simulate(..., faults=[...])``)::

    from simddp import Timing, faults
    timing = Timing(faults=[faults.slow_rank(3, 4.0, at=0.5),          # rank 3: 4x slower from t=0.5 s
                            faults.slow_link(0, 1, 10.0, at=1.0, until=2.0)])

* :func:`slow_rank` multiplies the cost of every op the rank starts while the fault is active
  (``at <= rank's clock < until``; an op that straddles ``at`` keeps the cost it started with),
  on top of :attr:`Timing.rank_speed` — the same rule as a constant straggler, switched on at
  a virtual time. Collectives are not slowed (use :func:`slow_link`).
* :func:`slow_link` multiplies the duration of every collective (and point-to-point transfer)
  that runs over the link and starts while the fault is active. ``slow_link(a, b, ...)`` is
  the link between ranks ``a`` and ``b``: a collective of a group holding both runs over it
  (a ring or tree is paced by its slowest link); ``slow_link(a, None, ...)`` is rank ``a``'s
  NIC: every collective of a group of two or more that holds ``a``.

Overlapping faults multiply. Faults are plain frozen data: they compare, hash, and go into a
replay token (:meth:`simddp.Timing.token`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Union

from fakepg.arguments import integer, number

__all__ = ["SlowRank", "SlowLink", "Fault", "slow_rank", "slow_link"]


def _window(what: str, at: Any, until: Any) -> tuple[float, float]:
    at = number(f"{what}: at", at, minimum=0.0, hint="a virtual time in seconds")
    if until is None:
        return at, math.inf
    until = number(f"{what}: until", until, minimum=0.0, hint="a virtual time in seconds, or None")
    if until <= at:
        raise ValueError(f"{what}: until ({until!r}) must come after at ({at!r})")
    return at, until


def _factor(what: str, factor: Any) -> float:
    return number(f"{what}: factor", factor, positive=True,
                  hint="how many times longer things take, e.g. 2.0 for half speed")


@dataclass(frozen=True)
class SlowRank:
    """Rank ``rank``'s ops take ``factor`` times as long from virtual time ``at`` to ``until``."""

    rank: int
    factor: float
    at: float = 0.0
    until: float = math.inf

    def active(self, t: float) -> bool:
        return self.at <= t < self.until

    def describe(self) -> str:
        return f"rank {self.rank} {self.factor:g}x slower{_when(self.at, self.until)}"


@dataclass(frozen=True)
class SlowLink:
    """Collectives over the link between ranks ``a`` and ``b`` (``b=None``: every link of
    ``a``) take ``factor`` times as long when they start in ``[at, until)``."""

    a: int
    b: int | None
    factor: float
    at: float = 0.0
    until: float = math.inf

    def active(self, t: float) -> bool:
        return self.at <= t < self.until

    def covers(self, ranks: Any) -> bool:
        """Whether a collective among ``ranks`` (a set of global ranks) uses this link."""
        if self.b is None:
            return self.a in ranks and len(ranks) >= 2
        return self.a in ranks and self.b in ranks

    def describe(self) -> str:
        where = f"rank {self.a}'s links" if self.b is None else f"link {self.a}<->{self.b}"
        return f"{where} {self.factor:g}x slower{_when(self.at, self.until)}"


Fault = Union[SlowRank, SlowLink]


def _when(at: float, until: float) -> str:
    if at == 0.0 and until == math.inf:
        return ""
    if until == math.inf:
        return f" from t={at:g} s"
    return f" from t={at:g} s to t={until:g} s"


def slow_rank(rank: int, factor: float, *, at: float = 0.0, until: float | None = None) -> SlowRank:
    """Rank ``rank`` runs ``factor`` times slower from virtual time ``at`` (seconds) until
    ``until`` (None: to the end).

    >>> slow_rank(3, 4.0, at=0.5).describe()
    'rank 3 4x slower from t=0.5 s'
    """
    rank = integer("simddp.faults.slow_rank: rank", rank, minimum=0)
    lo, hi = _window("simddp.faults.slow_rank", at, until)
    return SlowRank(rank, _factor("simddp.faults.slow_rank", factor), lo, hi)


def slow_link(a: int, b: int | None, factor: float, *, at: float = 0.0,
              until: float | None = None) -> SlowLink:
    """The link between ranks ``a`` and ``b`` (``b=None``: rank ``a``'s NIC, all its links)
    is ``factor`` times slower for collectives that start from virtual time ``at`` until
    ``until``.

    >>> slow_link(0, 1, 10.0, at=1.0, until=2.0).describe()
    'link 0<->1 10x slower from t=1 s to t=2 s'
    """
    what = "simddp.faults.slow_link"
    a = integer(f"{what}: a", a, minimum=0)
    if b is not None:
        b = integer(f"{what}: b", b, minimum=0)
        if b == a:
            raise ValueError(f"{what}: a link joins two ranks, got a=b={a} (b=None slows all "
                             f"of rank {a}'s links)")
        a, b = min(a, b), max(a, b)
    lo, hi = _window(what, at, until)
    return SlowLink(a, b, _factor(what, factor), lo, hi)


def check(faults: Iterable[Any], nprocs: int | None = None) -> tuple[Fault, ...]:
    """``faults`` as a tuple, each a :class:`SlowRank` or :class:`SlowLink` naming ranks of the
    world (when ``nprocs`` is known)."""
    if isinstance(faults, (SlowRank, SlowLink)):
        faults = (faults,)
    try:
        out = tuple(faults)
    except TypeError:
        raise TypeError(f"Timing.faults must be a list of simddp.faults.slow_rank(...) / "
                        f"slow_link(...), got {faults!r}") from None
    for f in out:
        if not isinstance(f, (SlowRank, SlowLink)):
            raise TypeError(f"Timing.faults: {f!r} is not a fault; use "
                            f"simddp.faults.slow_rank(rank, factor, at=...) or "
                            f"simddp.faults.slow_link(a, b, factor, at=...)")
        if nprocs is not None:
            ranks = [f.rank] if isinstance(f, SlowRank) else [f.a] + ([] if f.b is None else [f.b])
            bad = [r for r in ranks if r >= nprocs]
            if bad:
                raise ValueError(f"Timing.faults: {f.describe()} names rank {bad[0]}, but the "
                                 f"world has ranks 0..{nprocs - 1} (nprocs={nprocs})")
    return out


def rank_slowdown(faults: Iterable[Fault], rank: int, t: float) -> tuple[float, float, float]:
    """``(factor, lo, hi)``: the product of ``rank``'s active slowdowns at virtual time ``t``,
    constant on ``[lo, hi)``."""
    factor, lo, hi = 1.0, -math.inf, math.inf
    for f in faults:
        if not isinstance(f, SlowRank) or f.rank != rank:
            continue
        for edge in (f.at, f.until):
            if edge <= t:
                lo = max(lo, edge)
            else:
                hi = min(hi, edge)
        if f.active(t):
            factor *= f.factor
    return factor, lo, hi


def link_slowdown(faults: Iterable[Fault], ranks: Any, t: float) -> float:
    """The product of the active link slowdowns a collective among ``ranks`` starting at
    ``t`` runs over."""
    factor = 1.0
    for f in faults:
        if isinstance(f, SlowLink) and f.active(t) and f.covers(ranks):
            factor *= f.factor
    return factor
