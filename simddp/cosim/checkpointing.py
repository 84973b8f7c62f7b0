"""Activation checkpointing as torchtitan applies it, run for real through torch's checkpoint
API: the one place the captures (FSDP2, TP, pipeline stages) wrap blocks.

Policies (``--activation-checkpointing``; torchtitan's ``activation_checkpoint.mode`` and
``selective_ac_option``):

* ``full`` — every block under ``checkpoint_wrapper`` (non-reentrant): a block keeps only its
  input until backward recomputes its forward;
* ``selective-layer:N`` — every N-th block (the N-th, 2N-th, ... of each block list, counted
  from 1 as torchtitan's ``_apply_layer_sac`` counts), the others keep all they save;
* ``selective-op`` — every block under ``checkpoint_wrapper`` with torch's
  ``create_selective_checkpoint_contexts`` and torchtitan's op policy: the outputs of matmuls
  (all but every second ``aten.mm``), fused attention and reduce-scatters are saved
  (``MUST_SAVE``), everything else is recomputed (``PREFER_RECOMPUTE``). CPU and meta captures
  run attention as ``_scaled_dot_product_flash_attention_for_cpu``, saved as the GPU kernels
  are.

What a policy keeps for backward is counted by :func:`~simddp.cosim.capture.saved_bytes`:
:func:`checkpointed_modules` says which blocks a policy wraps and :class:`OpSaved` records what
the op policy saves inside them.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from ..compat import TorchDispatchMode, checkpoint_wrapper

from .meta import fused_attention

__all__ = ["policy_name", "checkpointed_modules", "apply", "is_op", "OpSaved", "SAVE_LIST"]


def _ops(*names: str) -> frozenset:
    found = set()
    for name in names:
        ns, _, rest = name.partition(".")
        op = getattr(torch.ops, ns)
        for part in rest.split("."):
            op = getattr(op, part, None)
            if op is None:
                break
        if op is not None:
            found.add(op)
    return frozenset(found)


# torchtitan's _save_list (op SAC), with CPU's fused attention for captures off the GPU
SAVE_LIST = _ops("aten.mm.default", "aten._scaled_dot_product_efficient_attention.default",
                 "aten._scaled_dot_product_flash_attention.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "_c10d_functional.reduce_scatter_tensor.default")
_MM = torch.ops.aten.mm.default


def policy_name(value: Any) -> str | None:
    """A policy as the captures take it: None (no checkpointing) for False/None/"none",
    "full" for True (the flag before policies existed), else the policy's name, checked."""
    if value is None or value is False or value == "none":
        return None
    if value is True:
        return "full"
    text = str(value).strip().lower()
    name, _, every = text.partition(":")
    if text in ("full", "selective-op") or (name == "selective-layer" and every.isdigit()
                                            and int(every) >= 1):
        return text
    raise ValueError(f"activation checkpointing {value!r}: give full, selective-op, "
                     f"selective-layer:N (every N-th block, N >= 1) or none")


def is_op(policy: Any) -> bool:
    return policy_name(policy) == "selective-op"


def checkpointed_modules(blocks: list[torch.nn.Module], policy: Any
                         ) -> list[torch.nn.Module]:
    """The blocks ``policy`` wraps, in order (all of them but under ``selective-layer:N``)."""
    name = policy_name(policy)
    if name is None:
        return []
    if name.startswith("selective-layer:"):
        every = int(name.partition(":")[2])
        return [b for i, b in enumerate(blocks, start=1) if i % every == 0]
    return list(blocks)


def _op_policy() -> Callable[..., Any]:
    """torchtitan's op-SAC policy for one block call: save the save list's outputs, but every
    second mm (counted separately in forward and in the recomputation)."""
    from torch.utils.checkpoint import CheckpointPolicy

    count: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func is _MM:
            count[mode] += 1
        save = func in SAVE_LIST and not (func is _MM and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class _Both:
    """Two context managers as one (SAC's recomputation mode and the meta attention mode)."""

    def __init__(self, *managers: Any) -> None:
        self.managers, self.stack = managers, contextlib.ExitStack()

    def __enter__(self) -> None:
        for m in self.managers:
            self.stack.enter_context(m)

    def __exit__(self, *exc: Any) -> Any:
        return self.stack.__exit__(*exc)


def apply(blocks: torch.nn.ModuleList, policy: Any, device: str = "cpu") -> None:
    """Wrap ``blocks`` (in place) as ``policy`` says, under torch's ``checkpoint_wrapper``
    (non-reentrant, as torchtitan). On the meta device a block's recomputation in backward runs
    under :class:`~simddp.cosim.meta.FusedAttentionOnMeta` as its forward did: backward is a
    torch function, and a torch-function mode is off while it handles one, so the forward's
    mode does not reach the recomputation (which would then save other tensors than the
    forward, an error for checkpointing)."""
    name = policy_name(policy)
    if name is None:
        return
    wrapped = {id(b) for b in checkpointed_modules(list(blocks), name)}
    if name == "selective-op":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        def context_fn() -> tuple[Any, Any]:
            forward, recompute = create_selective_checkpoint_contexts(_op_policy())
            if device == "meta":
                recompute = _Both(recompute, fused_attention(device))
            return forward, recompute
        kwargs: dict[str, Any] = {"context_fn": context_fn}
    elif device == "meta":
        kwargs = {"context_fn": lambda: (contextlib.nullcontext(), fused_attention(device))}
    else:
        kwargs = {}
    for i, block in enumerate(blocks):
        if id(block) in wrapped:
            blocks[i] = checkpoint_wrapper(block, **kwargs)


class OpSaved(TorchDispatchMode):
    """While active, inside the modules it is told about (``enter``/``leave``), hands
    ``record`` each tensor the op policy saves (what the SAC cache holds until backward)."""

    def __init__(self, record: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.record = record
        self.inside = 0
        self._count = 0

    def enter(self, *_: Any) -> None:
        self.inside += 1
        self._count = 0

    def leave(self, *_: Any) -> None:
        self.inside -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.inside and func in SAVE_LIST:
            if func is _MM:
                self._count += 1
            if not (func is _MM and self._count % 2 == 0):
                for t in _tensors(out):
                    self.record(t)
        return out


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
