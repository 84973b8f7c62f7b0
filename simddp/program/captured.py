"""What a capture holds, and how replay plans each bucket's communication.

* :class:`CapturedIteration` (with :class:`ParamInfo` and :class:`RankProfile` per rank): one
  DDP iteration as :func:`~simddp.cosim.capture.capture` recorded it, JSON-serialisable;
* :func:`assign_buckets`: the Reducer's bucket layout at any cap, with torch's own bucketing.

The DDP planner (:mod:`simddp.program.ddp`) turns it into a step program.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fakepg.arguments import number

from ..models import Network

__all__ = ["CapturedIteration", "CapturedStep", "CapturedPipeline", "ParamInfo", "RankProfile", "assign_buckets",
           "parse_indices", "load_capture", "capture_from_dict", "CaptureFileError",
           "SCHEMA_VERSION"]

# the saved form's version: a file names its kind (the captured class) and this; files
# without them (written before) are read as version 1 and their kind told from their fields
SCHEMA_VERSION = 1

_MB = 1024 * 1024


class _JSON:
    """JSON round trips for a capture dataclass (its ``from_dict`` rebuilds nested parts)."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "schema": SCHEMA_VERSION,
                **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    save = to_json

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Any:
        with open(path) as f:
            return cls.from_json(f.read())


class _Capture(_JSON):
    """What every capture answers besides its data."""

    network: dict[str, Any] | None

    def network_model(self) -> Network | None:
        """The capture's network (None if it was not a :class:`Network`)."""
        return None if self.network is None else Network(**self.network)


class MeshCapture(_Capture):
    """A capture on a DeviceMesh (``mesh``: dimension → size)."""

    mesh: dict[str, int]

    @property
    def shard_size(self) -> int:
        return int(self.mesh.get("shard", 1))

    @property
    def tp_size(self) -> int:
        return int(self.mesh.get("tp", 1))


@dataclass
class ParamInfo:
    """One parameter as the Reducer indexes it (DDP's parameter order)."""

    index: int
    name: str
    shape: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    sparse: bool = False

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def element_size(self) -> int:
        return _dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass
class RankProfile:
    """One rank's compute in the captured iteration, in virtual seconds.

    forward: iteration start → ``backward()`` call, waits excluded. forward_collectives:
    ``{"offset", "op", "bytes", "wait_at"}`` issued in that stretch (offset: forward compute
    before the issue; wait_at: forward compute before the rank waited for it — a wait, or an
    op reading its tensor — or None). ready: per parameter index, its grad-ready time
    relative to the ``backward()`` call (None: no gradient). backward: compute until the Reducer's
    end-of-backward wait; post_backward: compute after it, until ``backward()`` returns;
    before_step: ``backward()`` return → ``optimizer.step()``; optimizer: the step.
    """

    forward: float
    ready: list[float | None]
    backward: float
    post_backward: float = 0.0
    before_step: float = 0.0
    optimizer: float = 0.0
    forward_collectives: list[dict[str, Any]] = field(default_factory=list)
    # The whole iteration as a program (any parallelism): every collective this rank issued,
    # in issue order, ``{"offset", "op", "bytes", "group", "group_size", "seq", "phase",
    # "wait_at"}`` — offset and wait_at in compute seconds since the iteration's start, waits
    # excluded, as for forward_collectives; phase "forward", "backward" or "optimizer" — and
    # ``marks``, the compute offsets where backward starts ("backward"), backward() returns
    # ("backward_done") and the step ends ("end", the iteration's total compute).
    collectives: list[dict[str, Any]] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)


