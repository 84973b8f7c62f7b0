"""Races and timeouts in virtual time, worded for a person (simddp's semantics 4 and 5).

:class:`~simddp.cosim.clock.RankClock` decides *that* a rank raced or timed out; this module
says *what happened*: which collective, issued where, touched or waited for where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fakepg import ops
from fakepg.sites import user_site

from ..errors import CollectiveRaceError, CollectiveTimeoutError

if TYPE_CHECKING:
    from .clock import Flight, RankClock

__all__ = ["timeout_error", "race_error", "ptr"]

_Tensor = torch.Tensor


def ptr(t: _Tensor) -> int:
    """The tensor's storage address (0 without storage): which tensors a collective writes."""
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage (meta, some subclasses)
        return 0


def _optype(op: str) -> str:
    """c10d's OpType of ``op``, as NCCL's watchdog prints it."""
    try:
        return ops.get(op).nccl_optype
    except KeyError:
        return op.upper()


def _numel(xs: Any) -> int:
    n = 0
    for x in xs:
        if isinstance(x, (list, tuple)):
            n += _numel(x)
        elif isinstance(x, _Tensor):
            n += x.numel()
    return n


def timeout_error(r: RankClock, f: Flight, limit: float) -> CollectiveTimeoutError:
    """The error for rank ``r`` waiting on ``f``, which ends past ``limit`` seconds after its
    issue: NCCL's watchdog wording, then when the collective was issued and why it is late."""
    call, rec = f.call, f.call.record
    ms = int(round(limit * 1000))
    numel_in = _numel(call.inputs)
    numel_out = _numel(call.outputs) or numel_in
    coll = call.collective
    last = ""
    if coll is not None:
        members = [c for c in coll.members() if c.ext is not None]
        if members:
            late = max(members, key=lambda c: c.ext.issue)
            last = (f"; it could start only at t={f.start:.6f} s, when its last member, "
                    f"rank {late.rank}, issued it at {late.site}")
    end = f.eff_end()
    msg = (f"[Rank {r.rank}] Watchdog caught collective operation timeout: "
           f"WorkFakePG(SeqNum={rec.seq + 1}, OpType={_optype(rec.op)}, "
           f"NumelIn={numel_in}, NumelOut={numel_out}, Timeout(ms)={ms}) ran for {ms} "
           f"milliseconds before timing out.\n"
           f"simddp (virtual time): {f.describe()} was issued by rank {r.rank} at "
           f"t={f.issue:.6f} s at {call.site} and would end at t={end:.6f} s, "
           f"{end - f.issue:.3f} s later, past the timeout of {limit:g} s{last}.")
    return CollectiveTimeoutError(msg, rank=r.rank, op=rec.op, group=rec.group, seq=rec.seq,
                                  timeout=limit, time=f.issue + limit)


def race_error(r: RankClock, f: Flight, func: Any, args: tuple, kwargs: Any,
               tensor: _Tensor) -> CollectiveRaceError:
    """The error for rank ``r``'s op ``func`` touching ``tensor``, which ``f`` still writes."""
    call, rec = f.call, f.call.record
    where = user_site()
    verb = "writes" if _writes(func, args, kwargs, tensor) else "reads"
    coll = call.collective
    if f.end is None:
        missing = coll.missing_ranks() if coll is not None and not coll.p2p else []
        state = (f"not every member has issued it yet (missing: ranks {missing})" if missing
                 else "it has not been matched yet")
    else:
        state = f"it runs until t={f.eff_end():.6f} s"
    name = getattr(getattr(func, "_schema", None), "name", str(func))
    msg = (f"rank {r.rank}: {name} at {where} {verb} a tensor that {f.describe()} is still "
           f"writing, with no wait() on that work first.\n"
           f"  the collective was issued with async_op=True at {call.site} (t={f.issue:.6f} s); "
           f"{state}, and the rank's clock is t={r.clock:.6f} s.\n"
           f"  Call work.wait() (or work.get_future().wait()) before touching its tensors.")
    return CollectiveRaceError(msg, rank=r.rank, op=rec.op, group=rec.group, seq=rec.seq,
                               issued_at=call.site, accessed_at=where, time=r.clock)


def _writes(func: Any, args: tuple, kwargs: Any, tensor: _Tensor) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    p = ptr(tensor)
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        vs = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, _Tensor) and ptr(x) == p for x in vs):
            return True
    return False
