"""Capture of a context-parallel training step: torch's ring attention
(:mod:`simddp.cosim.ring_attention`: what of it is torch's, what is not) composed with FSDP2
(and tensor parallelism) as torchtitan composes them, on the fake cluster, under virtual time.

Per rank, in torchtitan's order: the model (a zoo Llama with fused attention), its TP plan
(``"tp"`` innermost), context parallelism on the ``"cp"`` mesh dimension
(:func:`~simddp.cosim.ring_attention.apply_context_parallel`, the batch sharded on the
sequence), full activation checkpointing when asked, then FSDP2 over the data-parallel and CP
ranks together (torchtitan's ``dp_shard_cp``, a flattened mesh dimension, here
``"shard_cp"``): the CP ranks of a data-parallel rank train on the same batch, each on its
sequence shard, and FSDP2's reduce-scatter averages their gradients.

Recorded as :func:`~simddp.cosim.capture_fsdp.capture_fsdp` records a step, each
collective's mesh dimension told by its process group — ``"cp"`` for those torch's ring issued
(noted as they are issued: with one shard FSDP2's group has the same ranks), ``"shard_cp"``
for FSDP2's — and, for the ring's, the compute offset where torch waited for each
(``_maybe_wait`` at the next ring step), also where it had ended by then. The activations are
counted on a CP world of their own (:func:`_cp_activation_bytes`): one rank's saved tensors,
its sequence shard's.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator, Mapping

import torch

from fakepg.arguments import integer

from ..program.context import CapturedCP, CPMesh
from ..timing import Timing
from .capture import rank_batches, saved_bytes, state_bytes
from .capture_fsdp import (PHASE_BOUNDS, checkpoint_units, cosim_facts, fsdp_units, local_bytes,
                           shard_model, sharded_capture_scope, sharded_step_fields, span_profile,
                           step_marks, torch_dtype)
from .meta import DEVICES, in_meta_scope
from .represent import choose, fill, represented, stand_ins
from .ring_attention import (ROTATE_METHODS, apply_context_parallel, cpu_ring_attention,
                             observing_ring, shard_sequence, torch_cp)
from .simulate import SimResult, issued, now, simulate
from .tensor_parallel import apply_tensor_parallel

__all__ = ["capture_cp", "capture_request"]

_MESH_ORDER = ("replicate", "shard", "cp", "tp")


def _seq_len(batch: Any) -> int:
    return int(batch[0].shape[1])


class _RingRecorder:
    """Which of each rank's collectives torch's ring attention issued (their indices in the
    rank's trace) and where the rank waited for each (torch's ``_maybe_wait`` on an
    ``AsyncCollectiveTensor``, as virtual time, in order). Process-wide while recording (the
    same for every rank of one world), each rank writing its own entries."""

    def __init__(self, nprocs: int) -> None:
        self.ring: list[set[int]] = [set() for _ in range(nprocs)]
        self.waits: list[list[float]] = [[] for _ in range(nprocs)]

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        import torch.distributed as dist

        from ..compat import functional_collectives
        funcol = functional_collectives()

        cpa = torch_cp()
        original = cpa._maybe_wait

        def maybe_wait(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(tensor, funcol.AsyncCollectiveTensor):
                self.waits[dist.get_rank()].append(now())
            return original(tensor)
        cpa._maybe_wait = maybe_wait
        try:
            with observing_ring(self):
                yield
        finally:
            cpa._maybe_wait = original

    def ring_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(...)`` (torch's ring attention) with the collectives it issues noted."""
        import torch.distributed as dist

        first = issued()
        try:
            return fn(*args, **kwargs)
        finally:
            self.ring[dist.get_rank()].update(range(first, issued()))


