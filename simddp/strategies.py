"""Hypothesis strategies for simddp: perturbed timings, for ``@given`` or :func:`simddp.explore`.

Needs ``hypothesis`` (the project's ``test`` extra); ``import simddp`` does not import this
module until ``simddp.strategies`` is first used.

    from hypothesis import given
    import simddp
    from simddp import Timing, strategies

    @given(strategies.timings(Timing(timeout=0.05), nprocs=4, max_slowdown=3.0))
    def test_no_timeout(timing):
        simddp.simulate(train, nprocs=4, timing=timing)

Every value is drawn on a grid of ``steps`` levels whose level 0 is the base timing, so
hypothesis shrinks each perturbation to "absent" and every remaining one to the smallest
level that still fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fakepg.arguments import integer, number

from . import faults as _faults
from .timing import Timing

try:
    from hypothesis import strategies as st
except ImportError as _e:  # pragma: no cover - hypothesis is a test extra
    raise ImportError("simddp.strategies and simddp.explore need hypothesis: "
                      "pip install hypothesis (or the project's 'test' extra)") from _e

__all__ = ["timings"]


def _grid(lo: float, hi: float, steps: int, k: int) -> float:
    return lo + (hi - lo) * k / steps


def timings(base: Timing, nprocs: int, *, max_slowdown: float = 4.0,
            max_jitter: float | None = 0.05, max_network_jitter: float | None = None,
            max_links: int = 2, max_link_slowdown: float = 4.0, horizon: float | None = None,
            steps: int = 16) -> Any:
    """A strategy of :class:`~simddp.Timing` s: ``base`` perturbed within these bounds.

    * each rank's ops up to ``max_slowdown`` times slower (``rank_speed`` divided by a factor
      in ``1 + (max_slowdown - 1)·k/steps``, k = 0..steps); with ``horizon`` (virtual
      seconds) a slowdown may start later, as a :func:`simddp.faults.slow_rank` from
      ``horizon·k/steps``;
    * per-op jitter between ``base.jitter`` and ``max_jitter`` (None: not perturbed), and
      network jitter between the base's and ``max_network_jitter`` (None: follows the
      per-op jitter), with a fresh noise seed when there is any jitter;
    * up to ``max_links`` links (two ranks, or one rank's NIC) up to ``max_link_slowdown``
      times slower (:func:`simddp.faults.slow_link`, from ``horizon·k/steps`` with
      ``horizon``).

    Level 0 of everything is ``base`` itself, which is also what hypothesis shrinks to.
    """
    if not isinstance(base, Timing):
        raise TypeError(f"simddp.strategies.timings: base must be a simddp.Timing, got "
                        f"{type(base).__name__}")
    what = "simddp.strategies.timings"
    nprocs = integer(f"{what}: nprocs", nprocs, minimum=1)
    steps = integer(f"{what}: steps", steps, minimum=1)
    max_slowdown = number(f"{what}: max_slowdown", max_slowdown, minimum=1.0)
    max_link_slowdown = number(f"{what}: max_link_slowdown", max_link_slowdown, minimum=1.0)
    max_links = integer(f"{what}: max_links", max_links, minimum=0)
    if horizon is not None:
        horizon = number(f"{what}: horizon", horizon, minimum=0.0, hint="virtual seconds")
    if max_jitter is not None:
        max_jitter = max(number(f"{what}: max_jitter", max_jitter, minimum=0.0), base.jitter)
    if max_network_jitter is not None:
        max_network_jitter = max(number(f"{what}: max_network_jitter", max_network_jitter,
                                        minimum=0.0), base.net_jitter)
    levels = st.integers(0, steps)

    def onset(draw: Any) -> float:
        return 0.0 if horizon is None else _grid(0.0, horizon, steps, draw(levels))

    @st.composite
    def draw_timing(draw: Any) -> Timing:
        speed = dict(base.rank_speed)
        faults = list(base.faults)
        if max_slowdown > 1.0:
            for r in range(nprocs):
                k = draw(levels)
                if k == 0:
                    continue
                factor = _grid(1.0, max_slowdown, steps, k)
                at = onset(draw)
                if at == 0.0:
                    speed[r] = base.speed(r) / factor
                else:
                    faults.append(_faults.slow_rank(r, factor, at=at))
        jitter = base.jitter
        if max_jitter is not None and max_jitter > base.jitter:
            jitter = _grid(base.jitter, max_jitter, steps, draw(levels))
        net = base.network_jitter
        if max_network_jitter is not None and max_network_jitter > base.net_jitter:
            k = draw(levels)
            net = None if k == 0 and net is None else \
                _grid(base.net_jitter, max_network_jitter, steps, k)
        seed = base.seed
        if jitter > 0 or (net or 0) > 0:
            k = draw(st.integers(0, 2 ** 16))
            seed = base.seed if k == 0 else k
        if max_links and nprocs >= 2 and max_link_slowdown > 1.0:
            # a link: (a, a + 1 + d mod n) between two ranks, or d = n - 1: a's NIC
            links = draw(st.lists(st.tuples(st.integers(0, nprocs - 1),
                                            st.integers(0, nprocs - 1), st.integers(1, steps)),
                                  max_size=max_links, unique_by=lambda x: x[:2]))
            for a, d, k in links:
                b = None if d == nprocs - 1 else (a + 1 + d) % nprocs
                faults.append(_faults.slow_link(a, b, _grid(1.0, max_link_slowdown, steps, k),
                                                at=onset(draw)))
        return dataclasses.replace(base, rank_speed=speed, jitter=jitter, network_jitter=net,
                                   seed=seed, faults=tuple(faults))

    return draw_timing()
