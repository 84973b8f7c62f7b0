"""torch's context parallelism on the fake cluster's CPU and meta ranks: its ring attention
(``torch.distributed.tensor.experimental``: the ``_ContextParallel`` plan, the templated ring
attention and its rotaters, the causal load balancer) run as torchtitan runs it, for
:mod:`simddp.cosim.context_parallel`'s capture.

What is torch's, as torchtitan's ``apply_cp_to_attention_module`` and
``prepare_context_parallel_input`` use it:

* the attention is one module per rank (:class:`RingAttention`, torchtitan's
  ``inner_attention``) parallelized with torch's ``_ContextParallel`` plan (SDPA, sequence
  dimension 2): its hooks turn ``q``, ``k``, ``v`` into DTensors sharded on the CP mesh
  dimension and back;
* torch's CP dispatcher (``_enable_context_parallel_dispatcher``) sends SDPA on those DTensors
  to torch's ``_templated_ring_attention`` and ``_templated_ring_attention_backward``: the K/V
  exchanges with torch's rotaters (``_cp_options.rotate_method``: ``"allgather"``, torch's
  and torchtitan's default — one all-gather of K/V per attention forward and backward;
  ``"alltoall"`` — one ``permute_tensor`` per ring step) and backward's dK/dV rotation (always
  all-to-all), each a functional collective issued asynchronously and waited for at the next
  step, the merge of partial results by log-sum-exp, and round-robin load balancing for causal
  attention (``_HeadTailLoadBalancer``: rank r holds sequence chunks r and 2·cp − 1 − r);
* inputs, targets and rotary tables are sharded with torch's ``_context_parallel_shard`` and
  that load balancer (:func:`shard_sequence`; the tables as torchtitan's older ``freqs_cis``
  CP buffer, sequence dimension 0).

What is not torch's:

* torch registers ring attention for the CUDA SDPA kernels only (flash, memory-efficient,
  cuDNN); on CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, for which
  DTensor has no sharding rule ("does not have a sharding strategy registered").
  :func:`cpu_ring_attention` registers, beside torch's, the same handler for that kernel and
  its backward: it unwraps the DTensors and calls torch's templated ring with the CPU kernel
  as the per-step op, as torch's handler does with the CUDA kernel. On the meta device SDPA
  would decompose into its math, so :class:`RingAttention` runs the CPU kernel there (as
  :mod:`simddp.cosim.meta` does without CP). The per-step kernel is CPU's, costed by the
  compute model as the GPU's (the same FLOPs);
* the zoo's Llama calls ``F.scaled_dot_product_attention`` inline, so while
  :func:`cpu_ring_attention` is active that function routes the calls of a rank running under
  :func:`apply_context_parallel`'s context to the rank's :class:`RingAttention` — a per-thread
  choice: each fake rank is a thread, and autograd recomputes a checkpointed block on the
  thread that runs backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ..compat import context_parallel_module, dtensor_op_dispatcher, head_tail_load_balancer


__all__ = ["cpu_ring_attention", "RingAttention", "apply_context_parallel", "shard_sequence",
           "observing_ring", "torch_cp", "ROTATE_METHODS"]

ROTATE_METHODS = ("allgather", "alltoall")
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def torch_cp() -> Any:
    """torch's context-parallel module (:func:`simddp.compat.context_parallel_module`)."""
    return context_parallel_module()


def _load_balancer(seq_len: int, cp: int, device: str) -> Any:
    """torch's round-robin (head-tail) load balancer for causal attention, as torchtitan
    builds it for SDPA."""
    return head_tail_load_balancer(seq_len, cp, device)


# what a capture observes of the ring (simddp.cosim.context_parallel): None, or an object whose
# ring_call(fn, *args, **kwargs) runs torch's ring attention
_OBSERVER: Any = None


@contextlib.contextmanager
def observing_ring(observer: Any) -> Iterator[None]:
    """While active (process-wide), torch's ring attention runs as
    ``observer.ring_call(fn, *args, **kwargs)``: a capture notes the collectives it issues."""
    global _OBSERVER
    saved, _OBSERVER = _OBSERVER, observer
    try:
        yield
    finally:
        _OBSERVER = saved


def _ring(fn: Any, *args: Any, **kwargs: Any) -> Any:
    obs = _OBSERVER
    return fn(*args, **kwargs) if obs is None else obs.ring_call(fn, *args, **kwargs)


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
    out = _ring(torch_cp()._templated_ring_attention, mesh.get_group(), 2, _FWD,
                _local(a["query"]), _local(a["key"]), _local(a["value"]),
                is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=a["scale"])
    return _sequence_sharded(tuple(out[:2]), mesh)


def _ring_backward(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    a = _bind(op_call, args, kwargs)
    mesh = _check(a, "SDPA backward")
    grads = _ring(torch_cp()._templated_ring_attention_backward, mesh.get_group(), 2, _BWD,
                  grad_out=_local(a["grad_out"]), grad_out_name="grad_out",
                  query=_local(a["query"]), key=_local(a["key"]), value=_local(a["value"]),
                  out=_local(a["out"]), logsumexp=_local(a["logsumexp"]),
                  is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=a["scale"])
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
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {', '.join(ROTATE_METHODS)} (torch's "
                         f"set_rotate_method), got {rotate_method!r}")
    cpa = torch_cp()
    dispatcher = dtensor_op_dispatcher()
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

    cpa = torch_cp()
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
                             f"max_seq_len (simddp.jobs.resolve_model(..., seq_len=...) "
                             f"does; simddp whatif --seq-len)")
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
    return list(torch_cp()._context_parallel_shard(cp_mesh, tensors, [seq_dim] * len(tensors),
                                                    load_balancer=lb))
