"""Capture of a context-parallel training step: torch's ring attention
(``torch.distributed.tensor.experimental`` context parallelism) composed with FSDP2 (and
tensor parallelism) as torchtitan composes them, on the fake cluster, under virtual time.

What runs is torch's own code, as torchtitan's ``apply_cp_to_attention_module`` and
``prepare_context_parallel_input`` use it:

* the attention is one module per rank parallelized with torch's ``_ContextParallel`` plan
  (``parallelize_module``, SDPA, sequence dimension 2): its hooks turn ``q``, ``k``, ``v`` into
  DTensors sharded on the ``"cp"`` mesh dimension and back; the zoo's Llama calls
  ``F.scaled_dot_product_attention`` inline (torchtitan's has an ``inner_attention`` module),
  so while a capture runs that function routes each rank's calls to the rank's module (a
  thread-local choice: each fake rank is a thread, and autograd recomputes a checkpointed
  block on the thread that runs backward);
* torch's CP dispatcher (``_enable_context_parallel_dispatcher``) sends SDPA on those DTensors
  to torch's ring attention, ``_templated_ring_attention`` and
  ``_templated_ring_attention_backward``: the K/V exchanges per ring step with torch's
  rotaters (``_cp_options.rotate_method``: ``"allgather"``, torch's and torchtitan's default —
  one all-gather of K/V per attention forward and backward; ``"alltoall"`` — one
  ``permute_tensor`` per step) and the dK/dV rotation in backward (always all-to-all), each a
  functional collective issued asynchronously and waited for at the next step, the merge of
  partial results by log-sum-exp, and the round-robin load balancing for causal attention
  (``_HeadTailLoadBalancer``: rank r holds sequence chunks r and 2·cp − 1 − r);
* the inputs, targets and rotary tables are sharded with torch's ``_context_parallel_shard``
  and that load balancer (the tables as torchtitan's older ``freqs_cis`` CP buffer: sequence
  dimension 0);
* FSDP2 shards over the data-parallel and CP ranks together (torchtitan's ``dp_shard_cp``, a
  flattened mesh dimension, here ``"shard_cp"``): the CP ranks of a data-parallel rank train on
  the same batch, each on its sequence shard, and FSDP2's reduce-scatter averages their
  gradients; with ``"tp"`` innermost, torchtitan's TP plan first.

What is not torch's: torch registers ring-attention kernels for the CUDA SDPA ops only (flash,
memory-efficient, cuDNN); on CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``,
for which DTensor has no sharding rule ("does not have a sharding strategy registered").
:func:`cpu_ring_attention` registers, beside torch's, the same handler for the CPU kernel and
its backward: it unwraps the DTensors and calls torch's ``_templated_ring_attention`` /
``_templated_ring_attention_backward`` with the CPU kernel as the per-step op, exactly as
torch's handler does with the CUDA kernel. On the meta device SDPA would decompose into its
math, so the routed module runs the CPU kernel there (as :mod:`simddp.cosim.meta` does without
CP). The collectives are what torch issues; the per-step kernel is CPU's, costed by the
compute model as the GPU's (the same FLOPs: half for the causal first step, the full product
of the halves the load balancing leaves for the others).

Recorded as :func:`~simddp.cosim.capture_fsdp.capture_fsdp` records a step, with each
collective's mesh dimension told by its process group (``"cp"`` for the ring, ``"shard_cp"``
for FSDP2's; with one shard both have the same members) and, for the ring's collectives, the
compute offset where torch waited for each (``_maybe_wait`` at the next ring step), also where
it had ended by then. The activations are counted on a CP world of their own
(:func:`_cp_activation_bytes`): one rank's saved tensors, its sequence shard's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import warnings
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F

from fakepg.arguments import integer

from ..program.context import CapturedCP, CPMesh
from ..timing import Timing
from .capture import _batches, saved_bytes, state_bytes
from .capture_fsdp import (_dtype, _local_bytes, checkpoint_units, cosim_facts, fsdp_units,
                           outputs_not_modified_in_place, span_profile)
from .meta import DEVICES, fsdp_on_meta, functional_waits_on_meta, in_meta_scope
from .simulate import SimResult, issued, now, simulate
from .tensor_parallel import apply_tensor_parallel

__all__ = ["capture_cp", "cpu_ring_attention", "RingAttention", "apply_context_parallel",
           "shard_sequence", "ROTATE_METHODS", "long_context"]

ROTATE_METHODS = ("allgather", "alltoall")
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_MESH_ORDER = ("replicate", "shard", "cp", "tp")


def _torch_cp() -> Any:
    """torch's context-parallel module (``_context_parallel._attention`` since torch 2.9;
    ``tensor.experimental._attention`` before)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # pragma: no cover - older layout
        from torch.distributed.tensor.experimental import _attention  # type: ignore[no-redef]
    return _attention


