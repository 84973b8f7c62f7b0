"""The coarse path for optimizer steps: a step of torch.optim's own optimizers, from tapes.

An (outermost) ``step()`` of an optimizer whose class is in :data:`PURE` is a segment of
:mod:`simddp.cosim.tape`, bracketed by simulate's global step hooks (it cannot be wrapped:
the hooks run inside torch's own wrapper). Its key: the optimizer (class, identity), each
group's hyperparameters, every parameter's layout, its ``.grad``'s layout (or None) and its
state's (tensors by layout, other values as they are). Optimizers whose step reads a tensor's
value (Adam's step count, via ``.item()``) record unclean tapes (data-dependent ops) and stay
per-op. A step that raises while being replayed leaves the replay open: the next event, step
or the rank's end finds it and the world is rerun per-op (:class:`tape.Divergence`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..compat import pop_torch_dispatch_stack, push_on_torch_dispatch_stack
from . import tape

if TYPE_CHECKING:
    from .clock import RankClock

__all__ = ["PURE", "begin", "end", "abandon"]

_optim = torch.optim
PURE = frozenset({_optim.SGD, _optim.Adam, _optim.AdamW, _optim.Adagrad, _optim.RMSprop})
OPT = 2  # clock.OPT


def _value(v: Any) -> Any:
    c = v.__class__
    if c in tape.SCALARS:
        return (c, v)
    if c in tape.TENSORS:
        return tape.t_meta(v)
    if c is tuple or c is list:
        return (c, *[_value(x) for x in v])
    raise tape.Ineligible


def _key(opt: Any, args: Any, kwargs: Any) -> tuple:
    if len(args) > 1 or kwargs or type(opt) not in PURE or opt._optimizer_step_pre_hooks \
            or opt._optimizer_step_post_hooks:
        raise tape.Ineligible  # a closure (args: self, closure): arbitrary code; hooks: idem
    key: list = ["step", type(opt), id(opt)]
    state = opt.state
    for group in opt.param_groups:
        key.append(tuple([(k, _value(v)) for k, v in group.items() if k != "params"]))
        for p in group["params"]:
            g = p.grad
            s = state.get(p)
            key.append((tape.t_meta(p), None if g is None else tape.t_meta(g),
                        None if not s else tuple([(k, _value(v)) for k, v in s.items()])))
    return tuple(key)


def begin(r: "RankClock", opt: Any, args: Any, kwargs: Any) -> None:
    """Called as an outermost step starts (its span opened): record it, or replay it."""
    if not tape.eligible_in(r, OPT):
        return
    try:
        key = _key(opt, args, kwargs)
        hash(key)
    except (tape.Ineligible, TypeError):
        return
    found = r.tapes.get(key, False)
    if found is None:
        return
    if found is not False and found.confirmed:
        r.play = tape.Player(found, OPT)
        r.popped = pop_torch_dispatch_stack(None)
    else:
        r.rec = tape.Recorder()
        r.rec_ops = r.rec.ops
        r.step_rec = (key, found or None)


def end(r: "RankClock") -> None:
    """Called as an outermost step ends, before its span closes."""
    if r.popped is not None:
        push_on_torch_dispatch_stack(r.popped)
        r.popped = None
        play, r.play = r.play, None
        if play.i != len(play.tape.events):
            raise tape.diverged_at(r, "ended an optimizer step early")
        play.charge(r, play.tape.tail)
    elif r.step_rec is not None:
        (key, prev), r.step_rec = r.step_rec, None
        rec, r.rec, r.rec_ops = r.rec, None, None
        tape.store(r, key, prev, rec)


def abandon(r: "RankClock") -> None:
    """The rank ends: a step's replay left open (it raised) means a rerun per-op."""
    if r.popped is not None:
        push_on_torch_dispatch_stack(r.popped)
        r.popped = None
        r.play = None
        r.sim.diverged = True
    r.rec = r.rec_ops = r.step_rec = None