@dataclass
class CapturedIteration(_Capture):
    """One DDP iteration as :func:`capture` recorded it; JSON-serialisable
    (:meth:`to_json`, :meth:`save`, :meth:`from_json`, :meth:`load`)."""

    name: str
    world_size: int
    iteration: int
    params: list[ParamInfo]
    ready_order: list[int]
    bucket_cap_bytes: int
    first_bucket_bytes: int
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    bucket_indices: list[list[int]]
    bucket_bytes: list[int]
    profiles: list[RankProfile]
    bucket_cap_bytes_list: list[int] = field(default_factory=list)
    backward_collectives: list[dict[str, Any]] = field(default_factory=list)
    network: dict[str, Any] | None = None
    compute: str = ""
    costs: dict[str, float] | None = None
    cosim_iteration_time: float = 0.0
    cosim_exposed_comm: float = 0.0
    collectives: list[dict[str, Any]] = field(default_factory=list)
    logging_data: dict[str, Any] = field(default_factory=dict)
    optimizer_state_bytes: int = 0  # rank 0's optimizer state after the recorded step
    activation_bytes: int = 0  # what autograd saved for backward in the recorded forward
    device: str = "cpu"  # where the capture ran: "cpu", or "meta" (shapes only, no data)
    parallel: str = "ddp"  # "ddp", or "fsdp" (FSDP2: no buckets; see fsdp_groups)
    # FSDP2's parameter groups in module order: {"module", "params": [{"name", "shape",
    # "dtype", "padded_shard_numel"}], "reshard_after_forward", "param_dtype", "reduce_dtype"}
    fsdp_groups: list[dict[str, Any]] = field(default_factory=list)
    batch_size: int = 0  # samples per rank per iteration (the batch's first dimension; 0: unknown)

    # -- derived ---------------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


    def buckets(self, bucket_cap_mb: float | None = None,
                first_bucket_mb: float | None = None) -> list[list[int]]:
        """The Reducer's steady-state layout at these caps (None: the captured ones)."""
        cap, first, caps = self._caps(bucket_cap_mb, first_bucket_mb)
        return assign_buckets(self.params, self.ready_order, bucket_cap_bytes=cap,
                              first_bucket_bytes=first, bucket_cap_bytes_list=caps,
                              find_unused_parameters=self.find_unused_parameters)

    def _caps(self, bucket_cap_mb: float | None, first_bucket_mb: float | None
              ) -> tuple[int, int, list[int]]:
        if bucket_cap_mb is None:
            cap, first, caps = self.bucket_cap_bytes, self.first_bucket_bytes, \
                list(self.bucket_cap_bytes_list)
        else:
            cap = int(number("bucket_cap_mb", bucket_cap_mb, positive=True,
                             hint="DDP's bucket size in MiB, e.g. 25") * _MB)
            first, caps = cap, []  # DDP: an explicit cap is also the first bucket's
        if first_bucket_mb is not None:
            first = int(number("first_bucket_mb", first_bucket_mb, positive=True,
                               hint="the first bucket's size in MiB, e.g. 1") * _MB)
        return cap, first, caps

    def with_ddp_work_at_device_cost(self, plain: Mapping[str, float],
                                     factor: float) -> CapturedIteration:
        """This capture with DDP's own work (what the DDP step does beyond ``plain``, the
        no-DDP step's phases ``forward``/``backward``/``optimizer`` under the same compute
        model) charged at ``1 / factor`` of its captured cost: the compute model was scaled by
        ``factor`` to a measured step time, which must not scale DDP's parameter-proportional
        work (see :mod:`simddp.models.ddp_overhead`). Mark offsets and grad-ready times move
        with their segment, linearly; the roofline summary (comm hooks' work) is DDP's."""
        from ..models.ddp_overhead import device_cost, split

        number("factor", factor, positive=True, hint="the calibration factor, e.g. 2.5")
        profiles = []
        for q in self.profiles:
            kept_b, extra_b = split(q.backward, plain["backward"])
            # what of the plain backward is left for after the end-of-backward wait
            kept_p, extra_p = split(q.post_backward, plain["backward"] - kept_b)
            profiles.append(_rephased(
                q, device_cost(q.forward, plain["forward"], factor), kept_b + extra_b / factor,
                kept_p + extra_p / factor, q.before_step / factor,
                device_cost(q.optimizer, plain["optimizer"], factor)))
        return dataclasses.replace(self, profiles=profiles, costs=_costs_scaled(self.costs,
                                                                                1 / factor))

    def with_compute_scaled(self, factor: float) -> CapturedIteration:
        """This capture with every compute duration (and grad-ready time, mark offset and the
        roofline summary's costs) ``factor`` times as long."""
        number("factor", factor, positive=True, hint="a slowdown, e.g. 2.0")
        profiles = [_rephased(q, q.forward * factor, q.backward * factor,
                              q.post_backward * factor, q.before_step * factor,
                              q.optimizer * factor) for q in self.profiles]
        return dataclasses.replace(self, profiles=profiles, costs=_costs_scaled(self.costs,
                                                                                factor))

    # -- serialisation (to_json, save, load: _JSON) ------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CapturedIteration:
        d = dict(d)
        d["params"] = [ParamInfo(**p) for p in d["params"]]
        d["profiles"] = [RankProfile(**p) for p in d["profiles"]]
        return super().from_dict(d)



def _rephased(q: RankProfile, forward: float, backward: float, post_backward: float,
              before_step: float, optimizer: float) -> RankProfile:
    """``q`` with new phase durations; forward marks and grad-ready times stretched with
    their phase."""
    fs = forward / q.forward if q.forward > 0 else 1.0
    bs = backward / q.backward if q.backward > 0 else 1.0
    return dataclasses.replace(
        q, forward=forward, backward=backward, post_backward=post_backward,
        before_step=before_step, optimizer=optimizer,
        ready=[None if t is None else t * bs for t in q.ready],
        forward_collectives=[{**fc, "offset": fc["offset"] * fs,
                              "wait_at": None if fc.get("wait_at") is None
                              else fc["wait_at"] * fs} for fc in q.forward_collectives])