def _rank_run(scenario: Any, mesh_dims: Mapping[str, int], iterations: int,
              reshard_after_forward: bool, mp: tuple[str | None, str | None], device: str,
              load_balance: bool, sequence_parallel: bool, checkpointed: bool):
    last = iterations - 1

    def _run(rank: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from .capture import train_steps

        mesh = init_device_mesh("cpu", tuple(mesh_dims.values()),
                                mesh_dim_names=tuple(mesh_dims))
        with torch.device(device):
            model = scenario.build_model()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        cp, tp = mesh_dims["cp"], mesh_dims.get("tp", 1)
        if tp > 1:  # torchtitan: TP, then CP's attention, then FSDP2 over dp_shard × cp
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        local_param_bytes = local_bytes(model)
        batches = rank_batches(scenario, rank // (cp * tp), dist.get_world_size() // (cp * tp),
                           iterations, device)
        seq = _seq_len(batches[0])
        route = apply_context_parallel(model, mesh["cp"], seq, load_balance)
        batches = [tuple(shard_sequence(mesh["cp"], list(b[:2]), seq, load_balance))
                   + tuple(b[2:]) for b in batches]
        dp_mesh = mesh["shard", "cp"]._flatten("shard_cp")
        if "replicate" in mesh_dims:  # HSDP: replicate × the flattened dimension
            with warnings.catch_warnings():  # torchtitan's slicing; torch plans another API
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                dp_mesh = mesh["replicate", "shard_cp"]
        if checkpointed:  # the recomputation routes as the forward did (a thread-local)
            checkpoint_units(model, device)
        shard_model(model, dp_mesh, reshard_after_forward, mp)
        opt = scenario.optimizer(model.parameters())
        marks, mark = step_marks(last)
        with route:
            train_steps(scenario, model, opt, batches, mark)
        scopes = {"cp": mesh["cp"], "shard_cp": dp_mesh if "replicate" not in mesh_dims
                  else dp_mesh["shard_cp"]}
        if tp > 1:
            scopes["tp"] = mesh["tp"]
        if "replicate" in mesh_dims:
            scopes["replicate"] = mesh["replicate"]
        return {"marks": marks, "param_bytes": param_bytes,
                "local_param_bytes": local_param_bytes, "seq_len": seq,
                "groups": {m.get_group().group_name: name for name, m in scopes.items()},
                "optimizer_state_bytes": state_bytes(opt)}

    return in_meta_scope(device, _run)


def _profile(res: SimResult, rank: int, out: Mapping[str, Any], mesh: CPMesh,
             rec: _RingRecorder) -> dict[str, Any]:
    """Per phase: compute (waits excluded) and the collectives issued in it
    (:func:`~simddp.cosim.capture_fsdp.span_profile`), each collective's ``scope`` told by its
    process group — ``"cp"`` for those torch's ring attention issued (with one shard FSDP2's
    group has the same ranks, and torch may hand both the same process group) — and each ring
    collective's ``wait_at`` where torch waited for it."""
    marks = out["marks"]
    spans = [(s.start, s.end) for s in res.timeline.rank_spans(rank, ("wait",))]

    def offset(t0: float, t: float) -> float:  # compute since t0, waits excluded
        return (t - t0) - sum(max(0.0, min(e, t) - max(s, t0)) for s, e in spans)
    profile = {}
    for phase, (a, b) in PHASE_BOUNDS.items():
        t0, t1 = marks[a], marks[b]
        p = span_profile(res, rank, [(t0, t1)], mesh)
        records = [(i, r) for i, r in enumerate(res.trace[rank])
                   if r.issue is not None and t0 <= r.issue < t1]
        if len(records) != len(p["events"]):
            raise RuntimeError(f"capture_cp: rank {rank}'s {phase} has {len(records)} "
                               f"collectives, its profile {len(p['events'])}")
        ring_waits = iter(w for w in rec.waits[rank] if t0 <= w <= t1)
        for ev, (i, r) in zip(p["events"], records):
            ev["scope"] = "cp" if i in rec.ring[rank] else \
                out["groups"].get(r.group, ev["scope"])
            if ev["scope"] == "cp":
                w = next(ring_waits, None)
                if w is None:
                    raise RuntimeError(f"capture_cp: rank {rank}'s ring collective "
                                       f"{r.op} #{r.seq} was never waited for in {phase}")
                ev["wait_at"] = max(ev["offset"], offset(t0, w))
        profile[phase] = p
    return profile


def _cp_activation_bytes(scenario: Any, mesh_dims: Mapping[str, int], device: str,
                         dtype: torch.dtype | None, load_balance: bool,
                         sequence_parallel: bool, checkpointed: bool) -> tuple[int, int]:
    """What autograd keeps for backward in one forward (and loss) of rank 0 of a CP (× TP)
    group, context parallelism applied as captured, on the first batch: (held, recompute) as
    :func:`~simddp.cosim.capture.saved_bytes` counts them. Run on an untimed fake world
    (saved-tensor hooks add ops the compute model would charge)."""
    import fakepg

    cp, tp = mesh_dims["cp"], mesh_dims.get("tp", 1)
    dims = {"cp": cp, **({"tp": tp} if tp > 1 else {})}

    def run(rank: int) -> tuple[int, int]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
        with torch.device(device):
            model = scenario.build_model()
        if dtype is not None:
            model = model.to(dtype)
        if tp > 1:
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        batch = rank_batches(scenario, 0, 1, 1, device)[0]
        seq = _seq_len(batch)
        route = apply_context_parallel(model, mesh["cp"], seq, load_balance)
        batch = tuple(shard_sequence(mesh["cp"], list(batch[:2]), seq, load_balance))
        with route:  # checkpointed blocks measured unwrapped (saved_bytes)
            return saved_bytes(lambda: scenario.step(model, batch), device,
                               fsdp_units(model) if checkpointed else None, model.parameters())

    # only rank 0's saved tensors are counted: on meta it runs alone, its peers' collectives
    # answered by stand-ins (simddp.cosim.represent; the ring's calls have the same shapes on
    # every rank)
    stand = stand_ins(dims, ("cp", "tp")) if device == "meta" else {}
    held, recompute = fakepg.spawn(represented(in_meta_scope(device, run), stand),
                                   nprocs=cp * tp).returns[0]
    return int(held), int(recompute)


def capture_cp(scenario: Any, nprocs: int | None = None, *, timing: Timing | None = None,
               mesh: Mapping[str, int] | None = None, rotate_method: str = "allgather",
               load_balance: bool = True, reshard_after_forward: bool = True,
               param_dtype: str | None = None, reduce_dtype: str | None = None,
               iterations: int = 2, seed: int = 0, device: str = "cpu",
               sequence_parallel: bool = True,
               activation_checkpointing: bool | str = False) -> CapturedCP:
    """Run ``scenario`` (a zoo Llama with fused attention) with context parallelism and FSDP2
    on the fake cluster under :func:`simddp.simulate` and record its last step (see the module
    docstring). ``mesh``: ``{"shard": s, "cp": c}``, optionally with ``"replicate": r`` first
    and/or ``"tp": t`` last (torchtitan's order); ``nprocs``: their product (default). The
    sequence (the scenario's ``seq_len``) is split over the ``c`` CP ranks (``2c`` chunks when
    ``load_balance``, torch's round-robin for causal attention). ``rotate_method``: torch's
    K/V rotation, ``"allgather"`` (default, torch's and torchtitan's) or ``"alltoall"``.
    ``device="meta"``: at real size without arithmetic (:mod:`simddp.cosim.meta`).
    ``activation_checkpointing``: True or ``"full"`` runs every block under torch's
    ``checkpoint_wrapper`` (:func:`~simddp.cosim.capture_fsdp.checkpoint_units`: backward
    recomputes each block's forward, its ring attention and collectives included). The other
    arguments as :func:`~simddp.cosim.capture_fsdp.capture_fsdp`'s."""
    if device not in DEVICES:
        raise ValueError(f"capture_cp: device must be one of {', '.join(DEVICES)}, got "
                         f"{device!r}")
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"capture_cp: rotate_method must be one of "
                         f"{', '.join(ROTATE_METHODS)} (torch's set_rotate_method), got "
                         f"{rotate_method!r}")
    if activation_checkpointing not in (False, None, "none", True, "full"):
        raise ValueError(f"capture_cp: activation checkpointing {activation_checkpointing!r}: "
                         f"context parallelism is captured with full checkpointing (every "
                         f"block, torchtitan's 'full') or none")
    checkpointed = activation_checkpointing in (True, "full")
    iterations = integer("capture_cp: iterations", iterations, minimum=2,
                         hint="the last step is recorded once the optimizer has its state")
    dims = dict(mesh or {"shard": 1, "cp": nprocs or 2})
    for v in dims.values():
        integer("capture_cp: a mesh dimension", v, minimum=1)
    order = [d for d in _MESH_ORDER if d in dims]
    if list(dims) != order or "shard" not in dims or "cp" not in dims:
        raise ValueError(f"capture_cp: mesh {dims} must be {{'shard': s, 'cp': c}}, optionally "
                         f"with 'replicate': r first and 'tp': t last (torchtitan's order "
                         f"replicate × shard × cp × tp)")
    if dims["cp"] < 2:
        raise ValueError(f"capture_cp: the cp dimension must be at least 2, got {dims['cp']}")
    world = math.prod(dims.values())
    nprocs = world if nprocs is None else integer("capture_cp: nprocs", nprocs, minimum=1)
    if nprocs != world:
        raise ValueError(f"capture_cp: mesh {dims} has {world} ranks, nprocs is {nprocs}")
    torch_dtype(param_dtype), torch_dtype(reduce_dtype)
    timing = Timing() if timing is None else timing
    ring = _RingRecorder(nprocs)
    # replicas, shards and TP ranks do the same work: on meta one of each runs (the CP ranks
    # all run: their ring steps differ)
    stand = choose(dims, timing, device, None, "capture_cp")
    with sharded_capture_scope(device), cpu_ring_attention(rotate_method):
        with ring.recording():
            res = simulate(represented(_rank_run(
                scenario, dims, iterations, bool(reshard_after_forward),
                (param_dtype, reduce_dtype), device, bool(load_balance),
                bool(sequence_parallel), checkpointed), stand),
                (), nprocs, timing=timing, seed=seed)
        held, recompute = _cp_activation_bytes(scenario, dims, device, torch_dtype(param_dtype),
                                               bool(load_balance), bool(sequence_parallel),
                                               checkpointed)
    r0 = res.returns[0]
    cpmesh = CPMesh(nprocs, dims)
    return CapturedCP(
        **sharded_step_fields(scenario, dims, r0, reshard_after_forward, param_dtype,
                              reduce_dtype, sequence_parallel),
        profiles=fill([None if r in stand else _profile(res, r, o, cpmesh, ring)
                       for r, o in enumerate(res.returns)], stand),
        activation_bytes=held,
        recompute_bytes=recompute, activation_checkpointing=checkpointed,
        seq_len=int(r0["seq_len"]), rotate_method=rotate_method,
        load_balance=bool(load_balance), device=device,
        **cosim_facts(timing, res, iterations - 1))


