"""Trace-driven replay: one captured DDP iteration, replayed at any world size on simpy.

Two steps::

    import simddp
    from fakepg import zoo
    from simddp import Network, Timing, Compute
    from simddp.replay import capture, replay, sweep

    cap = capture(zoo.get("transformer_block"), nprocs=2,
                  timing=Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100")))
    cap.save("cap.json")                                   # JSON; CapturedIteration.load(...)
    res = replay(cap, 4096, network=Network.preset("ib-ndr", gpus_per_node=8),
                 bucket_cap_mb=5, comm_hook="fp16", rank_speed={17: 0.8})
    res.iteration_time, res.exposed_comm                   # seconds (means over iterations)
    res.timeline(ranks=range(8)).plot("replay.png")        # the same Timeline as co-simulation
    rows = sweep(cap, world_size=[512, 4096], bucket_cap_mb=[5, 25], comm_hook=[None, "fp16"])

Capture (:func:`capture`)
-------------------------

The workload (a ``models.Scenario``, or a :class:`Workload`) runs under :func:`simddp.simulate`
on the fake cluster — torch's real DDP and Reducer — for ``iterations`` steps; the last one
(after DDP rebuilt its buckets) is recorded per rank, from virtual time:

* ``forward``: compute from the iteration's start (the previous optimizer step's end) to the
  ``backward()`` call (zero_grad, forward, loss), waits excluded, and the collectives issued in
  it (e.g. DDP's buffer broadcast) at their compute offsets;
* per parameter, its **grad-ready time**: when the Reducer has processed its gradient
  (an autograd post-hook on the parameter's AccumulateGrad node, registered after the
  Reducer's, so the time includes the Reducer's copy into its bucket), relative to the
  ``backward()`` call, and rank 0's grad-ready order;
* ``backward``: backward compute until the Reducer's hidden end-of-backward wait, and
  ``post_backward``: what runs after that wait (the Reducer's finalize: copies from buckets to
  ``.grad``);
* ``optimizer``: the optimizer step;
* the Reducer's layout (``rebuilt_per_bucket_param_indices`` of ``_get_ddp_logging_data()``),
  its bucket caps and flags, the bucket all_reduce sizes from fakepg's trace, parameter shapes
  and dtypes, the co-simulated iteration time and exposed communication, and a roofline
  summary of the compute model (per-op overhead, bytes/s, FLOP/s) to cost comm hooks.

Replay (:func:`replay`)
-----------------------

One global simpy environment (:class:`simddp.engine.Fabric`); each rank is a simpy process,
each collective a process on its communicator (see :mod:`simddp.engine`). Per iteration a
rank runs:

1. **forward**: its captured forward compute (× 1/rank_speed × jitter), with the captured
   forward collectives (e.g. DDP's buffer broadcast) issued at their compute offsets and
   waited for where the capture's rank waited for them (if it did);
2. **backward**: bucket *k* becomes ready when the last of its parameters is ready
   (``backward start + grad-ready time × 1/speed × jitter``) and is issued when it and all
   buckets before it are ready — the Reducer reduces buckets in order. The layout is
   re-computed with torch's own ``_compute_bucket_assignment_by_size`` from the captured
   parameter sizes/dtypes and rank 0's grad-ready order, with the Reducer's rebuild limits
   ``[first bucket cap, bucket cap]`` (or, with ``find_unused_parameters=True``, where torch
   2.13 does not rebuild, the initial layout: parameter order, reversed);
3. the **end-of-backward wait** for every bucket's collectives and their future callbacks (a
   per-rank side stream, as in co-simulation), then the post-backward compute and the
   **optimizer** step. The iteration ends there.

Knobs (all of :func:`replay`'s keywords are grid axes for :func:`sweep`):

* ``network``: a :class:`~simddp.Network` or preset name; a collective lasts
  ``network.collective_time(op, bytes, group size) × jitter``.
* ``bucket_cap_mb`` / ``first_bucket_mb``: as DDP's (an explicit cap makes the first bucket
  the same size, as in DDP, unless ``first_bucket_mb`` says otherwise).
* ``comm_hook``: ``"fp16"``/``"bf16"``: each bucket is sent as 2-byte elements; the cast
  before the all_reduce runs on the rank (in backward) and the copy back in a callback on the
  side stream, each costed as an op moving its bytes. ``"powersgd"`` (steady state, after
  ``start_powerSGD_iter``, error feedback on): per bucket an all_reduce of the uncompressed
  tensors (1-D ones, and matrices that compression would not shrink by ``2×``: torch's
  ``min_compression_rate``), then, in callbacks, an all_reduce of P (n·r per n×m matrix) and
  one of Q (m·r), as torch's ``powerSGD_hook`` chains them (with NCCL the chain is enqueued
  on the communicator when the bucket is issued, so bucket *k*'s P and Q all_reduces run
  before bucket *k + 1*'s; each is issued when the callback before it ends); its matmuls
  (M·Q, Mᵀ·P, P·Qᵀ: 2·n·m·r FLOPs each), orthogonalisation (2·n·r² FLOPs) and copies are
  costed with the captured roofline (op overhead + max(bytes/bandwidth, FLOPs/peak)). Without
  a roofline summary (a profile-based compute model), compression costs nothing.
* ``rank_speed={rank: factor}`` (stragglers: 0.5 = half speed) and ``jitter`` (relative
  standard deviation of a mean-1 log-normal factor per compute segment — forward, backward,
  post-backward, optimizer — of each rank and iteration, and per collective; co-simulation
  draws one per op, so the same ``jitter`` varies replayed iterations more), from ``seed``.
* ``localsgd_period=p`` (post-localSGD hook + ``PeriodicModelAverager``, after its warm-up):
  gradients are all-reduced only within each node (the hook's default subgroup: the DDP
  group's ranks on one node, ``network.gpus_per_node`` per node; none when it is unset), and
  every p-th iteration (``i % p == 0``, as the averager counts) all parameters are averaged over
  the DDP group: one blocking all_reduce of all parameter bytes plus the flatten/unflatten
  copies, charged to that iteration. ``slowmo_period=p`` (fairscale SlowMo, LocalSGD base
  algorithm): the same, plus the slow-momentum update (about four passes over the parameters)
  at each averaging. The warm-up iterations (plain DDP) are not replayed.
* ``uneven={rank: iterations}``: DDP under ``Join``; a rank runs the listed number of
  iterations (the others ``iterations``) and then shadows the others' iterations as Join's
  DDP hook does: each of its shadow iterations takes part in Join's all_reduce (the count of
  ranks not yet joined) and DDP's requires-grad-sync all_reduce (blocking), then in every
  bucket all_reduce (zeros), waiting for them. Ranks still training issue the same two 4-byte
  all_reduces (asynchronously) at each forward. At the end every rank takes part in the last
  Join all_reduce and DDP's broadcast of the final parameters.
* ``groups`` / ``shared_nic``: the world is split into ``groups`` DDP groups (rank r in group
  r % groups, e.g. one DDP per tensor-parallel shard), each of world_size/groups ranks, each
  with its own communicator. With ``shared_nic=True`` the ranks of a node (``gpus_per_node``)
  share one NIC, a simpy resource: a collective spanning several nodes holds the NIC of every
  node it spans, so the groups' collectives serialise there (contention).
* ``iterations``: how many to replay (default 1; one averaging period with LocalSGD/SlowMo;
  with ``uneven``, one more than the largest count listed, which the other ranks run).

Not modelled: compute that depends on the world size (the captured compute is replayed as
is), the first iterations (DDP's initial single bucket, the rebuild broadcast, warm-ups),
per-op variability inside a segment, PowerSGD's warm start and rank adaptation, other comm
hooks, overlap between iterations (each iteration ends with the optimizer step, after the
end-of-backward wait), memory, CPU/GPU asynchrony beyond the side stream of callbacks,
collectives the workload issues itself outside forward and backward.

Why replay can differ from co-simulation at the captured world size and network: each rank's
bucket is issued at the grad-ready time of its last parameter, measured after the Reducer's
hook returned, which is a few ops after the Reducer issued the all_reduce inside that hook;
and compute is replayed per segment, not per op. The test requires agreement within 5 %.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import io
import itertools
import json
import math
import os
import time as _time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from .engine import Collective, Fabric, at, collective_time
from .network import Network
from .timeline import CommSpan, Span, Timeline, _intersection, _union

__all__ = ["capture", "replay", "sweep", "write_csv", "assign_buckets", "CapturedIteration",
           "ParamInfo", "RankProfile", "ReplayResult", "Workload", "COMM_HOOKS"]

_MB = 1024 * 1024
COMM_HOOKS = (None, "allreduce", "fp16", "bf16", "powersgd")
_POWERSGD_MIN_COMPRESSION_RATE = 2.0  # torch's PowerSGDState default
_DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # dist._DEFAULT_FIRST_BUCKET_BYTES in torch 2.13


# ---------------------------------------------------------------------------------------------
# What a capture holds
# ---------------------------------------------------------------------------------------------

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
            if not bucket_cap_mb > 0:
                raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
            cap = int(bucket_cap_mb * _MB)
            first, caps = cap, []  # DDP: an explicit cap is also the first bucket's
        if first_bucket_mb is not None:
            if not first_bucket_mb > 0:
                raise ValueError(f"first_bucket_mb must be > 0, got {first_bucket_mb!r}")
            first = int(first_bucket_mb * _MB)
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


# ---------------------------------------------------------------------------------------------
# Bucketing, as the Reducer does it
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------

def _default_loss(output: Any, batch: Any) -> torch.Tensor:
    return output.float().pow(2).mean()


def _default_forward(model: Any, batch: Any) -> Any:
    return model(batch)


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


@dataclass
class Workload:
    """A training step to capture when no ``models.Scenario`` fits.

    model(): builds the module (same on every rank; seeded with ``seed``). batch(rank, i): rank's
    i-th input. forward(model, batch) → output (default ``model(batch)``); loss(output, batch)
    (default mean of squares); optimizer(params) (default SGD, lr 0.01); ddp_kwargs for DDP.
    """

    model: Callable[[], torch.nn.Module]
    batch: Callable[[int, int], Any]
    loss: Callable[[Any, Any], torch.Tensor] = _default_loss
    forward: Callable[[Any, Any], Any] = _default_forward
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = _default_optimizer
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = "workload"
    seed: int = 0

    def build_model(self) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self.model()

    def batches(self, rank: int, world_size: int, iterations: int) -> list:
        return [self.batch(rank, i) for i in range(iterations)]

    def step(self, model: Any, batch: Any) -> torch.Tensor:
        return self.loss(self.forward(model, batch), batch)


def _batches(workload: Any, rank: int, world_size: int, iterations: int) -> list:
    if isinstance(workload, Workload):
        return workload.batches(rank, world_size, iterations)
    data = list(workload.inputs(rank, world_size))
    if not data:
        raise ValueError(f"workload {getattr(workload, 'name', workload)!r} gives rank {rank} "
                         f"no batches")
    return [data[i % len(data)] for i in range(iterations)]


def _expects_sparse_gradient(module: torch.nn.Module) -> bool:
    """DDP's ``_check_if_sparse_gradient``: an Embedding(Bag) with ``sparse=True``."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) \
        and bool(module.sparse)