def _costs_scaled(costs: dict[str, float] | None, factor: float) -> dict[str, float] | None:
    """A roofline summary (``costs``) whose ops take ``factor`` times as long."""
    if costs is None:
        return None
    return {"overhead_s": costs["overhead_s"] * factor,
            "bytes_per_s": costs["bytes_per_s"] / factor,
            "flops_per_s": costs["flops_per_s"] / factor}


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def assign_buckets(params: Sequence[ParamInfo], ready_order: Sequence[int], *,
                   bucket_cap_bytes: int, first_bucket_bytes: int,
                   bucket_cap_bytes_list: Sequence[int] = (),
                   find_unused_parameters: bool = False) -> list[list[int]]:
    """The Reducer's buckets (lists of parameter indices, in reduction order), computed with
    torch's own ``torch.distributed._compute_bucket_assignment_by_size`` on meta tensors of
    the parameters' shapes and dtypes.

    Steady state without ``find_unused_parameters``: the Reducer's rebuild, parameters in
    grad-ready order (``ready_order``; parameters missing from it last) with the limits
    ``[first_bucket_bytes, bucket_cap_bytes]`` (or ``bucket_cap_bytes_list``) and the tensor
    indices, buckets in the order returned. With ``find_unused_parameters`` (torch 2.13 does
    not rebuild then): DDP's initial assignment, parameters in model order with limits
    ``[first, cap]`` (``[cap]`` when first ≥ cap), reversed.
    """
    from ..compat import compute_bucket_assignment_by_size

    tensors = [torch.empty(p.shape, dtype=_dtype(p.dtype), device="meta") for p in params]
    sparse = [bool(p.sparse) for p in params]
    if find_unused_parameters:
        if bucket_cap_bytes_list:
            limits = list(bucket_cap_bytes_list)
        elif first_bucket_bytes < bucket_cap_bytes:
            limits = [first_bucket_bytes, bucket_cap_bytes]
        else:
            limits = [bucket_cap_bytes]
        idx, _ = compute_bucket_assignment_by_size(tensors, limits, sparse)
        return [list(b) for b in reversed(idx)]
    seen = set(ready_order)
    order = list(ready_order) + [p.index for p in params if p.index not in seen]
    limits = list(bucket_cap_bytes_list) or [first_bucket_bytes, bucket_cap_bytes]
    idx, _ = compute_bucket_assignment_by_size(
        [tensors[i] for i in order], limits, sparse, order)  # sparse: by index, not position
    return [list(b) for b in idx]


def parse_indices(text: str) -> list[list[int]]:
    """``"11 10 9, 8 7"`` (DDP's logging format) → ``[[11, 10, 9], [8, 7]]``."""
    text = str(text or "").strip()
    if not text:
        return []
    return [[int(x) for x in part.split()] for part in text.split(",") if part.strip()]


@dataclass
class CapturedStep(MeshCapture):
    """One training step of a sharded program (FSDP2, HSDP) as
    :func:`~simddp.cosim.capture_fsdp.capture_fsdp` recorded it; JSON-serialisable.

    ``profiles``: per captured rank, per phase ("forward", "backward", "optimizer")
    ``{"seconds": compute, waits excluded, "events": [{"op", "bytes", "scope", "offset",
    "wait_at"}]}`` — every collective issued in the phase, in issue order, at its compute
    offset, with the offset where the rank waited for it (None: never in that phase) and its
    mesh dimension (``scope``: ``"shard"``, ``"replicate"``, ``"tp"``). ``mesh``: the
    capture's mesh (``{"shard": n}`` or ``{"replicate": r, "shard": s}``, with ``"tp": t``
    innermost under tensor parallelism). Memory facts per rank: ``param_bytes`` (the model's,
    unsharded), ``optimizer_state_bytes`` (this rank's shard), ``activation_bytes`` (saved for
    backward in the step; with ``activation_checkpointing`` the blocks' inputs and what is saved
    outside them) and ``recompute_bytes`` (with activation checkpointing: the largest block's
    activations, live while backward recomputes it)."""

    name: str
    parallel: str
    world_size: int
    mesh: dict[str, int]
    reshard_after_forward: bool
    param_dtype: str | None
    reduce_dtype: str | None
    profiles: list[dict[str, Any]]
    param_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    network: dict[str, Any] | None = None
    compute: str = ""
    costs: dict[str, float] | None = None
    cosim_iteration_time: float = 0.0
    cosim_exposed_comm: float = 0.0
    recompute_bytes: int = 0  # activation checkpointing: one block's, while backward recomputes it
    activation_checkpointing: bool = False
    # tensor parallelism (a "tp" dimension in mesh): the parameters' bytes one TP rank holds
    # before FSDP2 shards them (0: param_bytes, no TP), and whether the plan was
    # sequence-parallel
    local_param_bytes: int = 0
    sequence_parallel: bool = False
    # the storages counted in activation_bytes, in the order autograd saved them (the
    # allocations the caching allocator model replays; empty: one share per unit)
    activation_sizes: list[int] = field(default_factory=list)
    # the most bytes live at once in a plain forward, loss and backward beyond what is saved,
    # the parameters and their gradients (the loss's fp32 logits gradients, ...)
    temporary_bytes: int = 0


    @property
    def tp_param_bytes(self) -> int:
        """The parameters one TP rank holds before FSDP2 shards them."""
        return int(self.local_param_bytes or self.param_bytes)



