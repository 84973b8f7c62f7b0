"""Sweeps: replay a capture over a grid of knobs, one table row per combination."""

from __future__ import annotations

import itertools
from typing import Any

from ..analysis import write_csv
from .plan import CapturedIteration
from .run import replay

__all__ = ["sweep", "write_csv"]


def sweep(captured: CapturedIteration, **grids: Any) -> list[dict[str, Any]]:
    """Replay every combination of the knob lists in ``grids`` (any keyword of :func:`replay`,
    ``world_size`` included; a non-list value is one point) and return one row per
    combination (:meth:`ReplayResult.row` plus ``wall_time_s``), in ``itertools.product``
    order of the keywords as given.

    >>> rows = sweep(cap, world_size=[64, 512], comm_hook=[None, "fp16"])  # doctest: +SKIP
    """
    keys = list(grids)
    axes = [v if isinstance(v, (list, tuple, range)) else [v] for v in grids.values()]
    rows = []
    for combo in itertools.product(*axes):
        kw = dict(zip(keys, combo))
        res = replay(captured, **kw)
        rows.append({**res.row(), "wall_time_s": res.wall_time})
    return rows


