"""What a capture of a DDP iteration holds, and how replay plans each bucket's communication.

* :class:`CapturedIteration` (with :class:`ParamInfo` and :class:`RankProfile` per rank): one
  DDP iteration as :func:`~simddp.cosim.capture.capture` recorded it, JSON-serialisable;
* :func:`assign_buckets`: the Reducer's bucket layout at any cap, with torch's own bucketing.

The DDP planner (:mod:`simddp.program.ddp`) turns it into a step program.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from fakepg.arguments import number

from .captured_base import CaptureRecord

if TYPE_CHECKING:
    import torch

__all__ = ["CapturedIteration", "ParamInfo", "RankProfile", "assign_buckets", "parse_indices"]

_MB = 1024 * 1024


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
class CapturedIteration(CaptureRecord):
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

    # -- serialisation (to_json, save, load: JSONRecord) ------------------------------------------
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
    import torch  # here, not at the top: reading a capture needs no torch (a warm whatif)

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
    import torch  # here, not at the top: reading a capture needs no torch (a warm whatif)

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