def _reducer_params(ddp: Any) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module]]:
    """DDP's parameter list for its Reducer (``_build_params_for_reducer``): per module, its own
    parameters that require grad and are not ignored, deduplicated."""
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    out, memo = [], set()
    for mname, module in ddp.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if not p.requires_grad or full in ignore or p in memo:
                continue
            memo.add(p)
            out.append((full, p, module))
    return out


def _probe_costs(compute: Any) -> dict[str, float] | None:
    """A roofline summary of ``compute``: per-op overhead, bytes/s of a copy, FLOP/s of a
    matmul — used to cost comm-hook compression in replay. None if the model cannot say."""
    aten = torch.ops.aten
    try:
        def t(*shape: int) -> torch.Tensor:
            return torch.empty(shape, device="meta")
        tiny = t(1)
        overhead = float(compute.op_time(aten.add.Tensor, (tiny, tiny), {}, tiny))
        n = 1 << 22
        a, b = t(n), t(n)
        copy = float(compute.op_time(aten.copy_.default, (a, b), {}, a)) - overhead
        m = 2048
        x = t(m, m)
        mm = float(compute.op_time(aten.mm.default, (x, x), {}, x)) - overhead
    except Exception:  # noqa: BLE001 - a profile-based model knows no such ops
        return None
    if not (copy > 0 and mm > 0 and overhead >= 0):
        return None
    return {"overhead_s": overhead, "bytes_per_s": 2 * 4 * n / copy,
            "flops_per_s": 2.0 * m ** 3 / mm}


