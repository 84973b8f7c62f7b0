"""What a training step holds on a rank, measured on the fake cluster: the optimizer's state
(:func:`state_bytes`) and what autograd saves for backward (:func:`saved_bytes`;
:class:`SavedBytes` counts it, its temporaries when asked for). The captures
(:mod:`simddp.cosim.capture` and the other parallelisms') record these."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterable

import torch

from ..compat import is_traceable_wrapper_subclass
from .memtrace import LiveBytes
from .meta import fused_attention

__all__ = ["state_bytes", "SavedBytes", "SavedTotals", "saved_bytes"]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (DTensors: their local shard)."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):  # Adam's 0-dim step counts too
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """What autograd saves for backward while ``counting``: the bytes of the distinct
    storages of saved tensors that are not parameters (the activations) — nor views of
    ``params`` (a tensor-parallel linear saves its DTensor weight's transpose, a view of the
    local shard: a parameter's storage, not an activation's). Outside virtual time only: with
    saved-tensor hooks autograd runs extra ops (detaches) the compute model would charge."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.counting = False
        self._storages: dict[int, int] = {}
        # the storages counted, kept alive while counting: a key is a storage's address, which
        # a storage freed meanwhile (a graph branch the loss does not use) would hand on
        self._alive: list[Any] = []
        self._params: set[int] = set()
        for p in params:
            for t in _locals(p):
                self._params.add(_storage(t)[0])
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.counting or isinstance(t, torch.nn.Parameter):
            return t
        for local in _locals(t):
            key, nbytes = _storage(local)
            if key not in self._params and key not in self._storages:
                self._storages[key] = nbytes
                self._alive.append(local.untyped_storage())
        return t

    def add(self, t: torch.Tensor) -> None:
        """Count ``t`` as if autograd saved it (while ``counting``)."""
        self._pack(t)

    @property
    def storages(self) -> dict[int, int]:
        """Bytes per distinct storage counted so far (keys: storages, as told apart here)."""
        return dict(self._storages)

    @property
    def total(self) -> int:
        return sum(self._storages.values())


class SavedTotals(tuple):
    """(held, recompute) as :func:`saved_bytes` returns them, with ``sizes``: the bytes of
    each storage held, in the order autograd saved them (the allocations the caching
    allocator model replays), and ``temporary``: the most bytes live at once in the forward,
    loss and backward that are neither saved, nor parameters, nor their gradients (measured
    when asked for: :class:`~simddp.cosim.memtrace.LiveBytes`)."""

    sizes: tuple[int, ...]
    temporary: int

    def __new__(cls, held: int, recompute: int, sizes: tuple[int, ...] = (),
                temporary: int = 0) -> "SavedTotals":
        out = super().__new__(cls, (int(held), int(recompute)))
        out.sizes = tuple(int(n) for n in sizes)
        out.temporary = int(temporary)
        return out


def _locals(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or for a DTensor its rank's shard (its inner tensors)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
    return [x for i in inner if isinstance(i, torch.Tensor) for x in _locals(i)]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of ``t``'s storage: its ``StorageImpl``, which views share on any device
    (a meta tensor has one, without data; ``_base`` would miss views made below autograd, as
    DTensor's local ops are)."""
    st = t.untyped_storage()
    return st._cdata, st.nbytes()


def saved_bytes(forward: Callable[[], Any], device: str = "cpu",
                checkpointed: list[torch.nn.Module] | None = None,
                params: Iterable[torch.Tensor] = (), temporaries: bool = False,
                op_saved: bool = False) -> SavedTotals:
    """What autograd keeps for backward from ``forward()`` (a forward and, where it has one,
    its loss; outside virtual time: see :class:`SavedBytes`): (held from forward to backward,
    held only while one unit is recomputed in backward). Without ``checkpointed``: (all the
    saved bytes, 0). With it (the modules activation checkpointing wraps, measured here
    unwrapped): a checkpointed module keeps only its inputs until backward recomputes it, so
    the first figure is the distinct storages saved outside those modules together with their
    inputs (the hidden states each block receives, the rotary tables and mask they share, once),
    the second the largest module's saved bytes. ``params``: the model's parameters (never
    activations, whatever views of them autograd saves). ``temporaries``: also run the
    backward and measure the step's temporaries (``SavedTotals.temporary``). ``op_saved``: the
    modules run under torchtitan's op policy (selective-op), which also keeps, until backward,
    the outputs the policy saves (:class:`~simddp.cosim.checkpointing.OpSaved`)."""
    from .checkpointing import OpSaved

    params = list(params)
    saved = SavedBytes(params)
    inputs = SavedBytes()  # the checkpointed modules' tensor arguments, counted as saved ones
    inputs.counting = saved.counting = True
    inside: set[int] = set()  # storages saved inside a checkpointed module
    per_unit: list[int] = []
    before: list[set[int]] = [set()]
    handles = []

    ops = OpSaved(inputs.add) if op_saved else None

    def pre(mod: Any, args: Any) -> None:
        if ops is not None:
            ops.enter()
        before[0] = set(saved.storages)
        for a in args:
            if isinstance(a, torch.Tensor):
                inputs.add(a)

    def post(mod: Any, args: Any, out: Any) -> None:
        if ops is not None:
            ops.leave()
        now_saved = saved.storages
        new = set(now_saved) - before[0]
        inside.update(new)
        per_unit.append(sum(now_saved[k] for k in new))
    for unit in checkpointed or ():
        handles += [unit.register_forward_pre_hook(pre), unit.register_forward_hook(post)]
    live = LiveBytes(params) if temporaries else None
    temporary = 0
    # frees by reference count only: a cyclic collection at a moment that depends on what ran
    # before would move them (and the measured peak) from run to run
    gc_was_enabled = gc.isenabled()
    if live is not None:
        gc.disable()
    try:
        with saved, fused_attention(device), (ops or contextlib.nullcontext()), \
                (live or contextlib.nullcontext()):
            loss = forward()
            if live is not None and isinstance(loss, torch.Tensor) and loss.requires_grad:
                saved.counting = inputs.counting = False
                loss.backward()
        del loss
    finally:
        for h in handles:
            h.remove()
        if gc_was_enabled:
            gc.enable()
    if live is not None:
        keep = set(saved.storages) | set(inputs.storages) | \
            {_storage(g)[0] for p in params for g in _locals(p.grad) if p.grad is not None}
        temporary = live.peak_beyond(keep)
        for p in params:
            p.grad = None
    if not checkpointed:
        return SavedTotals(saved.total, 0, tuple(saved.storages.values()), temporary)
    held = {k: v for k, v in saved.storages.items() if k not in inside}
    held.update(inputs.storages)
    return SavedTotals(sum(held.values()), max(per_unit, default=0), tuple(held.values()),
                       temporary)
