"""A network model read from measurements: what the collectives cost on *this* machine.

``simddp calibrate`` (or :func:`simddp.measure.measure`) times each op × message size ×
world size nccl-tests style on the backend at hand; :class:`MeasuredNetwork` answers
``collective_time`` from those rows. Between two measured sizes the time is interpolated
linearly in log(size) — protocol and algorithm switches (gloo's, NCCL's) make one α–β line miss
its own points by ±90 %, a piecewise table follows them. Outside the table:

* below the smallest size: that size's time (the latency floor);
* above the largest: the last point plus the extra bytes at the bandwidth of the last segment;
* an op never measured: the table of an op with the same cost kind
  (:func:`fakepg.ops.cost_kind`), else of one whose flat formula is the same (all_gather,
  reduce_scatter, all_to_all, gather, scatter; broadcast, reduce), else the α–β fit of all_reduce
  (:meth:`Network.calibrate`);
* a world size never measured: the nearest measured one, scaled by the α–β ratio
  ``fit(n) / fit(n_measured)`` so the latency and bandwidth terms grow as the model says.

>>> rows = [{"op": "all_reduce", "world_size": 2, "bytes": b, "seconds": s}
...         for b, s in [(1 << 10, 100e-6), (1 << 20, 1e-3), (1 << 22, 8e-3)]]
>>> net = MeasuredNetwork(rows)
>>> net.collective_time("all_reduce", 1 << 20, 2)           # a measured point, as measured
0.001
>>> round(net.collective_time("all_reduce", 1 << 21, 2), 6)  # halfway in log-size
0.0045
"""

from __future__ import annotations

import bisect
import json
import math
import os
from typing import Any, Iterable, Mapping

from fakepg import ops
from fakepg.arguments import integer, number

from .contention import Contention, as_contention
from .network import Network

__all__ = ["MeasuredNetwork"]