def _load_balancer(seq_len: int, cp: int, device: str) -> Any:
    """torch's round-robin (head-tail) load balancer for causal attention, as torchtitan
    builds it for SDPA."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import \
            _HeadTailLoadBalancer
    except ImportError:  # pragma: no cover - older layout
        from torch.distributed.tensor.experimental._load_balancer import (  # type: ignore
            _HeadTailLoadBalancer)
    return _HeadTailLoadBalancer(seq_len, cp, device)


# -- the CPU kernel's ring attention: torch's templated ring with CPU's SDPA kernel ---------

def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``op``'s arguments by name (defaults filled in) from a dispatched call."""
    out: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _local(t: Any) -> Any:
    return getattr(t, "_local_tensor", t)


def _sequence_sharded(locals_: tuple, mesh: Any) -> tuple:
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in locals_)


def _check(a: dict[str, Any], op: str) -> Any:
    from torch.distributed.tensor import Shard

    q = a["query"]
    if tuple(q.placements) != (Shard(2),):
        raise NotImplementedError(f"{op} under context parallelism: q/k/v must be sharded on "
                                  f"the sequence dimension (Shard(2)), got {q.placements}")
    if a.get("attn_mask") is not None:
        raise NotImplementedError(f"{op} under context parallelism: an explicit attn_mask is "
                                  f"not supported by torch's ring attention (use is_causal)")
    return q.device_mesh