def capture_request(req: Any) -> CapturedCP:
    """The registry's capture of a ``cp:N`` layout (a
    :class:`~simddp.program.registry.CaptureRequest`): :func:`capture_cp` on the fewest ranks
    that have every communicator the layout replays — one shard (FSDP2's group is then the
    ring's ranks; replay scales the shard dimension), 2 replicas for HSDP-like flavours — times
    the CP degree, times the TP degree (each degree has its own shapes, ring steps and
    collectives)."""
    par, o = req.parallel, req.options
    mesh: dict[str, int] = {"replicate": 2} if par.data == "hsdp" else {}
    mesh.update(shard=1, cp=par.cp)
    if par.tp > 1:
        mesh["tp"] = par.tp
    raf = o.reshard_after_forward if par.reshard_after_forward is None \
        else par.reshard_after_forward
    ac = o.activation_checkpointing
    if ac not in (None, "none", "full"):
        raise ValueError(f"--parallel {par}: activation checkpointing {ac!r} is not captured "
                         f"with context parallelism; give full or none")
    return capture_cp(req.scenario, timing=req.timing, mesh=mesh,
                      reshard_after_forward=bool(raf), param_dtype=o.param_dtype,
                      reduce_dtype=o.reduce_dtype, seed=req.seed, device=req.device,
                      sequence_parallel=o.sequence_parallel,
                      activation_checkpointing=ac == "full")
