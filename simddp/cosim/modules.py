"""The coarse path for module calls: forward passes of torch.nn's own layers, from tapes.

A call of a module whose whole tree is made of torch.nn classes listed in :data:`PURE`
(``Sequential``, ``Linear``, activations, ``LayerNorm``, ``Dropout``, ``Embedding`` …: their
``forward`` runs the same ops for the same arguments' layout) is a segment of
:mod:`simddp.cosim.tape`: keyed by the tree (each module's class, identity, ``training``
and the attributes that change what it does; every parameter's and buffer's layout), the
tensor arguments' layout, and the grad/inference/autocast modes; recorded per-op, and once two
recordings agree, replayed with the rank's ClockMode off. Not coarse: modules with hooks (or
any global module hook), keyword arguments, non-tensor arguments, a torch function mode, a
module called inside backward, an optimizer step or a future callback — and everything
:func:`simddp.cosim.tape.eligible` refuses (faults, collectives in flight, other models).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.nn.parallel import DistributedDataParallel as _DDP

from ..compat import is_torch_function_mode_enabled
from . import tape
from .clock import FWD, current

__all__ = ["PURE", "install", "uninstall"]

# Exact classes, and the attributes besides parameters, buffers, children and ``training``
# that change which ops their forward runs or with which arguments.
PURE: dict[type, tuple[str, ...]] = {
    nn.Sequential: (), nn.Linear: (), nn.Identity: (), nn.Tanh: (), nn.Sigmoid: (),
    nn.ReLU: ("inplace",), nn.SiLU: ("inplace",), nn.GELU: ("approximate",),
    nn.LeakyReLU: ("negative_slope", "inplace"), nn.Dropout: ("p", "inplace"),
    nn.Flatten: ("start_dim", "end_dim"),
    nn.LayerNorm: ("normalized_shape", "eps", "elementwise_affine"),
    nn.Embedding: ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
}
_TENSORS = (torch.Tensor, nn.Parameter)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks",
                 "_global_forward_hooks_always_called")


def _tree(m: nn.Module, out: list, leaves: list) -> None:
    """Append ``m``'s part of the key (its subtree); raise tape.Ineligible if not pure."""
    names = PURE.get(m.__class__)
    if names is None or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks \
            or m._backward_pre_hooks:
        raise tape.Ineligible
    out.append((m.__class__, id(m), m.training, *[getattr(m, a) for a in names]))
    for ts in (m._parameters, m._buffers):
        for p in ts.values():
            if p is None:
                out.append(None)
            else:
                out.append(tape.t_meta(p))
                if p.requires_grad:
                    leaves.append(p)
    for c in m._modules.values():
        if c is None:
            out.append(None)
        else:
            _tree(c, out, leaves)


def _key(m: nn.Module, args: tuple, leaves: list) -> tuple:
    if any(getattr(_module, h, None) for h in _GLOBAL_HOOKS) \
            or is_torch_function_mode_enabled():
        raise tape.Ineligible
    key: list = ["module", torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                 torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")]
    for a in args:
        if a.__class__ not in _TENSORS:
            raise tape.Ineligible
        key.append(tape.t_meta(a))
    _tree(m, key, leaves)
    return tuple(key)


def _call(orig: Any, m: nn.Module, args: tuple, kwargs: dict) -> Any:
    r = current()
    if r is None:
        return orig(m, *args, **kwargs)
    if m.__class__ not in PURE:
        if isinstance(m, _DDP):  # what its Reducer will do in the next backward
            r.fwd_context.append((id(m), m.require_backward_grad_sync,
                                  m.require_forward_param_sync))
        return orig(m, *args, **kwargs)
    if kwargs or not tape.eligible(r):
        return orig(m, *args, **kwargs)
    leaves: list = []
    try:
        key = _key(m, args, leaves)
        hash(key)
    except (tape.Ineligible, TypeError):
        return orig(m, *args)
    out = tape.segment(r, key, lambda: orig(m, *args), FWD)
    done = r.tapes.get(key)
    if done is not None and done.confirmed and out.__class__ in _TENSORS \
            and out.grad_fn is not None and len(set(map(id, leaves))) == len(leaves):
        tape.note_subgraph(r, out, key, leaves, args)
    return out


def _routed_call(orig: Any) -> Any:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _call(orig, self, args, kwargs)
    return call


# Routes module calls through :func:`_call` while any simulation runs.
_CALLS = tape.SharedPatch(nn.Module, "__call__", _routed_call)
install, uninstall = _CALLS.install, _CALLS.uninstall