def capture(workload: Any, nprocs: int = 2, *, timing: Any = None, iterations: int = 3,
            seed: int = 0, ddp_kwargs: Mapping[str, Any] | None = None) -> CapturedIteration:
    """Run ``workload`` (a ``models.Scenario``, or a :class:`Workload`) on ``nprocs`` fake
    ranks under :func:`simddp.simulate` with ``timing`` and record its last iteration (of
    ``iterations`` ≥ 3, so that DDP has rebuilt its buckets). See the module docstring."""
    from . import cosim
    from .timing import Timing

    if iterations < 3:
        raise ValueError(f"capture needs iterations >= 3 (DDP rebuilds its buckets after the "
                         f"first; the second still broadcasts the new layout), got {iterations}")
    timing = Timing() if timing is None else timing
    kwargs = {**dict(getattr(workload, "ddp_kwargs", {}) or {}), **dict(ddp_kwargs or {})}
    last = iterations - 1

    def run(rank: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        world = dist.get_world_size()
        model = DDP(workload.build_model(), **kwargs)
        opt = workload.optimizer(model.parameters())
        named = _reducer_params(model)
        n = len(named)
        st: dict[str, Any] = {"on": False, "t_b": 0.0, "ready": [None] * n, "order": [],
                              "eob": None}

        def hook_for(i: int) -> Callable[..., None]:
            def hook(grad_inputs: Any, grad_outputs: Any) -> None:
                if st["on"] and st["ready"][i] is None:
                    st["ready"][i] = cosim.now() - st["t_b"]
                    st["order"].append(i)
            return hook

        nodes = []
        for i, (_, p, _m) in enumerate(named):
            node = p.view_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad, as DDP finds it
            node.register_hook(hook_for(i))  # after the Reducer's: runs after its hook
            nodes.append(node)
        r = cosim._tls.clock
        original = type(r).end_of_backward.__get__(r)

        def end_of_backward() -> None:
            record = st["on"] and st["eob"] is None
            t_in = r.clock
            original()
            if record:
                st["eob"] = (t_in, r.clock)

        r.end_of_backward = end_of_backward  # an instance attribute: new_graph_task queues it
        marks = {}
        t_prev = cosim.now()
        for i, batch in enumerate(_batches(workload, rank, world, iterations)):
            on = i == last
            t0 = t_prev
            opt.zero_grad()
            loss = workload.step(model, batch)
            t_b = cosim.now()
            st["on"], st["t_b"] = on, t_b
            loss.backward()
            st["on"] = False
            t_ab = cosim.now()
            t_s = cosim.now()
            opt.step()
            t_e = t_prev = cosim.now()
            if on:
                marks = dict(t0=t0, t_b=t_b, t_ab=t_ab, t_s=t_s, t_e=t_e)
        del nodes
        out = {"marks": marks, "ready": st["ready"], "order": st["order"], "eob": st["eob"],
               "params": [(name, list(p.shape), str(p.dtype).replace("torch.", ""),
                           _expects_sparse_gradient(mod)) for name, p, mod in named]}
        if rank == 0:
            out["logging"] = {k: v for k, v in model._get_ddp_logging_data().items()
                              if isinstance(v, (int, float, str))}
            cfg = getattr(model, "_bucket_config", None)
            out["ddp"] = dict(
                bucket_cap_bytes=int(model.bucket_bytes_cap),
                first_bucket_bytes=int(getattr(cfg, "first_bucket_bytes_cap",
                                               model.bucket_bytes_cap)),
                bucket_cap_bytes_list=[int(x) for x in getattr(cfg, "per_bucket_bytes_caps", ())],
                find_unused_parameters=bool(model.find_unused_parameters),
                static_graph=bool(getattr(model, "static_graph", False)),
                gradient_as_bucket_view=bool(model.gradient_as_bucket_view))
        return out

    res = cosim.simulate(run, (), nprocs, timing=timing, seed=seed)
    outs = res.returns
    tl = res.timeline
    r0 = outs[0]
    params = [ParamInfo(i, name, shape, dtype, sparse) for i, (name, shape, dtype, sparse) in
              enumerate(r0["params"])]
    profiles = []
    for rank, o in enumerate(outs):
        m = o["marks"]
        waits = [(s.start, s.end) for s in tl.rank_spans(rank, ("wait",))]

        def waited(lo: float, hi: float) -> float:
            return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in waits)

        fwd_colls = []
        bwd_colls = []
        for rec in res.trace[rank]:
            if rec.issue is None or rec.issue < m["t0"] or rec.issue >= m["t_ab"]:
                continue
            if rec.issue < m["t_b"]:
                offset = rec.issue - m["t0"] - waited(m["t0"], rec.issue)
                # where the rank waited for it (a wait, or an op reading its tensor): the wait
                # span in forward that ends at the collective's end
                wait_at = None
                for s, e in waits:
                    if rec.end is not None and rec.issue <= s < m["t_b"] and e == rec.end:
                        wait_at = max(offset, s - m["t0"] - waited(m["t0"], s))
                        break
                fwd_colls.append({"offset": max(0.0, offset), "op": rec.op, "bytes": rec.bytes,
                                  "wait_at": wait_at})
            else:
                bwd_colls.append(rec)
        eob = o["eob"] or (m["t_ab"], m["t_ab"])
        profiles.append(RankProfile(
            forward=(m["t_b"] - m["t0"]) - waited(m["t0"], m["t_b"]),
            ready=list(o["ready"]),
            backward=eob[0] - m["t_b"],
            post_backward=max(0.0, m["t_ab"] - eob[1]),
            before_step=m["t_s"] - m["t_ab"],
            optimizer=m["t_e"] - m["t_s"],
            forward_collectives=fwd_colls))
        if rank == 0:
            floats = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
            bucket_recs = [c for c in bwd_colls if c.op == "all_reduce"
                           and all(d in floats for d in c.dtypes)]
            extra = [{"op": c.op, "bytes": c.bytes} for c in bwd_colls if c not in bucket_recs]
            coll_rows = [{"op": c.op, "bytes": c.bytes, "group": c.group, "seq": c.seq,
                          "issue": c.issue - m["t0"], "start": (c.start or 0.0) - m["t0"],
                          "end": (c.end or 0.0) - m["t0"],
                          "phase": "forward" if c.issue < m["t_b"] else "backward"}
                         for c in res.trace[0]
                         if c.issue is not None and m["t0"] <= c.issue < m["t_e"]]
    ddp = r0["ddp"]
    logging = r0["logging"]
    order = list(r0["order"])
    layout = _parse_indices(logging.get("rebuilt_per_bucket_param_indices", ""))
    cap = CapturedIteration(
        name=str(getattr(workload, "name", "workload")), world_size=nprocs, iteration=last,
        params=params, ready_order=order, bucket_indices=layout, bucket_bytes=[
            c.bytes for c in bucket_recs], profiles=profiles, backward_collectives=extra,
        network=(dataclasses.asdict(timing.network)
                 if isinstance(timing.network, Network) else None),
        compute=repr(timing.compute), costs=_probe_costs(timing.compute),
        cosim_iteration_time=tl.iteration_times()[last],
        cosim_exposed_comm=tl.exposed_comm()[last], collectives=coll_rows,
        logging_data=logging, **ddp)
    if not cap.bucket_indices:
        cap.bucket_indices = cap.buckets()
    return cap