# cost kinds whose flat formulas in simddp.models.network agree (same steps and byte factor):
# a table measured for one stands in for the others
_FAMILIES = ({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"},
             {"broadcast", "reduce"}, {"all_reduce", "barrier"}, {"p2p"})


def _family(kind: str) -> set[str]:
    return next(f for f in _FAMILIES if kind in f)


class MeasuredNetwork:
    """Collective times interpolated from ``(op, world_size, bytes, seconds)`` rows.

    rows: mappings with those keys (``simddp calibrate --json`` writes them under
        ``"measurements"``; :meth:`load` reads such a file). ``bytes`` follows
        :class:`simddp.Network`'s convention.
    gpus_per_node: ranks per node, for replay's node-local subgroups (None: one flat fabric).
    name: the label tables show.
    contention: a :class:`~simddp.models.Contention` (or a dict of its fields) measured on the
        same machine; :meth:`load` reads the file's ``"contention"`` entry. None = none.
    """

    def __init__(self, rows: Iterable[Mapping[str, Any]], *, gpus_per_node: int | None = None,
                 name: str = "measured", contention: Contention | Mapping | None = None) -> None:
        self.contention = as_contention(contention, "MeasuredNetwork")
        self.rows = [dict(r) for r in rows]
        if not self.rows:
            raise ValueError("MeasuredNetwork needs at least one measurement; run "
                             "`simddp calibrate --json FILE` to take some")
        self.name = name
        self.gpus_per_node = gpus_per_node
        tables: dict[tuple[str, int], dict[int, float]] = {}
        for i, r in enumerate(self.rows):
            missing = {"op", "world_size", "bytes", "seconds"} - r.keys()
            if missing:
                raise ValueError(f"measurement {i} ({r!r}) lacks {sorted(missing)}; each row "
                                 f"needs op, world_size, bytes and seconds")
            ops.cost_kind(r["op"])  # ValueError naming the known ops
            n = integer(f"measurement {i}: world_size", r["world_size"], minimum=1)
            b = integer(f"measurement {i}: bytes", r["bytes"], minimum=1)
            s = number(f"measurement {i}: seconds", r["seconds"], positive=True)
            # repeated points (several calibrate runs): keep the fastest, the least disturbed
            cell = tables.setdefault((r["op"], n), {})
            cell[b] = min(s, cell.get(b, math.inf))
        self._tables = {key: (sorted(t), [t[b] for b in sorted(t)]) for key, t in tables.items()}
        self._fits: dict[str, Network | None] = {}

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, **kw: Any) -> "MeasuredNetwork":
        """The model of a ``simddp calibrate --json`` file (or a JSON list of rows), with the
        file's ``"contention"`` entry (``simddp calibrate``'s contention measurement) unless
        ``contention=`` is given."""
        with open(path) as f:
            doc = json.load(f)
        rows = doc["measurements"] if isinstance(doc, dict) else doc
        if isinstance(doc, dict) and doc.get("contention") is not None:
            kw.setdefault("contention", doc["contention"])
        kw.setdefault("name", f"measured:{os.path.basename(os.fspath(path))}")
        return cls(rows, **kw)

    def with_(self, **changes: Any) -> "MeasuredNetwork":
        """A copy with ``gpus_per_node``, ``name`` or ``contention`` changed (as
        :meth:`Network.with_`), e.g. ``net.with_(contention=None)``."""
        kw = {"gpus_per_node": self.gpus_per_node, "name": self.name,
              "contention": self.contention}
        unknown = set(changes) - kw.keys()
        if unknown:
            raise TypeError(f"MeasuredNetwork.with_ changes gpus_per_node, name or contention, "
                            f"not {', '.join(sorted(unknown))}")
        return MeasuredNetwork(self.rows, **{**kw, **changes})

    def describe(self) -> dict[str, Any]:
        """The parameters a sweep table shows (:class:`~simddp.models.NetworkModel`)."""
        return {"network": self.name, "gpus_per_node": self.gpus_per_node,
                "measured_points": sum(len(b) for b, _ in self._tables.values()),
                "measured_world_sizes": sorted({n for _, n in self._tables}),
                **(self.contention.describe() if self.contention is not None else {})}

    def __repr__(self) -> str:
        return (f"MeasuredNetwork({self.name!r}, {len(self.rows)} rows, "
                f"ops={sorted({op for op, _ in self._tables})})")

    # ---- the model ----------------------------------------------------------------------------

    def collective_time(self, op: str, nbytes: int, nranks: int) -> float:
        """Seconds for ``op`` on ``nranks`` ranks with ``nbytes`` (the module docstring's rules)."""
        kind = ops.cost_kind(op)
        nranks = integer("nranks", nranks, minimum=1)
        if nranks == 1 and kind != "p2p":
            return 0.0
        if kind == "barrier":  # an all_reduce of (almost) nothing
            op, nbytes = "all_reduce", 0
        table_op = self._table_op(op, kind)
        if table_op is None:
            return self._fit("all_reduce").collective_time(op, nbytes, nranks)
        sizes = sorted({n for o, n in self._tables if o == table_op})
        near = min(sizes, key=lambda n: (abs(math.log(n / nranks)), n))
        t = self._interpolate(self._tables[(table_op, near)], nbytes)
        if near != nranks:
            fit = self._fit(table_op)
            t *= fit.collective_time(table_op, nbytes, nranks) / \
                fit.collective_time(table_op, nbytes, near)
        return t

    def _table_op(self, op: str, kind: str) -> str | None:
        measured = {o for o, _ in self._tables}
        if op in measured:
            return op
        same = sorted(o for o in measured if ops.cost_kind(o) == kind)
        same = same or sorted(o for o in measured if ops.cost_kind(o) in _family(kind))
        return same[0] if same else None

    @staticmethod
    def _interpolate(table: tuple[list[int], list[float]], nbytes: float) -> float:
        sizes, times = table
        if nbytes <= sizes[0]:
            return times[0]
        if nbytes >= sizes[-1]:
            if len(sizes) == 1:
                return times[0] * nbytes / sizes[0]
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])  # s per byte, last segment
            return times[-1] + max(slope, 0.0) * (nbytes - sizes[-1])
        i = bisect.bisect_right(sizes, nbytes)
        x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
        w = (math.log(nbytes) - x0) / (x1 - x0)
        return times[i - 1] + w * (times[i] - times[i - 1])

    def _fit(self, op: str) -> Network:
        """The α–β fallback for ``op``: fitted to that op's rows (another measured op's when it
        has none), or a zero-latency bandwidth line through its largest measurement when the
        rows cannot separate α from bandwidth."""
        if op not in self._fits:
            multi = [r for r in self.rows if r["world_size"] >= 2]
            if not multi:
                raise ValueError(f"{self!r} has no measurement on 2 or more ranks, so it says "
                                 f"nothing about the network; measure with nranks >= 2")
            fit_op = op if any(r["op"] == op for r in multi) else multi[0]["op"]
            data = [(r["bytes"], r["world_size"], r["seconds"]) for r in multi
                    if r["op"] == fit_op]
            try:
                fit = Network.calibrate(data, op=fit_op, name=f"{self.name}-fit")
            except ValueError:
                b, n, t = max(data)
                factor = Network.bus_bandwidth_factor(fit_op, n) or 1.0
                fit = Network(bandwidth_GBps=factor * b / t / 1e9, latency_us=0.0,
                              name=f"{self.name}-fit")
            self._fits[op] = fit
        return self._fits[op]


Network.measured = MeasuredNetwork
