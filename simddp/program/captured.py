"""The captures replay knows, and reading one back from a file.

* :class:`CapturedIteration` (DDP; :mod:`simddp.program.captured_ddp`, with the Reducer's
  bucket layout at any cap, :func:`assign_buckets`);
* :class:`CapturedStep` (FSDP2/HSDP × TP) and :class:`CapturedPipeline` (pipelines):
  :mod:`simddp.program.captured_mesh`; a registered parallelism's own kind (context
  parallelism's ``CapturedCP``) lives with its planner;
* what they share (JSON round trips, the schema version): :mod:`simddp.program.captured_base`;
* :func:`load_capture` / :func:`capture_from_dict`: a saved capture, checked (kind, schema,
  fields, numbers), or a :class:`CaptureFileError` naming the file and the field.

The planners (:mod:`simddp.program.ddp`, :mod:`~simddp.program.fsdp`, ...) turn a capture into
a step program.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from .captured_base import SCHEMA_VERSION, MeshCapture
from .captured_ddp import CapturedIteration, ParamInfo, RankProfile, assign_buckets, parse_indices
from .captured_mesh import CapturedPipeline, CapturedStep, ShardedStep

__all__ = ["CapturedIteration", "CapturedStep", "CapturedPipeline", "ParamInfo", "RankProfile", "assign_buckets",
           "parse_indices", "load_capture", "capture_from_dict", "CaptureFileError",
           "SCHEMA_VERSION", "MeshCapture", "ShardedStep"]


class CaptureFileError(ValueError):
    """A file that is not a capture simddp can replay; the message names the file and the
    field."""


# the largest number a capture holds: bytes of a huge model (an exabyte), seconds, counts
_HUGE = float(1 << 60)


def _kind_of(d: Mapping[str, Any]) -> type | None:
    kinds = {c.__name__: c for c in (CapturedIteration, CapturedStep, CapturedPipeline)}
    if isinstance(d.get("kind"), str) and d["kind"] not in kinds:
        from .registry import REGISTRY, resolve  # a registered parallelism's captured type

        for p in REGISTRY.values():
            if p.captured and not p.reserved and p.captured.endswith(":" + d["kind"]):
                kinds[d["kind"]] = resolve(p.captured)
    if "kind" in d:
        return kinds.get(d["kind"]) if isinstance(d["kind"], str) else None
    if "stages" in d and "schedule" in d:
        return CapturedPipeline
    if "profiles" in d and "mesh" in d:
        return CapturedStep
    if "params" in d and "profiles" in d:
        return CapturedIteration
    return None


def _not_a_capture(d: Any) -> str:
    """What ``d`` (a JSON document) looks like when it is not a capture."""
    if isinstance(d, dict) and "traceEvents" in d or isinstance(d, list) and d and \
            isinstance(d[0], dict) and "ph" in d[0]:
        return "a Chrome trace (timeline.to_chrome_trace), not a capture"
    if isinstance(d, list) and d and isinstance(d[0], dict) and "world_size" in d[0] or \
            isinstance(d, dict) and "rows" in d:
        return "what-if rows (--json / rows.json), not a capture"
    if isinstance(d, dict) and "measurements" in d:
        return "a `simddp calibrate --json` file (a network model), not a capture"
    return (f"a JSON {type(d).__name__} without a capture's fields (a capture has 'kind' "
            f"CapturedIteration, CapturedStep or CapturedPipeline)")


def _check_numbers(value: Any, where: str) -> None:
    """Every number under ``value`` finite, non-negative and not absurdly large (a duration,
    a size, a count or an index); ``where`` names the field."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0 or value > _HUGE:
            raise CaptureFileError(f"field {where} is {value!r}: a capture's durations, sizes "
                                   f"and counts are finite numbers from 0 to 2**60")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_numbers(v, f"{where}.{k}" if where else str(k))
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_numbers(v, f"{where}[{i}]")
        return
    raise CaptureFileError(f"field {where} holds a {type(value).__name__}")


def capture_from_dict(d: Any) -> Any:
    """The capture a JSON document ``d`` holds, checked: its kind and schema version, every
    field the kind needs, every duration and size finite and non-negative. Raises
    :class:`CaptureFileError` naming the field."""
    if not isinstance(d, dict):
        raise CaptureFileError(_not_a_capture(d))
    kind = _kind_of(d)
    if kind is None:
        if "kind" in d:
            raise CaptureFileError(f"field kind is {d['kind']!r}: replay knows CapturedIteration, "
                                   f"CapturedStep and CapturedPipeline")
        raise CaptureFileError(_not_a_capture(d))
    schema = d.get("schema", 1)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise CaptureFileError(f"field schema is {schema!r}: a positive integer")
    if schema > SCHEMA_VERSION:
        raise CaptureFileError(f"field schema is {schema}: written by a newer simddp (this one "
                               f"reads version {SCHEMA_VERSION}); upgrade simddp")
    fields = dataclasses.fields(kind)
    missing = [f.name for f in fields if f.name not in d and
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise CaptureFileError(f"a {kind.__name__} without field(s) {', '.join(missing)}")
    # logging_data is DDP's own record (wall-clock timestamps, torch's counters), kept as is
    _check_numbers({k: v for k, v in d.items() if k not in ("kind", "schema", "logging_data")},
                   "")
    if not isinstance(d.get("profiles", d.get("stages")), list) or \
            not d.get("profiles", d.get("stages")):
        key = "stages" if kind is CapturedPipeline else "profiles"
        raise CaptureFileError(f"field {key} is {d.get(key)!r}: a non-empty list")
    try:
        return kind.from_dict(d)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise CaptureFileError(f"a {kind.__name__} whose fields do not fit it: "
                               f"{type(e).__name__}: {e}") from None


def load_capture(path: str | os.PathLike) -> Any:
    """The capture saved at ``path`` (``whatif --save-capture``, ``--out DIR``'s
    capture.json, ``captured.save``), validated by :func:`capture_from_dict`. Raises
    :class:`CaptureFileError` naming the file and what is wrong (not JSON, truncated, binary,
    another simddp file, a field out of range), or ``OSError`` when it cannot be read."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        raw = f.read()
    if b"\0" in raw[:4096]:
        raise CaptureFileError(f"{name}: binary data, not a capture (a capture is JSON)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CaptureFileError(f"{name}: not UTF-8 text (byte {e.start}), not a capture (a "
                               f"capture is JSON)") from None
    if not text.strip():
        raise CaptureFileError(f"{name}: empty, not a capture")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        end = " (the file ends early: truncated?)" if e.pos >= len(text.rstrip()) else ""
        raise CaptureFileError(f"{name}: not valid JSON at line {e.lineno} column {e.colno}: "
                               f"{e.msg}{end}") from None
    try:
        return capture_from_dict(d)
    except CaptureFileError as e:
        raise CaptureFileError(f"{name}: {e}") from None