def _parse_indices(text: str) -> list[list[int]]:
    """``"11 10 9, 8 7"`` (DDP's logging format) → ``[[11, 10, 9], [8, 7]]``."""
    text = str(text or "").strip()
    if not text:
        return []
    return [[int(x) for x in part.split()] for part in text.split(",") if part.strip()]


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------

class _Costs:
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
class _Plan:
    """How one bucket is communicated: main-stream compute before the issue, then stages:
    (op, bytes, callback seconds on the side stream after the stage's collective ends);
    stage j + 1 is issued from the side stream when stage j's callback ends."""

    params: list[int]
    nbytes: int
    pre: float
    stages: list[tuple[str, int, float]]


def _plans(cap: CapturedIteration, buckets: list[list[int]], hook: str | None, rank: int,
           costs: _Costs) -> list[_Plan]:
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
            out.append(_Plan(b, nbytes, 0.0, [("all_reduce", nbytes, 0.0)]))
        elif hook in ("fp16", "bf16"):
            half = 2 * numel
            pre = costs.op(nbytes + half) + costs.op(2 * half)  # cast, then div_ in place
            out.append(_Plan(b, nbytes, pre, [("all_reduce", half, costs.op(half + nbytes))]))
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
            out.append(_Plan(b, nbytes, pre, [("all_reduce", unc, costs.op(2 * unc)),
                                              ("all_reduce", pb, cb_p),
                                              ("all_reduce", qb, cb_q)]))
        else:  # pragma: no cover - checked by replay()
            raise ValueError(hook)
    return out