def _ring_forward(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    a = _bind(op_call, args, kwargs)
    mesh = _check(a, "SDPA")
    out = _ring(
        _torch_cp()._templated_ring_attention, mesh.get_group(), 2, _FWD, _local(a["query"]), _local(a["key"]), _local(a["value"]),
        is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=a["scale"])
    return _sequence_sharded(tuple(out[:2]), mesh)


def _ring_backward(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    a = _bind(op_call, args, kwargs)
    mesh = _check(a, "SDPA backward")
    grads = _ring(
        _torch_cp()._templated_ring_attention_backward, mesh.get_group(), 2, _BWD, grad_out=_local(a["grad_out"]), grad_out_name="grad_out",
        query=_local(a["query"]), key=_local(a["key"]), value=_local(a["value"]),
        out=_local(a["out"]), logsumexp=_local(a["logsumexp"]), is_causal=a["is_causal"],
        dropout_p=a["dropout_p"], scale=a["scale"])
    return _sequence_sharded(tuple(grads[:3]), mesh)


@contextlib.contextmanager
def cpu_ring_attention(rotate_method: str = "allgather") -> Iterator[None]:
    """While active (process-wide, for a whole fake world): torch's CP dispatcher is on
    (``_enable_context_parallel_dispatcher``, as torchtitan enables it and never disables it),
    with the CPU SDPA kernel and its backward sent to torch's templated ring attention beside
    the CUDA kernels torch sends there (see the module docstring), and torch's rotate method
    set (``set_rotate_method``); ``F.scaled_dot_product_attention`` routes the calls of a rank
    that runs under :func:`apply_context_parallel`'s context to its ring module (other calls
    are torch's SDPA). Everything is put back on exit."""
    from torch.distributed.tensor import DTensor

    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {', '.join(ROTATE_METHODS)} (torch's "
                         f"set_rotate_method), got {rotate_method!r}")
    cpa = _torch_cp()
    dispatcher = DTensor._op_dispatcher
    saved = (dispatcher._custom_op_handlers, dataclasses.replace(cpa._cp_options),
             getattr(cpa, "_dispatch_mode", None))
    try:
        cpa.set_rotate_method(rotate_method)
        cpa._enable_context_parallel_dispatcher()
        dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers,
                                          _FWD: _ring_forward, _BWD: _ring_backward}
        F.scaled_dot_product_attention = _routed_sdpa
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA
        with contextlib.suppress(Exception):
            cpa._disable_context_parallel_dispatcher()
        dispatcher._custom_op_handlers = saved[0]
        for f in dataclasses.fields(saved[1]):
            setattr(cpa._cp_options, f.name, getattr(saved[1], f.name))
        if saved[2] is not None:
            cpa._dispatch_mode = saved[2]


# -- the attention module torch's plan parallelizes, and the routing to it ---------------------

class RingAttention(torch.nn.Module):
    """Scaled dot-product attention as a module (torchtitan's ``inner_attention``), the module
    torch's ``_ContextParallel`` plan wraps. On the meta device it runs the kernel CPU runs
    (``_scaled_dot_product_flash_attention_for_cpu``), which SDPA would decompose there."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or enable_gqa:
            raise NotImplementedError("context parallelism: torch's ring attention takes "
                                      "is_causal, not attn_mask or enable_gqa")
        if query.device.type == "meta":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, scale=scale)[0]
        return _SDPA(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


_LOCAL = threading.local()  # .ring: this rank's RingAttention while it runs under CP


def _routed_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` while :func:`cpu_ring_attention` is active: the
    calling rank's ring module when it runs under context parallelism (its own call, on
    DTensors, goes to torch's SDPA), else torch's SDPA."""
    ring = getattr(_LOCAL, "ring", None)
    if ring is not None and args and not hasattr(args[0], "device_mesh"):
        return ring(*args, **kwargs)
    return _SDPA(*args, **kwargs)


_SDPA = F.scaled_dot_product_attention


class _Route:
    """The context a CP rank's steps run in: its SDPA calls go to ``module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._saved: list[Any] = []

    def __enter__(self) -> _Route:
        if F.scaled_dot_product_attention is not _routed_sdpa:
            raise RuntimeError("context parallelism on the fake cluster runs inside "
                               "cpu_ring_attention() (simddp.cosim.context_parallel): without "
                               "it the model's SDPA calls would not reach the ring")
        self._saved.append(getattr(_LOCAL, "ring", None))
        _LOCAL.ring = self.module
        return self

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.ring = self._saved.pop()


def apply_context_parallel(model: torch.nn.Module, cp_mesh: Any, seq_len: int,
                           load_balance: bool = True) -> contextlib.AbstractContextManager:
    """Context parallelism on ``model`` (a zoo Llama, or a module with ``rope`` tables and
    fused attention) over ``cp_mesh`` (1-D), as torchtitan applies it: a :class:`RingAttention`
    parallelized with torch's ``_ContextParallel`` plan, and the rotary tables (their first
    ``seq_len`` rows) sharded on the sequence with torch's load balancer. Returns the context
    the rank's steps run in (its SDPA calls routed to the ring): forward and backward, as
    torchtitan's train context holds both (a checkpointed block's recomputation runs in
    backward). Inputs are sharded with :func:`shard_sequence`. Runs inside
    :func:`cpu_ring_attention`."""
    from torch.distributed.tensor.parallel import parallelize_module

    cpa = _torch_cp()
    args = getattr(model, "args", None)
    if getattr(args, "attention", "sdpa") != "sdpa":
        raise ValueError("context parallelism shards torch's fused attention "
                         "(F.scaled_dot_product_attention); this model writes its attention "
                         "out (LlamaArgs.attention='reference'): use attention='sdpa'")
    rope = getattr(model, "rope", None)
    if rope is not None:
        if rope[0].shape[0] < seq_len:
            raise ValueError(f"the model's rotary tables hold {rope[0].shape[0]} positions, "
                             f"fewer than the sequence of {seq_len} tokens: raise "
                             f"max_seq_len (long_context)")
        model.rope = tuple(shard_sequence(cp_mesh, [t[:seq_len] for t in rope], seq_len,
                                          load_balance, seq_dim=0))
    ring = parallelize_module(RingAttention(), cp_mesh, cpa._ContextParallel(
        seq_dim=2, attention_type=cpa._ContextParallel.AttentionType.SDPA))
    return _Route(ring)


def shard_sequence(cp_mesh: Any, tensors: list[torch.Tensor], seq_len: int,
                   load_balance: bool = True, seq_dim: int = 1) -> list[torch.Tensor]:
    """``tensors`` sharded on ``seq_dim`` for this rank of ``cp_mesh`` with torch's
    ``_context_parallel_shard`` (and its head-tail load balancer for causal attention)."""
    cp = cp_mesh.size()
    if load_balance and seq_len % (2 * cp):
        raise ValueError(f"load-balanced context parallelism splits the sequence into 2 × cp = "
                         f"{2 * cp} chunks: {seq_len} tokens do not divide")
    if seq_len % cp:
        raise ValueError(f"context parallelism over {cp} ranks: {seq_len} tokens do not divide")
    lb = _load_balancer(seq_len, cp, tensors[0].device.type) if load_balance else None
    return list(_torch_cp()._context_parallel_shard(cp_mesh, tensors, [seq_dim] * len(tensors),
                                                    load_balancer=lb))


def long_context(scenario: Any, seq_len: int) -> Any:
    """A zoo Llama scenario at ``seq_len`` tokens per sequence, its rotary tables built for
    that many positions (``max_seq_len``): the zoo's Llama 3 defaults to 8,192."""
    from fakepg.zoo import llama as zoo_llama
    from fakepg.zoo.scenario import SeededBatches

    seq_len = integer("seq_len", seq_len, minimum=1)
    model = getattr(scenario, "model", None)
    args = getattr(model, "args", ())
    if not (isinstance(model, functools.partial) and model.func is zoo_llama.Llama and args):
        raise ValueError(f"long_context: {getattr(scenario, 'name', scenario)!r} is not a zoo "
                         f"Llama scenario (llama3-*)")
    largs = dataclasses.replace(args[0], max_seq_len=max(seq_len, args[0].max_seq_len))
    b = scenario.batches
    if not isinstance(b, SeededBatches) or "seq_len" not in b.kwargs:
        raise ValueError("long_context: the scenario's batches are not the zoo's token "
                         "sequences")
    return scenario.with_(model=functools.partial(zoo_llama.Llama, largs),
                          batches=dataclasses.replace(b, kwargs={**b.kwargs, "seq_len": seq_len}))


