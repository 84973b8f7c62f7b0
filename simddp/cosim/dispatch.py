"""The per-rank dispatch mode that charges every aten op to the rank's virtual clock.

The hot path of co-simulation: it runs for every op every rank executes, so it reads the
clock's fields directly (see :class:`~simddp.cosim.clock.RankClock`) and finds an op's cost
without calling the compute model whenever it can (:func:`classify`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..compat import (TorchDispatchMode, current_graph_task_id, fake_tensor_class,
                      is_traceable_wrapper_subclass_type)
from ..models.compute import ConstantCompute, RooflineCompute
from ..models.kernels import moves_no_data
from .clock import (CALL, EMPTY, FREE, MEMO, TICK, BWD, FWD, RankClock,
                    FREE_PACKETS)

_floor = math.floor  # (cheaper than int() for a float)
_gtid = current_graph_task_id

__all__ = ["ClockMode", "classify"]

_DATA_DEPENDENT: set = set()  # ops whose output's shape or value depends on data: no tape
_TAGGED: set = set()
_DATA_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def data_dependent(op: Any, func: Any) -> bool:
    """Whether ``func`` (``op`` its C++ operator) may return a shape or value that depends on
    the data (torch's tags): a backward running it is charged per-op, never from a tape."""
    _TAGGED.add(op)
    if any(t in _DATA_TAGS for t in getattr(func, "tags", ())):
        _DATA_DEPENDENT.add(op)
        return True
    return False

_Tensor = torch.Tensor
# Classes whose shape and dtype are all the memo key needs (flat key); other tensors and
# non-tensor arguments take the nested key, marked so that the two forms never compare equal.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_NESTED = object()


def classify(compute: Any, func: Any) -> Any:
    """How the per-op path finds ``func``'s cost without calling the model when it can:
    a constant (ConstantCompute; data-free ops under the roofline), a memo keyed by the
    shapes and dtypes of the output and tensor arguments and the other arguments (the
    roofline's cost is a function of those alone; ops with list arguments or kwargs fall
    back), or a call of ``op_time`` (other models, which may depend on anything)."""
    if getattr(func, "_overloadpacket", None) in FREE_PACKETS:
        return FREE
    c = compute
    if type(c) is ConstantCompute:
        return float(c.seconds_per_op)
    if type(c) is RooflineCompute:
        if moves_no_data(func):
            return float(c.op_time(func, (), {}, None))
        return MEMO  # a function of argument shapes, dtypes and scalars
    return CALL


_SUBCLASS_KIND: dict[tuple, str] = {}  # the ``types`` of an op's tensor subclasses -> kind


def _subclass_kind(types: tuple) -> str:
    """How the clock treats an op on tensor subclasses: ``"fake"`` (a FakeTensor: shape
    propagation, e.g. DTensor's sharding propagator — no device work, not charged), ``"wrapper"``
    (a wrapper subclass such as DTensor or funcol's AsyncCollectiveTensor, whose shapes are
    global: the clock declines it and charges the ops on the local tensors its
    ``__torch_dispatch__`` runs), else ``"plain"``."""
    kind = _SUBCLASS_KIND.get(types)
    if kind is None:
        FakeTensor = fake_tensor_class()
        if any(issubclass(t, FakeTensor) for t in types):
            kind = "fake"
        elif any(is_traceable_wrapper_subclass_type(t) for t in types):
            kind = "wrapper"
        else:
            kind = "plain"
        _SUBCLASS_KIND[types] = kind
    return kind


class ClockMode(TorchDispatchMode):
    """Charges every aten op to its rank's virtual clock. Kept lean: it runs for every op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # no torch._disable_dynamo wrapper per call (~3 µs)
        return False

    def __init__(self, r: RankClock) -> None:
        super().__init__()
        self.r = r

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types:  # tensor subclasses (DTensor: FSDP2's sharded parameters, TP)
            kind = _subclass_kind(tuple(types))
            if kind == "wrapper":
                return NotImplemented
            if kind == "fake":
                return func(*args, **(kwargs or {}))
        r = self.r
        side = r.access(func, args, kwargs or EMPTY) if r.watched else None
        op = func._op  # the C++ operator: hashed in C (OpOverload.__hash__ is Python)
        if kwargs:
            out = op(*args, **kwargs)
        else:
            kwargs = EMPTY
            out = op(*args)
        cost = r.costs.get(op)
        if cost is None:
            cost = r.costs[op] = r.const_entry(func, classify(r.sim.timing.compute, func))
        if cost.__class__ is not str:  # a constant's entry
            q = cost
        elif cost is MEMO and not kwargs:
            try:  # the key: flat for plain tensors (cheaper to build and hash), else nested
                n = len(args)
                a = args[0] if n else None
                if a.__class__ not in _PLAIN or n > 3:
                    key = None
                elif n == 1:
                    key = (op, out.shape, out.dtype, a.shape, a.dtype)
                elif n == 2:
                    b = args[1]
                    if b.__class__ in _PLAIN:
                        key = (op, out.shape, out.dtype, a.shape, a.dtype, b.shape, b.dtype)
                    elif not isinstance(b, _Tensor):  # a scalar (its own length: no clash)
                        key = (op, out.shape, out.dtype, a.shape, a.dtype, b)
                    else:
                        key = None
                else:
                    a, b, c = args
                    key = ((op, out.shape, out.dtype, a.shape, a.dtype, b.shape, b.dtype,
                            c.shape, c.dtype)
                           if b.__class__ in _PLAIN and c.__class__ in _PLAIN else None)
                if key is None:
                    key = (op, _NESTED, out.shape, out.dtype,
                           *[(a.shape, a.dtype) if isinstance(a, _Tensor) else a for a in args])
                q = r.memo[key]
            except KeyError:
                q = r.memo_entry(key, func, args, out)
            except (TypeError, AttributeError):  # unhashable args, non-tensor out: never again
                r.costs[op] = CALL
                q = r.call_entry(func, r.cost(func, args, kwargs, out))
        elif cost is FREE:
            return out
        else:
            q = r.cost(func, args, kwargs, out)
            if r.noise is None:
                try:
                    q = _floor(q * r.per_s)
                except (TypeError, ValueError, OverflowError):
                    raise r.bad_cost(func, q) from None
            else:
                try:
                    q = r.call_entries[(func, q)]
                except (KeyError, TypeError):
                    q = r.call_entry(func, q)
        rec = r.rec_ops
        if rec is not None:  # a backward being recorded for the coarse path (see tape)
            rec.append(q)
            if op in _DATA_DEPENDENT or op not in _TAGGED and data_dependent(op, func):
                r.rec.clean = False
        noise = r.noise
        if noise is not None:  # q is (ticks, stream, stride): take the stream's next factor
            q, st, k = q
            i = st[0]
            st[0] = (i + k) & 0xFFFF  # _OP_NOISE_MASK
            q = _floor(q * noise[i])
        if side is not None:
            r.side_op(side, q * TICK)
            return out
        ph = r.override
        if ph is None:
            g = _gtid()
            if g == -1:
                ph = FWD
            else:
                ph = BWD
                if g != r.gtid:
                    r.new_graph_task(g)
        if ph != r.phase:
            r.switch(ph)
        r.ticks += q  # the clock advances (exactly: see _PER_S)
        return out


class FaultClockMode(ClockMode):
    """ClockMode for a rank with ``slow_rank`` faults: before each op, a clock outside the
    current fault window re-reads the rank's slowdown (only such ranks pay the check)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        r = self.r
        t = r.base + r.ticks * TICK
        if t < r.fault_lo or t >= r.fault_hi:
            r.apply_faults()
        return ClockMode.__torch_dispatch__(self, func, types, args, kwargs)