@dataclass
class ReplayResult:
    """What :func:`replay` found. Times in virtual seconds.

    iteration_times / exposed_comm: per replayed iteration, the maximum over ranks (as
    :meth:`Timeline.iteration_times`); ``iteration_time`` / ``mean_exposed_comm`` their means.
    buckets: the layout replayed (parameter indices per bucket); bucket_bytes: bytes each
    bucket's collectives carried (per stage). collectives: every collective (name, op, group,
    members, bytes, start, end). knobs: the keywords it ran with. :meth:`timeline` builds a
    :class:`~simddp.Timeline` of chosen ranks (Chrome trace, PNG, summary).
    """

    world_size: int
    iterations: int
    knobs: dict[str, Any]
    iteration_times: list[float]
    exposed_comm: list[float]
    buckets: list[list[int]]
    bucket_bytes: list[list[int]]
    collectives: list[dict[str, Any]]
    rank_collectives: list[int]
    rank_comm_bytes: list[int]
    slowest_rank: list[int]
    wall_time: float = 0.0
    _spans: list[list[tuple[str, float, float, str]]] = field(default_factory=list, repr=False)
    _comms: list[list[tuple[Collective, float]]] = field(default_factory=list, repr=False)
    _bounds: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def iteration_time(self) -> float:
        return sum(self.iteration_times) / len(self.iteration_times)

    @property
    def mean_exposed_comm(self) -> float:
        return sum(self.exposed_comm) / len(self.exposed_comm)

    @property
    def collectives_per_iteration(self) -> float:
        """Collectives rank 0 took part in, per iteration."""
        return self.rank_collectives[0] / self.iterations

    @property
    def comm_bytes_per_iteration(self) -> float:
        """Bytes of the collectives rank 0 took part in (nccl-tests' convention), per
        iteration."""
        return self.rank_comm_bytes[0] / self.iterations

    def row(self) -> dict[str, Any]:
        """One flat row for a sweep table: knobs, then results."""
        return {**self.knobs, "world_size": self.world_size, "iterations": self.iterations,
                "iteration_time_s": self.iteration_time,
                "exposed_comm_s": self.mean_exposed_comm,
                "buckets": len(self.buckets),
                "collectives_per_iteration": self.collectives_per_iteration,
                "comm_bytes_per_iteration": self.comm_bytes_per_iteration}

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "iterations": self.iterations,
                "knobs": self.knobs, "iteration_time": self.iteration_time,
                "iteration_times": self.iteration_times, "exposed_comm": self.exposed_comm,
                "slowest_rank": self.slowest_rank, "buckets": self.buckets,
                "bucket_bytes": self.bucket_bytes, "rank_collectives": self.rank_collectives,
                "rank_comm_bytes": self.rank_comm_bytes, "collectives": self.collectives}

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Everything but the wall time (so equal inputs give identical text)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """One row per iteration: the knobs, the iteration, its time, exposed comm, slowest
        rank."""
        rows = [{**self.knobs, "world_size": self.world_size, "iteration": i,
                 "iteration_time_s": t, "exposed_comm_s": x, "slowest_rank": s}
                for i, (t, x, s) in enumerate(zip(self.iteration_times, self.exposed_comm,
                                                  self.slowest_rank))]
        return write_csv(rows, path)

    def timeline(self, ranks: Iterable[int] | None = None) -> Timeline:
        """A :class:`~simddp.Timeline` of ``ranks`` (default: all when ≤ 64, else 0..15),
        renumbered 0..k−1 in the order given (``Timeline`` indexes ranks densely). Group member
        lists are left empty for groups of more than 64 ranks."""
        if ranks is None:
            ranks = range(self.world_size if self.world_size <= 64 else 16)
        chosen = list(ranks)
        spans, comms = [], []
        for new, r in enumerate(chosen):
            for kind, s, e, label in self._spans[r]:
                spans.append(Span(new, kind, s, e, label))
            for c, issue in self._comms[r]:
                info = c.info
                members = info["members"]
                comms.append(CommSpan(
                    rank=new, op=info["op"], group=info["group"],
                    group_ranks=tuple(members) if len(members) <= 64 else (),
                    seq=info["seq"], bytes=info["bytes"], issue=issue, start=c.start,
                    end=c.end, site=info["name"], in_backward=info["in_backward"]))
        bounds = [list(self._bounds[r]) for r in chosen]
        return Timeline(len(chosen), spans, comms, bounds,
                        [b[-1] if b else 0.0 for b in bounds])

    def summary(self) -> str:
        k = ", ".join(f"{a}={b}" for a, b in self.knobs.items() if b not in (None, 0.0, 1, False))
        return (f"replay: {self.world_size} ranks, {len(self.buckets)} buckets, {k}\n"
                f"  iteration {self.iteration_time * 1e3:.3f} ms, exposed comm "
                f"{self.mean_exposed_comm * 1e3:.3f} ms, "
                f"{self.collectives_per_iteration:g} collectives and "
                f"{self.comm_bytes_per_iteration / 1e6:.3f} MB per iteration (rank 0); "
                f"simulated in {self.wall_time:.3f} s")


def _network(network: Any, cap: CapturedIteration) -> Network:
    if network is None:
        net = cap.network_model()
        if net is None:
            raise ValueError("replay(network=...) is needed: the capture's network was not a "
                             "simddp.Network")
        return net
    if isinstance(network, str):
        return Network.preset(network)
    if not hasattr(network, "collective_time"):
        raise TypeError(f"network must be a simddp.Network or a preset name, got {network!r}")
    return network


def _lognormal(rng: np.random.Generator, jitter: float, size: Any) -> np.ndarray:
    s2 = float(np.log1p(jitter * jitter))
    return rng.lognormal(-s2 / 2.0, np.sqrt(s2), size)


