"""The collective trace: one record per collective call per rank, in issue order.

Exports to JSON and to the pickle dump format of torch's Flight Recorder, so that
``python -m torch.distributed.flight_recorder.fr_trace`` can analyse a fake run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .naming import NAMES


@dataclass
class CollectiveRecord:
    """One rank's view of one collective (or point-to-point) call."""

    rank: int
    group: str
    group_ranks: tuple[int, ...]
    seq: int
    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    bytes: int
    site: str
    reduce_op: str | None = None
    root: int | None = None
    peer: int | None = None
    tag: int | None = None
    async_op: bool = False
    p2p: bool = False
    output_shapes: tuple[tuple[int, ...], ...] = ()
    state: str = "scheduled"
    record_id: int = 0
    issue: float | None = None
    start: float | None = None
    end: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """``all_reduce(shapes=[(4,)], dtypes=[float32], op=SUM)``-style text."""
        parts = [f"shapes={list(self.shapes)}", f"dtypes=[{', '.join(self.dtypes)}]"]
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        if self.tag:
            parts.append(f"tag={self.tag}")
        return f"{self.op}({', '.join(parts)})"


Trace = Sequence[Sequence[CollectiveRecord]]


def to_json(trace: Trace, path: str | os.PathLike | None = None) -> str:
    """Serialise a per-rank trace; the text is identical for identical runs."""
    doc = {"version": 1, "ranks": [[r.to_dict() for r in recs] for recs in trace]}
    text = json.dumps(doc, indent=1, sort_keys=True)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def from_json(text: str) -> list[list[CollectiveRecord]]:
    doc = json.loads(text)
    out = []
    for recs in doc["ranks"]:
        rows = []
        for r in recs:
            r["group_ranks"] = tuple(r["group_ranks"])
            r["shapes"] = tuple(tuple(s) for s in r["shapes"])
            r["output_shapes"] = tuple(tuple(s) for s in r["output_shapes"])
            r["dtypes"] = tuple(r["dtypes"])
            rows.append(CollectiveRecord(**r))
        out.append(rows)
    return out


_DTYPE_FR = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
             "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
             "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def flight_recorder_dump(records: Iterable[CollectiveRecord], rank: int) -> dict[str, Any]:
    """One rank's trace as the dict torch's Flight Recorder pickles (format version 2.x).

    fakepg emulates gloo's semantics, so entries carry the ``gloo:`` profiling prefix
    that torch's ``fr_trace`` analyser accepts.
    """
    entries = []
    pg_config: dict[str, dict[str, str]] = {}
    for rec in records:
        op = NAMES.get(rec.op)
        name = rec.op if op is None else op.fr_name  # named after the c10d C++ entry points
        if rec.p2p:
            me = rec.group_ranks.index(rec.rank)
            name = f"{name} {me}->{rec.peer}" if rec.op == "send" else f"{name} {me}<-{rec.peer}"
        pg_config.setdefault(rec.group, {"name": rec.group, "desc": rec.group,
                                         "ranks": str(list(rec.group_ranks))})
        sizes = [list(s) for s in rec.shapes]
        entries.append({
            "record_id": rec.record_id,
            "pg_id": 0,
            "process_group": (rec.group, rec.group),
            "collective_seq_id": 0 if rec.p2p else rec.seq + 1,
            "p2p_seq_id": rec.seq + 1 if rec.p2p else 0,
            "op_id": rec.record_id + 1,
            "profiling_name": f"gloo:{name}",
            "time_created_ns": int((rec.issue or 0.0) * 1e9),
            "time_discovered_started_ns": None if rec.start is None else int(rec.start * 1e9),
            "time_discovered_completed_ns": None if rec.end is None else int(rec.end * 1e9),
            "duration_ms": None,
            "input_sizes": sizes,
            "input_dtypes": [_DTYPE_FR.get(d, d) for d in rec.dtypes],
            "output_sizes": [list(s) for s in rec.output_shapes] or sizes,
            "output_dtypes": [_DTYPE_FR.get(d, d) for d in rec.dtypes],
            "state": rec.state,
            "retired": rec.state in ("completed", "failed"),
            "timeout_ms": 1800000,
            "is_p2p": rec.p2p,
            "frames": _frames(rec.site),
        })
    return {"version": "2.10", "pg_config": pg_config, "pg_status": {}, "entries": entries, "rank": rank}


def _frames(site: str) -> list[dict[str, Any]]:
    """Flight Recorder frames, innermost first: ``train.py:12 (via lib/ddp.py:88)`` is the
    library's frame, then the user's."""
    user, _, via = site.partition(" (via ")
    return [_frame(loc) for loc in ((via.rstrip(")"), user) if via else (user,))]


def _frame(loc: str) -> dict[str, Any]:
    fn, _, line = loc.rpartition(":")
    return {"name": "<collective>", "filename": fn, "line": int(line) if line.isdigit() else 0}


def dump_flight_recorder(trace: Trace, directory: str | os.PathLike, prefix: str = "rank") -> list[str]:
    """Write one Flight Recorder pickle per rank (``<dir>/<prefix><rank>``) and return the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for rank, recs in enumerate(trace):
        path = os.path.join(directory, f"{prefix}{rank}")
        with open(path, "wb") as f:
            pickle.dump(flight_recorder_dump(recs, rank), f)
        paths.append(path)
    return paths