# -- the capture --------------------------------------------------------------------------------

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
        import torch.distributed._functional_collectives as funcol

        global _RECORDER
        cpa = _torch_cp()
        original = cpa._maybe_wait

        def maybe_wait(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(tensor, funcol.AsyncCollectiveTensor):
                self.waits[dist.get_rank()].append(now())
            return original(tensor)
        cpa._maybe_wait, _RECORDER = maybe_wait, self
        try:
            yield
        finally:
            cpa._maybe_wait, _RECORDER = original, None

    def ring_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(...)`` (torch's ring attention) with the collectives it issues noted."""
        import torch.distributed as dist

        first = issued()
        try:
            return fn(*args, **kwargs)
        finally:
            self.ring[dist.get_rank()].update(range(first, issued()))


_RECORDER: _RingRecorder | None = None


def _ring(fn: Any, *args: Any, **kwargs: Any) -> Any:
    rec = _RECORDER
    return fn(*args, **kwargs) if rec is None else rec.ring_call(fn, *args, **kwargs)


def _rank_run(scenario: Any, mesh_dims: Mapping[str, int], iterations: int,
              reshard_after_forward: bool, mp: tuple[str | None, str | None], device: str,
              load_balance: bool, sequence_parallel: bool, checkpointed: bool):
    last = iterations - 1

    def _run(rank: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from .capture import _train

        mesh = init_device_mesh("cpu", tuple(mesh_dims.values()),
                                mesh_dim_names=tuple(mesh_dims))
        with torch.device(device):
            model = scenario.build_model()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        cp, tp = mesh_dims["cp"], mesh_dims.get("tp", 1)
        if tp > 1:  # torchtitan: TP, then CP's attention, then FSDP2 over dp_shard × cp
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        local_param_bytes = _local_bytes(model)
        batches = _batches(scenario, rank // (cp * tp), dist.get_world_size() // (cp * tp),
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
        policy = MixedPrecisionPolicy(param_dtype=_dtype(mp[0]), reduce_dtype=_dtype(mp[1]))
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
        opt = scenario.optimizer(model.parameters())
        marks: dict[str, float] = {}

        def mark(i: int, phase: str) -> None:
            if i == last:
                marks[phase] = now()
        with route:
            _train(scenario, model, opt, batches, mark)
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
    bounds = {"forward": ("start", "backward"), "backward": ("backward", "backward_done"),
              "optimizer": ("backward_done", "end")}
    spans = [(s.start, s.end) for s in res.timeline.rank_spans(rank, ("wait",))]

    def offset(t0: float, t: float) -> float:  # compute since t0, waits excluded
        return (t - t0) - sum(max(0.0, min(e, t) - max(s, t0)) for s, e in spans)
    profile = {}
    for phase, (a, b) in bounds.items():
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
        batch = _batches(scenario, 0, 1, 1, device)[0]
        seq = _seq_len(batch)
        route = apply_context_parallel(model, mesh["cp"], seq, load_balance)
        batch = tuple(shard_sequence(mesh["cp"], list(batch[:2]), seq, load_balance))
        with route:  # checkpointed blocks measured unwrapped (saved_bytes)
            return saved_bytes(lambda: scenario.step(model, batch), device,
                               fsdp_units(model) if checkpointed else None, model.parameters())

    held, recompute = fakepg.spawn(in_meta_scope(device, run), nprocs=cp * tp).returns[0]
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
    recomputes each block's forward, its ring attention and collectives included). The other arguments as
    :func:`~simddp.cosim.capture_fsdp.capture_fsdp`'s."""
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
    _dtype(param_dtype), _dtype(reduce_dtype)
    timing = Timing() if timing is None else timing
    ring = _RingRecorder(nprocs)
    with (fsdp_on_meta() if device == "meta" else contextlib.nullcontext()), \
            (functional_waits_on_meta() if device == "meta" else contextlib.nullcontext()), \
            outputs_not_modified_in_place(), cpu_ring_attention(rotate_method):
        with ring.recording():
            res = simulate(_rank_run(scenario, dims, iterations, bool(reshard_after_forward),
                                     (param_dtype, reduce_dtype), device, bool(load_balance),
                                     bool(sequence_parallel), checkpointed),
                           (), nprocs, timing=timing, seed=seed)
        held, recompute = _cp_activation_bytes(scenario, dims, device, _dtype(param_dtype),
                                               bool(load_balance), bool(sequence_parallel),
                                               checkpointed)
    r0 = res.returns[0]
    cpmesh = CPMesh(nprocs, dims)
    return CapturedCP(
        name=str(getattr(scenario, "name", "scenario")), parallel="fsdp" if "replicate" not in
        dims else "hsdp", world_size=nprocs, mesh=dims,
        reshard_after_forward=bool(reshard_after_forward), param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        profiles=[_profile(res, r, o, cpmesh, ring) for r, o in enumerate(res.returns)],
        param_bytes=int(r0["param_bytes"]), local_param_bytes=int(r0["local_param_bytes"]),
        sequence_parallel=bool(sequence_parallel) if dims.get("tp", 1) > 1 else False,
        optimizer_state_bytes=int(r0["optimizer_state_bytes"]), activation_bytes=held,
        recompute_bytes=recompute, activation_checkpointing=checkpointed,
        seq_len=int(r0["seq_len"]), rotate_method=rotate_method,
        load_balance=bool(load_balance), device=device,
        **cosim_facts(timing, res, iterations - 1))