class _Replay:
    def __init__(self, cap: CapturedIteration, world: int, net: Network, *, buckets, plans,
                 speeds, jitter, seed, period, slowmo, uneven, iterations, groups,
                 shared_nic, costs: _Costs) -> None:
        self.cap, self.world, self.net = cap, world, net
        self.fabric = Fabric()
        self.env = self.fabric.env
        self.plans: list[_Plan] = plans
        self.period, self.slowmo = period, slowmo
        self.iterations = iterations
        self.costs = costs
        self.groups = groups
        self.nprof = len(cap.profiles)
        self.slow = [1.0 / speeds.get(r, 1.0) for r in range(world)]
        self.counts = [uneven.get(r, iterations) for r in range(world)] if uneven else None
        self.join = bool(uneven)
        if jitter > 0:
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
            self.noise = _lognormal(rng, jitter, (world, iterations, 4)).tolist()
            self.net_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
            self.jitter = jitter
            self.net_noise: list[float] = []
        else:
            self.noise = None
            self.jitter = 0.0
        # per profile: forward collectives' issues (0) and waits (1) by compute offset
        self.forward_events = []
        for prof in cap.profiles:
            ev = []
            for k, fc in enumerate(prof.forward_collectives):
                ev.append((float(fc["offset"]), 0, k))
                if fc.get("wait_at") is not None:
                    ev.append((float(fc["wait_at"]), 1, k))
            self.forward_events.append(sorted(ev))
        # per profile: when each bucket is ready, relative to backward start (speed 1)
        self.ready = []
        for prof in cap.profiles:
            rd = [0.0 if t is None else float(t) for t in prof.ready]
            self.ready.append([max((rd[i] for i in p.params), default=0.0) for p in plans])
        gpn = net.gpus_per_node or 1
        self.gpn = gpn
        ng = world // groups
        self.group_size = ng
        self.node_of = [r // gpn for r in range(world)]
        self.node_members: dict[tuple[int, int], list[int]] = {}
        for r in range(world):
            self.node_members.setdefault((r % groups, self.node_of[r]), []).append(r)
        self.group_links: list[list[tuple[str, int]]] = []
        for g in range(groups):
            nodes = sorted({self.node_of[r] for r in range(g, world, groups)})
            self.group_links.append([("nic", n) for n in nodes]
                                    if shared_nic and len(nodes) > 1 else [])
        self.colls: dict[tuple, Collective] = {}
        self.order: list[Collective] = []
        self.seq: dict[Any, int] = {}
        self.side = [0.0] * world
        self.spans: list[list[tuple[str, float, float, str]]] = [[] for _ in range(world)]
        self.comms: list[list[tuple[Collective, float]]] = [[] for _ in range(world)]
        self.bounds: list[list[float]] = [[] for _ in range(world)]
        self.param_bytes = cap.param_bytes

    # -- collectives -----------------------------------------------------------------------
    def _net_factor(self) -> float:
        if not self.jitter:
            return 1.0
        if not self.net_noise:
            self.net_noise = _lognormal(self.net_rng, self.jitter, 4096).tolist()[::-1]
        return self.net_noise.pop()

    def comm_of(self, r: int, scope: str) -> tuple[Any, list[int] | range, list]:
        """(communicator key, members, shared links) of rank r's DDP group or node subgroup."""
        g = r % self.groups
        if scope == "node":
            node = self.node_of[r]
            return ("node", g, node), self.node_members[(g, node)], []
        return ("dp", g), range(g, self.world, self.groups), self.group_links[g]

    def enqueue(self, r: int, tag: tuple, scope: str, op: str, nbytes: int,
                in_backward: bool = False) -> Collective:
        """The collective ``tag`` on rank r's communicator, created (taking the communicator's
        next sequence number, queued behind everything enqueued before it) by its first
        member to enqueue it; no member has arrived at it yet (see :meth:`arrive`)."""
        key, members, links = self.comm_of(r, scope)
        name = (key, *tag)
        c = self.colls.get(name)
        if c is None:
            n = len(members)
            dur = collective_time(self.net, op, nbytes, n) * self._net_factor() if n > 1 else 0.0
            seq = self.seq.get(key, 0)
            self.seq[key] = seq + 1
            group = f"dp{key[1]}" if key[0] == "dp" else f"dp{key[1]}/node{key[2]}"
            info = {"name": "/".join(str(x) for x in (group, *tag)), "op": op, "group": group,
                    "members": members, "seq": seq, "bytes": int(nbytes),
                    "in_backward": in_backward}
            c = self.colls[name] = self.fabric.collective(key, n, dur, links=links, info=info)
            self.order.append(c)
        return c

    def arrive(self, r: int, c: Collective) -> Collective:
        """Rank r issues ``c`` now: its data is ready, the collective may start."""
        c.arrive()
        self.comms[r].append((c, self.env.now))
        return c

    def issue(self, r: int, tag: tuple, scope: str, op: str, nbytes: int,
              in_backward: bool = False) -> Collective:
        return self.arrive(r, self.enqueue(r, tag, scope, op, nbytes, in_backward))

    # -- rank processes ----------------------------------------------------------------------
    def compute(self, r: int, kind: str, seconds: float, label: str | None = None):
        if seconds > 0:
            start = self.env.now
            yield at(self.env, start + seconds)
            self._span(r, kind, start, self.env.now, label or kind)

    def _span(self, r: int, kind: str, s: float, e: float, label: str) -> None:
        if e > s:
            self.spans[r].append((kind, s, e, label))

    def wait(self, r: int, c: Collective, label: str):
        if c.end is None:
            start = self.env.now
            yield c.done
            self._span(r, "wait", start, self.env.now, label)

    def wait_all(self, r: int, pending: list, label: str):
        env = self.env
        start = env.now
        target = start
        for item in pending:
            if isinstance(item, tuple):
                c, cb = item
                if c.end is None:
                    yield c.done
                end = c.end
                if cb > 0:
                    s = max(self.side[r], end)
                    self.side[r] = end = s + cb
                    self._span(r, "callback", s, end, "callback (side stream)")
            else:
                if item.callbacks is not None:  # a chain process still running
                    yield item
                end = item.value
            if end > target:
                target = end
        if target > env.now:
            yield at(env, target)
        self._span(r, "wait", start, env.now, label)

    def chain(self, r: int, plan: _Plan, colls: list[Collective], scale: float):
        """A multi-stage comm hook's future chain (PowerSGD) on rank r's side stream: each
        stage's callback runs after its collective, and issues (arrives at) the next stage's
        collective, which :meth:`issue_bucket` already enqueued in program order."""
        env = self.env
        for j, ((_, _, cb), c) in enumerate(zip(plan.stages, colls)):
            if j:
                self.arrive(r, c)
            if c.end is None:
                yield c.done
            s = max(env.now, self.side[r])
            e = self.side[r] = s + cb * scale
            self._span(r, "callback", s, e, "callback (side stream)")
            if e > env.now:
                yield at(env, e)
        return env.now

    def issue_bucket(self, r: int, it: int, k: int, plan: _Plan, scale: float, scope: str,
                     pending: list) -> None:
        # The Reducer runs bucket k's comm hook when it issues the bucket, and with NCCL the
        # hook's futures complete as soon as their collectives are enqueued, so the whole
        # then-chain (PowerSGD: the P and Q all_reduces) is enqueued on the communicator right
        # away, before bucket k + 1's all_reduce; on the device each stage still waits for the
        # previous stage's callback (stream dependency). So every stage takes its sequence
        # number now, and arrives when its callback has run: bucket k + 1's collectives can
        # never overtake bucket k's P/Q all_reduces on the communicator (co-simulation, where
        # fakepg runs the callbacks inline, gives the same order).
        colls = [self.enqueue(r, ("b", it, k, j), scope, op, nbytes, True)
                 for j, (op, nbytes, _) in enumerate(plan.stages)]
        first = self.arrive(r, colls[0])
        if len(plan.stages) > 1:
            pending.append(self.env.process(self.chain(r, plan, colls, scale)))
        else:
            pending.append((first, plan.stages[0][2] * scale))

    def train(self, r: int, it: int):
        env = self.env
        prof = self.cap.profiles[r % self.nprof]
        s = self.slow[r]
        f = self.noise[r][it] if self.noise is not None else (1.0, 1.0, 1.0, 1.0)
        pending: list = []
        if self.join:  # Join.notify_join_context and DDP's requires-grad-sync, async
            pending.append((self.issue(r, ("join", it), "dp", "all_reduce", 4), 0.0))
            pending.append((self.issue(r, ("sync", it), "dp", "all_reduce", 4), 0.0))
        # forward, with the captured forward collectives at their offsets
        scale = s * f[0]
        done = 0.0
        issued: dict[int, Collective] = {}
        for offset, what, k in self.forward_events[r % self.nprof]:
            dt = offset * scale - done
            if dt > 0:
                yield from self.compute(r, "forward", dt)
                done += dt
            fc = prof.forward_collectives[k]
            if what == 0:
                issued[k] = self.issue(r, ("fwd", it, k), "dp", fc["op"], int(fc["bytes"]))
            else:
                yield from self.wait(r, issued[k], f"wait: {fc['op']}")
        yield from self.compute(r, "forward", prof.forward * scale - done)
        # backward: buckets issued in order, each when its last parameter is ready
        scope = "node" if self.period else "dp"
        t_b = env.now
        scale = s * f[1]
        shift = 0.0
        ready = self.ready[r % self.nprof]
        for k, plan in enumerate(self.plans):
            t = t_b + ready[k] * scale + shift
            if t > env.now:
                yield at(env, t)
            if plan.pre > 0:
                pre = plan.pre * scale
                yield at(env, env.now + pre)
                shift += pre
            self.issue_bucket(r, it, k, plan, scale, scope, pending)
        for k, bc in enumerate(self.cap.backward_collectives):
            pending.append((self.issue(r, ("bwd", it, k), scope, bc["op"], int(bc["bytes"])),
                            0.0))
        end = t_b + prof.backward * scale + shift
        if end > env.now:
            yield at(env, end)
        self._span(r, "backward", t_b, env.now, "backward")
        yield from self.wait_all(r, pending, "wait: collectives of backward")
        yield from self.compute(r, "backward", prof.post_backward * s * f[2])
        yield from self.compute(r, "forward", prof.before_step * s * f[2])
        yield from self.compute(r, "optimizer", prof.optimizer * s * f[3])
        if self.period and it % self.period == 0:
            yield from self.average(r, it, s)

    def average(self, r: int, it: int, s: float):
        """PeriodicModelAverager (LocalSGD) / SlowMo: all_reduce of all parameters."""
        pb = self.param_bytes
        yield from self.compute(r, "optimizer", self.costs.op(2 * pb) * s, "flatten")
        c = self.issue(r, ("avg", it), "dp", "all_reduce", pb)
        yield from self.wait(r, c, "wait: model averaging")
        post = self.costs.op(2 * pb) + self.costs.op(2 * pb)  # divide, unflatten
        if self.slowmo:
            post += 4 * self.costs.op(3 * pb)  # slow momentum: diff, momentum, update, copy
        yield from self.compute(r, "optimizer", post * s, "model averaging")

    def shadow(self, r: int, it: int):
        """A joined rank's shadow of iteration ``it`` (Join's DDP hook)."""
        c = self.issue(r, ("join", it), "dp", "all_reduce", 4)
        yield from self.wait(r, c, "wait: join")
        c = self.issue(r, ("sync", it), "dp", "all_reduce", 4)
        yield from self.wait(r, c, "wait: join")
        pending: list = []
        s = self.slow[r]
        for k, plan in enumerate(self.plans):
            if plan.pre > 0:
                yield from self.compute(r, "backward", plan.pre * s, "comm hook")
            self.issue_bucket(r, it, k, plan, s, "dp", pending)
        yield from self.wait_all(r, pending, "wait: join shadow all_reduces")

    def rank(self, r: int):
        for it in range(self.iterations):
            if self.counts is None or it < self.counts[r]:
                yield from self.train(r, it)
            else:
                yield from self.shadow(r, it)
            self.bounds[r].append(self.env.now)
        if self.join:  # the last Join all_reduce (nobody left), DDP's final broadcast
            c = self.issue(r, ("join", "final"), "dp", "all_reduce", 4)
            yield from self.wait(r, c, "wait: join")
            c = self.issue(r, ("final",), "dp", "broadcast", self.param_bytes)
            yield from self.wait(r, c, "wait: final broadcast")
            if self.bounds[r]:
                self.bounds[r][-1] = self.env.now

    def run(self) -> None:
        # The cyclic garbage collector would rescan the many live events and generators of a
        # large world again and again (2-3x the run time at 4096 ranks); it is paused while the
        # simulation runs and restored after.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for r in range(self.world):
                self.env.process(self.rank(r))
            self.env.run()
        finally:
            if was_enabled:
                gc.enable()
        unfinished = [r for r in range(self.world) if len(self.bounds[r]) < self.iterations]
        if unfinished:  # pragma: no cover - a bug in the model, not a user error
            raise RuntimeError(f"replay deadlocked: ranks {unfinished[:8]} did not finish")

    # -- statistics -----------------------------------------------------------------------
    def stats(self) -> tuple[list[float], list[float], list[int]]:
        its = self.iterations
        times = [0.0] * its
        exposed = [0.0] * its
        slowest = [0] * its
        compute_kinds = ("forward", "backward", "optimizer")
        for r in range(self.world):
            b = self.bounds[r]
            comm = _union((c.start, c.end) for c, _ in self.comms[r]
                          if c.start is not None and c.end is not None)
            comp = _union((s, e) for kind, s, e, _ in self.spans[r] if kind in compute_kinds)
            lo = 0.0
            for i in range(its):
                hi = b[i]
                d = hi - lo
                if d > times[i]:
                    times[i], slowest[i] = d, r
                cw = _clip_list(comm, lo, hi)
                if cw:
                    x = sum(e - s for s, e in cw) - _intersection(cw, _clip_list(comp, lo, hi))
                    if x > exposed[i]:
                        exposed[i] = x
                lo = hi
        return times, exposed, slowest


def _clip_list(ivals: list[tuple[float, float]], lo: float, hi: float
               ) -> list[tuple[float, float]]:
    out = []
    for s, e in ivals:
        if e <= lo:
            continue
        if s >= hi:
            break
        s, e = max(s, lo), min(e, hi)
        if e > s:
            out.append((s, e))
    return out


def replay(captured: CapturedIteration, world_size: int | None = None, *,
           network: Network | str | None = None, bucket_cap_mb: float | None = None,
           first_bucket_mb: float | None = None, comm_hook: str | None = None,
           powersgd_rank: int = 1, rank_speed: Mapping[int, float] | None = None,
           jitter: float = 0.0, seed: int = 0, localsgd_period: int | None = None,
           slowmo_period: int | None = None, uneven: Mapping[int, int] | None = None,
           iterations: int | None = None, groups: int = 1,
           shared_nic: bool = False) -> ReplayResult:
    """Replay ``captured`` on ``world_size`` ranks (default: the captured world size) with one
    global simpy environment. See the module docstring for the model and every knob."""
    t_wall = _time.perf_counter()
    cap = captured
    world = cap.world_size if world_size is None else world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world!r}")
    net = _network(network, cap)
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"comm_hook must be one of {COMM_HOOKS}, got {comm_hook!r}")
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        raise ValueError(f"powersgd_rank must be an int >= 1, got {powersgd_rank!r}")
    if not (isinstance(jitter, (int, float)) and math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"jitter must be a relative standard deviation >= 0, got {jitter!r}")
    speeds = dict(rank_speed or {})
    for r, v in speeds.items():
        if not (isinstance(r, int) and 0 <= r < world):
            raise ValueError(f"rank_speed names rank {r!r}, but the world has ranks "
                             f"0..{world - 1}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"rank_speed[{r}] must be a speed factor > 0, got {v!r}")
    if localsgd_period is not None and slowmo_period is not None:
        raise ValueError("give localsgd_period or slowmo_period, not both")
    period = localsgd_period if localsgd_period is not None else slowmo_period
    if period is not None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"the averaging period must be an int >= 1, got {period!r}")
        if comm_hook not in (None, "allreduce"):
            raise ValueError("LocalSGD/SlowMo replace the gradient all_reduce (post-localSGD is "
                             "itself a comm hook): use comm_hook=None with them")
        if uneven:
            raise ValueError("uneven inputs (Join) with LocalSGD/SlowMo are not modelled")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 \
            or world % groups:
        raise ValueError(f"groups must be an int >= 1 dividing world_size={world}, "
                         f"got {groups!r}")
    if shared_nic and net.gpus_per_node is None:
        raise ValueError("shared_nic=True needs a network with gpus_per_node (the ranks that "
                         "share a node's NIC)")
    uneven = dict(uneven or {})
    for r, n in uneven.items():
        if not (isinstance(r, int) and 0 <= r < world) or not (isinstance(n, int) and n >= 0):
            raise ValueError(f"uneven maps ranks (0..{world - 1}) to iteration counts >= 0, "
                             f"got {r!r}: {n!r}")
    if iterations is None:
        iterations = max(1, period or 1, max(uneven.values(), default=-1) + 1)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    if any(n > iterations for n in uneven.values()):
        raise ValueError(f"uneven gives a rank more than iterations={iterations} iterations")
    buckets = cap.buckets(bucket_cap_mb, first_bucket_mb)
    costs = _Costs(cap.costs)
    plans = _plans(cap, buckets, comm_hook, powersgd_rank, costs)
    sim = _Replay(cap, world, net, buckets=buckets, plans=plans, speeds=speeds, jitter=jitter,
                  seed=seed, period=period, slowmo=slowmo_period is not None, uneven=uneven,
                  iterations=iterations, groups=groups, shared_nic=shared_nic, costs=costs)
    sim.run()
    times, exposed, slowest = sim.stats()
    knobs = {"network": net.name, "bandwidth_GBps": net.bandwidth_GBps,
             "latency_us": net.latency_us, "gpus_per_node": net.gpus_per_node,
             "algorithm": net.algorithm, "bucket_cap_mb": bucket_cap_mb,
             "first_bucket_mb": first_bucket_mb, "comm_hook": comm_hook,
             "powersgd_rank": powersgd_rank if comm_hook == "powersgd" else None,
             "rank_speed": {str(k): v for k, v in sorted(speeds.items())} or None,
             "jitter": float(jitter), "seed": seed, "localsgd_period": localsgd_period,
             "slowmo_period": slowmo_period,
             "uneven": {str(k): v for k, v in sorted(uneven.items())} or None,
             "groups": groups, "shared_nic": shared_nic}
    colls = [{"name": c.info["name"], "op": c.info["op"], "group": c.info["group"],
              "members": len(c.info["members"]), "seq": c.info["seq"],
              "bytes": c.info["bytes"], "start": c.start, "end": c.end} for c in sim.order]
    return ReplayResult(
        world_size=world, iterations=iterations, knobs=knobs, iteration_times=times,
        exposed_comm=exposed, buckets=buckets,
        bucket_bytes=[[b for _, b, _ in p.stages] for p in plans], collectives=colls,
        rank_collectives=[len(x) for x in sim.comms],
        rank_comm_bytes=[sum(c.info["bytes"] for c, _ in x) for x in sim.comms],
        slowest_rank=slowest, wall_time=_time.perf_counter() - t_wall,
        _spans=sim.spans, _comms=sim.comms, _bounds=sim.bounds)


# ---------------------------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------------------------

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


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike | None = None) -> str:
    """Rows (dicts) as CSV text, columns in first-seen order; written to ``path`` if given."""
    cols: list[str] = []
    for row in rows:
        for k in row:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for row in rows:
        w.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
                    for k, v in row.items()})
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", newline="") as f:
            f.write(text)
    return text
