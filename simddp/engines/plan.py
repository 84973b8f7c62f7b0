"""What a capture holds, and how replay plans each bucket's communication.

* :class:`CapturedIteration` (with :class:`ParamInfo` and :class:`RankProfile` per rank): one
  DDP iteration as :func:`~simddp.engines.capture.capture` recorded it, JSON-serialisable;
* :func:`assign_buckets`: the Reducer's bucket layout at any cap, with torch's own bucketing;
* :func:`plans`: per bucket, the collectives a comm hook issues and the compute around them,
  costed with the capture's roofline summary (:class:`Costs`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fakepg.arguments import integer, number

from ..models import Network, NetworkModel

__all__ = ["CapturedIteration", "ParamInfo", "RankProfile", "assign_buckets", "BucketPlan",
           "Costs", "plans", "COMM_HOOKS", "parse_indices", "check_knobs"]

_MB = 1024 * 1024
COMM_HOOKS = (None, "allreduce", "fp16", "bf16", "powersgd")
_POWERSGD_MIN_COMPRESSION_RATE = 2.0  # torch's PowerSGDState default


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
class CapturedIteration:
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
    device: str = "cpu"  # where the capture ran: "cpu", or "meta" (shapes only, no data)
    parallel: str = "ddp"  # "ddp", or "fsdp" (FSDP2: no buckets; see fsdp_groups)
    # FSDP2's parameter groups in module order: {"module", "params": [{"name", "shape",
    # "dtype", "padded_shard_numel"}], "reshard_after_forward", "param_dtype", "reduce_dtype"}
    fsdp_groups: list[dict[str, Any]] = field(default_factory=list)

    # -- derived ---------------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def network_model(self) -> Network | None:
        """The capture's network (None if it was not a :class:`Network`)."""
        return None if self.network is None else Network(**self.network)

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

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    save = to_json

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CapturedIteration:
        d = dict(d)
        d["params"] = [ParamInfo(**p) for p in d["params"]]
        d["profiles"] = [RankProfile(**p) for p in d["profiles"]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> CapturedIteration:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CapturedIteration:
        with open(path) as f:
            return cls.from_json(f.read())


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
    import torch.distributed as dist

    tensors = [torch.empty(p.shape, dtype=_dtype(p.dtype), device="meta") for p in params]
    sparse = [bool(p.sparse) for p in params]
    if find_unused_parameters:
        if bucket_cap_bytes_list:
            limits = list(bucket_cap_bytes_list)
        elif first_bucket_bytes < bucket_cap_bytes:
            limits = [first_bucket_bytes, bucket_cap_bytes]
        else:
            limits = [bucket_cap_bytes]
        idx, _ = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)
        return [list(b) for b in reversed(idx)]
    seen = set(ready_order)
    order = list(ready_order) + [p.index for p in params if p.index not in seen]
    limits = list(bucket_cap_bytes_list) or [first_bucket_bytes, bucket_cap_bytes]
    idx, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], limits, sparse, order)  # sparse: by index, not position
    return [list(b) for b in idx]


def parse_indices(text: str) -> list[list[int]]:
    """``"11 10 9, 8 7"`` (DDP's logging format) → ``[[11, 10, 9], [8, 7]]``."""
    text = str(text or "").strip()
    if not text:
        return []
    return [[int(x) for x in part.split()] for part in text.split(",") if part.strip()]


class Costs:
    """Op costs from the capture's roofline summary: overhead + max(bytes/bw, FLOPs/peak)."""

    def __init__(self, costs: Mapping[str, float] | None) -> None:
        self.ok = bool(costs)
        self.overhead = float(costs["overhead_s"]) if costs else 0.0
        self.bw = float(costs["bytes_per_s"]) if costs else math.inf
        self.peak = float(costs["flops_per_s"]) if costs else math.inf

    def op(self, nbytes: float = 0.0, flops: float = 0.0) -> float:
        if not self.ok:
            return 0.0
        return self.overhead + max(nbytes / self.bw, flops / self.peak)


@dataclass
class BucketPlan:
    """How one bucket is communicated: main-stream compute before the issue, then stages:
    (op, bytes, callback seconds on the side stream after the stage's collective ends);
    stage j + 1 is issued from the side stream when stage j's callback ends."""

    params: list[int]
    nbytes: int
    pre: float
    stages: list[tuple[str, int, float]]