@dataclass
class CapturedPipeline(MeshCapture):
    """One training step of a pipeline-parallel program (``torch.distributed.pipelining``,
    optionally with FSDP2 and/or tensor parallelism inside each stage), as
    :func:`~simddp.cosim.capture_pp.capture_pp` recorded it; JSON-serialisable.

    ``stages``: per stage index (``pp × stages_per_rank`` of them), a dict::

        {"stage": s, "rank": r,                        # r: its rank along "pp"
         "layers": [first, end),                       # the blocks the stage holds
         "param_bytes": int,                           # the stage's parameters, unsharded
         "optimizer_state_bytes": int,                 # one rank's optimizer state
         "activation_bytes": int,                      # saved for backward, one microbatch
         "recompute_bytes": int,                       # activation checkpointing: one block's,
                                                       # live while a backward recomputes it
         "send_bytes": {"F": int, "B": int},           # to the next stage / previous stage
         "actions": {"F": [profile, ...], "B": [...], "I": [...], "W": [...]},
         "unshard": [profile, ...],                    # torch's UNSHARD actions, in order
         "reshard": [profile, ...],                    # and RESHARD (multi-stage + FSDP2)
         "reduce_grad": profile,                       # torch's REDUCE_GRAD action
         "optimizer": profile}

    with one ``profile`` per captured microbatch (index = microbatch) for each action type the
    captured schedule ran (``B`` for full-backward schedules, ``I`` and ``W`` for zero-bubble
    ones; ``None`` for a microbatch whose backward ran as the other kind — DualPipeV mixes
    them), each a phase profile as :class:`CapturedStep` has them: ``{"seconds": compute,
    waits excluded, "events": [{"op", "bytes", "scope", "offset", "wait_at"}]}`` — the
    collectives the action issued inside the stage (tensor parallelism on ``"tp"``, FSDP2 on
    ``"shard"``/``"replicate"``), not the pipeline's sends and receives, which the schedule's
    action list places (``send_bytes``). The last stage's ``F`` includes its loss. ``reduce_grad``:
    the stage's ``perform_reduce_grad`` after its last backward (FSDP2's reduce-scatters, gradient
    scaling by the number of microbatches). ``unshard`` / ``reshard``: with FSDP2 under a
    multi-stage schedule, torch lowers the schedule with UNSHARD / RESHARD actions (the
    stage's all-gathers issued asynchronously: the stage's next ``F`` or ``B`` waits for them,
    so their ``wait_at`` is None); single-stage schedules leave them empty and gather in the
    first ``F``. ``schedule``: the torch schedule class captured;
    ``mesh``: the capture's mesh (``{"pp": p[, "replicate": r][, "shard": s][, "tp": t]}``).
    ``activation_checkpointing``: every block of every stage ran under torch's
    ``checkpoint_wrapper`` (full AC): ``B`` (``I``) recomputes the stage's forward, a stage's
    ``activation_bytes`` are its blocks' inputs and what is saved outside them, and
    ``recompute_bytes`` its largest block's saved activations (0 without AC, or for a stage
    without blocks).
    """

    name: str
    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    microbatch_size: int
    mesh: dict[str, int]
    world_size: int
    stages: list[dict[str, Any]]
    param_bytes: int
    data: str = "none"  # data parallelism inside a stage: "none", "fsdp" or "hsdp"
    reshard_after_forward: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    network: dict[str, Any] | None = None
    compute: str = ""
    costs: dict[str, float] | None = None
    cosim_iteration_time: float = 0.0
    cosim_exposed_comm: float = 0.0
    activation_checkpointing: bool = False




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