def plans(cap: CapturedIteration, buckets: list[list[int]], hook: str | None, rank: int,
          costs: Costs) -> list[BucketPlan]:
    """Per bucket of ``buckets``, how ``hook`` communicates it (``rank``: PowerSGD's)."""
    captured = {frozenset(b): n for b, n in zip(cap.bucket_indices, cap.bucket_bytes)}
    out = []
    for b in buckets:
        ps = [cap.params[i] for i in b]
        sparse = any(p.sparse for p in ps)
        nbytes = sum(p.nbytes for p in ps)
        if sparse:  # a sparse gradient's all_reduce moves what the capture saw (indices+values)
            nbytes = captured.get(frozenset(b), nbytes)
        numel = sum(p.numel for p in ps)
        if sparse or hook in (None, "allreduce"):
            out.append(BucketPlan(b, nbytes, 0.0, [("all_reduce", nbytes, 0.0)]))
        elif hook in ("fp16", "bf16"):
            half = 2 * numel
            pre = costs.op(nbytes + half) + costs.op(2 * half)  # cast, then div_ in place
            out.append(BucketPlan(b, nbytes, pre, [("all_reduce", half, costs.op(half + nbytes))]))
        elif hook == "powersgd":
            unc, pb, qb = 0, 0, 0
            pre = cb_p = cb_q = 0.0
            for p in ps:
                e = p.element_size
                if len(p.shape) <= 1:
                    unc += p.nbytes
                    continue
                n = int(p.shape[0])
                m = p.numel // n if n else 0
                r = min(n, m, rank)
                if not (n and m and (n + m) * r * _POWERSGD_MIN_COMPRESSION_RATE < n * m):
                    unc += p.nbytes
                    continue
                pb += n * r * e
                qb += m * r * e
                mat = n * m * e
                pre += costs.op(3 * mat)  # error feedback: M += error
                pre += costs.op(mat + (m + n) * r * e, 2.0 * n * m * r)  # P = M Q
                cb_p += costs.op(2 * n * r * e, 2.0 * n * r * r)  # orthogonalise P
                cb_p += costs.op(mat + (m + n) * r * e, 2.0 * n * m * r)  # Q = Mᵀ P
                cb_q += costs.op(mat + (m + n) * r * e, 2.0 * n * m * r)  # M = P Qᵀ
                cb_q += costs.op(3 * mat)  # error = input − M
            pre += costs.op(2 * unc)  # copy uncompressed tensors into one buffer
            out.append(BucketPlan(b, nbytes, pre, [("all_reduce", unc, costs.op(2 * unc)),
                                              ("all_reduce", pb, cb_p),
                                              ("all_reduce", qb, cb_q)]))
        else:  # pragma: no cover - checked by replay()
            raise ValueError(hook)
    return out


def check_knobs(world: int, net: NetworkModel, *, comm_hook: Any, powersgd_rank: Any,
                 rank_speed: Any, jitter: Any, localsgd_period: Any, slowmo_period: Any,
                 uneven: Any, iterations: Any, groups: Any, shared_nic: bool
                 ) -> tuple[dict[int, float], dict[int, int], int]:
    """Check :func:`~simddp.replay.replay`'s knobs against each other and the world; returns
    the speeds, the uneven counts and the number of iterations to replay."""
    ranks = f"a rank of the world (0..{world - 1})"
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"comm_hook must be one of {COMM_HOOKS}, got {comm_hook!r}")
    integer("powersgd_rank", powersgd_rank, minimum=1)
    number("jitter", jitter, minimum=0, hint="a relative standard deviation, e.g. 0.05")
    speeds = dict(rank_speed or {})
    for r, v in speeds.items():
        if integer("rank_speed: a key", r, minimum=0, hint=ranks) >= world:
            raise ValueError(f"rank_speed names rank {r!r}, but the world has ranks "
                             f"0..{world - 1}")
        number(f"rank_speed[{r}]", v, positive=True, hint="a speed factor, 0.5 = half speed")
    if localsgd_period is not None and slowmo_period is not None:
        raise ValueError("give localsgd_period or slowmo_period, not both")
    period = localsgd_period if localsgd_period is not None else slowmo_period
    if period is not None:
        integer("the averaging period (localsgd_period/slowmo_period)", period, minimum=1)
        if comm_hook not in (None, "allreduce"):
            raise ValueError("LocalSGD/SlowMo replace the gradient all_reduce (post-localSGD is "
                             "itself a comm hook): use comm_hook=None with them")
        if uneven:
            raise ValueError("uneven inputs (Join) with LocalSGD/SlowMo are not modelled")
    if integer("groups", groups, minimum=1, hint=f"a divisor of world_size={world}") \
            and world % groups:
        raise ValueError(f"groups must divide world_size={world}, got {groups!r}")
    if shared_nic and net.gpus_per_node is None:
        raise ValueError("shared_nic=True needs a network with gpus_per_node (the ranks that "
                         "share a node's NIC)")
    uneven = dict(uneven or {})
    for r, n in uneven.items():
        if integer("uneven: a key", r, minimum=0, hint=ranks) >= world:
            raise ValueError(f"uneven maps ranks (0..{world - 1}) to iteration counts, "
                             f"got rank {r!r}")
        integer(f"uneven[{r}]", n, minimum=0, hint="the iterations that rank runs")
    if iterations is None:
        iterations = max(1, period or 1, max(uneven.values(), default=-1) + 1)
    iterations = integer("iterations", iterations, minimum=1)
    if any(n > iterations for n in uneven.values()):
        raise ValueError(f"uneven gives a rank more than iterations={iterations} iterations")
    return speeds, uneven, iterations
