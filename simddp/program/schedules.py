"""Pipeline schedules as torch runs them: per pipeline rank, its actions in program order.

The compute order comes from torch's own schedule classes
(``torch.distributed.pipelining.schedules``), never re-derived here; the p2p placement follows
what each class's ``_step_microbatches`` does at run time:

* multi-stage schedules (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
  ``ZBVZeroBubble``, ``DualPipeV`` …) run ``_PipelineScheduleRuntime._step_microbatches`` on
  the lowered list (``pipeline_order_with_comms``, as torch's
  ``_schedule_visualizer.get_schedule_ops(..., with_comms=True)`` builds it): ``RECV_F/RECV_B``
  post a receive; ``F``, ``B`` and ``I`` wait for their receive right before computing;
  ``SEND_F/SEND_B`` are issued after the compute and waited for only at the end of the step;
  two adjacent stages on one rank (V-shaped schedules) hand over locally, without p2p;
  ``OVERLAP_F_B`` runs its sub-actions in order;
* single-stage schedules (``GPipe``, ``1F1B``: ``PipelineScheduleSingle``) do not run a
  lowered list: their ``_step_microbatches`` posts each receive right before the compute that
  needs it and waits for it at once; GPipe waits for all forward sends before the first
  backward; 1F1B fuses a forward send with the next backward receive (and a backward send with
  the next forward receive) in one ``batch_isend_irecv`` that it waits for as a whole, and waits
  for the previous send after each warm-up forward and cool-down backward. That is what is
  listed here, with the compute order of the class's ``pipeline_order``.

FSDP2's actions are kept where torch runs them: multi-stage schedules' lowered lists carry
``UNSHARD`` (the stage's all-gathers, issued asynchronously; the stage's next compute waits for
them), ``RESHARD`` and ``REDUCE_GRAD`` (``perform_reduce_grad``: the reduce-scatters after the
stage's last backward) as ops ``unshard``/``reshard`` (``mb``: the stage's k-th of the step) and
``reduce_grad``; single-stage schedules call ``perform_reduce_grad`` at the very end of their
``_step_microbatches``, after every send is waited for, and unshard inside the first forward.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

__all__ = ["schedule_name", "Op", "schedule_ops", "schedule_class", "SCHEDULES", "stage_ranks"]

# torch 2.13's names, as get_schedule_class takes them (case-insensitive)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")


class Op(NamedTuple):
    """One step of a rank's program. ``kind``: a compute action ``F``, ``B``, ``I``, ``W``, an
    FSDP action ``unshard``, ``reshard``, ``reduce_grad``, or a p2p step ``post``, ``wait`` (a
    receive), ``send``, ``wait_send``; ``what``: for p2p, the
    message, ``F`` (activations to stage + 1) or ``B`` (gradients to stage − 1); ``stage``:
    for compute the stage computing, for p2p the stage that *sends* the message; ``mb``: the
    microbatch."""

    kind: str
    stage: int
    mb: int
    what: str = ""


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name`` (a ValueError naming the accepted names)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, \
        PipelineScheduleSingle, get_schedule_class

    if not isinstance(name, str):
        raise ValueError(f"pp_schedule must be a schedule name, one of {', '.join(SCHEDULES)}; "
                         f"got {name!r}")
    try:
        cls = get_schedule_class(name)
    except ValueError:
        raise ValueError(f"unknown pp_schedule {name!r}: torch's schedules are "
                         f"{', '.join(SCHEDULES)} (get_schedule_class's names, any case)") from None
    if cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        raise ValueError(f"pp_schedule {name!r} is an abstract base class; name a schedule: "
                         f"{', '.join(SCHEDULES)}")
    return cls


def schedule_name(schedule: str) -> str:
    """torch's name of a schedule (``get_schedule_class``'s key: "1F1B", "Interleaved1F1B")."""
    return schedule_class(schedule).__name__.removeprefix("Schedule")


def schedule_ops(schedule: str, pp: int, microbatches: int, stages_per_rank: int
                 ) -> tuple[tuple[Op, ...], ...]:
    """Per pipeline rank (0..pp−1) its :class:`Op` s in program order (see the module
    docstring); cached per (schedule, pp, microbatches, stages_per_rank). A combination torch
    refuses is a ValueError carrying torch's reason."""
    cls = schedule_class(schedule)
    return _ops(cls.__name__, pp, microbatches, stages_per_rank)


def stage_ranks(ops: tuple[tuple[Op, ...], ...]) -> dict[int, int]:
    """Stage → the pipeline rank that computes it, read off the schedule."""
    return {op.stage: r for r, rank_ops in enumerate(ops) for op in rank_ops
            if op.kind in ("F", "B", "I", "W")}


@lru_cache(maxsize=256)
def _ops(cls_name: str, pp: int, m: int, v: int) -> tuple[tuple[Op, ...], ...]:
    import torch.distributed.pipelining.schedules as S

    cls = getattr(S, cls_name)
    if issubclass(cls, S.PipelineScheduleSingle):
        if v != 1:
            raise ValueError(f"{cls_name} is a single-stage schedule: stages_per_rank must be "
                             f"1, got {v} (multi-stage: Interleaved1F1B, LoopedBFS, "
                             f"InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
        order = _torch_order(cls, pp, m, 1)
        single = _single_gpipe if cls_name == "ScheduleGPipe" else _single_1f1b
        if cls_name not in ("ScheduleGPipe", "Schedule1F1B"):  # pragma: no cover - new class
            raise ValueError(f"{cls_name}: its run-time p2p placement is not modelled")
        return tuple(single(order[r], r, pp, m) for r in range(pp))
    if v < 2:
        raise ValueError(f"{cls_name} is a multi-stage schedule: stages_per_rank must be >= 2, "
                         f"got {v} (single-stage: GPipe, 1F1B)")
    lowered = _torch_order(cls, pp, m, v, with_comms=True)
    return _runtime(lowered, pp)


def _torch_order(cls: type, pp: int, m: int, v: int, with_comms: bool = False) -> list[list]:
    """torch's action lists for ``cls`` (the schedule built on mock stages, as torch's own
    ``_schedule_visualizer.get_schedule_ops`` does)."""
    from unittest import mock

    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining.stage import PipelineStage

    from ..compat import schedule_with_comms

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, pp, None
    stage.num_stages = pp * v
    try:
        if issubclass(cls, S.PipelineScheduleSingle):
            sched = cls(stage, m)
            return [[a for a in sched.pipeline_order[r]
                     if a is not None and a.computation_type.name in _COMPUTE]
                    for r in range(pp)]
        stages = [stage] * v
        sched = cls(stages, m)
        with_comms = schedule_with_comms(stages, m, sched.pipeline_order)
        return [list(with_comms[r]) for r in range(pp)]
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ValueError(f"torch's {cls.__name__} refuses pp={pp}, microbatches={m}, "
                         f"stages_per_rank={v}: {e}") from None


_COMPUTE = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
            "BACKWARD_WEIGHT": "W"}
_FSDP = {"UNSHARD": "unshard", "RESHARD": "reshard", "REDUCE_GRAD": "reduce_grad"}


def _runtime(lowered: list[list], pp: int) -> tuple[tuple[Op, ...], ...]:
    """The lowered lists as ``_PipelineScheduleRuntime._step_microbatches`` runs them."""
    flat = []
    for acts in lowered:
        out = []
        for a in acts:
            subs = a.sub_actions if a.computation_type.name == "OVERLAP_F_B" else (a,)
            out.extend(subs)
        flat.append(out)
    where = {a.stage_index: r for r, acts in enumerate(flat) for a in acts
             if a.computation_type.name in _COMPUTE}
    nstages = len(where)
    result = []
    for r, acts in enumerate(flat):
        ops: list[Op] = []
        sends: list[Op] = []
        seen: dict[tuple[str, int], int] = {}  # (FSDP action, stage) → occurrences so far
        for a in acts:
            t, s, mb = a.computation_type.name, a.stage_index, a.microbatch_index
            if t in _FSDP:
                k = seen[t, s] = seen.get((t, s), -1) + 1
                ops.append(Op(_FSDP[t], s, k))
                continue
            local_next = where.get(s + 1) == r  # V-schedule: handed over on this rank
            local_prev = where.get(s - 1) == r
            if t == "SEND_F" and not local_next:
                op = Op("send", s, mb, "F")
                ops.append(op)
                sends.append(op)
            elif t == "SEND_B" and not local_prev:
                op = Op("send", s, mb, "B")
                ops.append(op)
                sends.append(op)
            elif t == "RECV_F" and not local_prev:
                ops.append(Op("post", s - 1, mb, "F"))
            elif t == "RECV_B" and not local_next:
                ops.append(Op("post", s + 1, mb, "B"))
            elif t in _COMPUTE:
                kind = _COMPUTE[t]
                if kind == "F" and s > 0 and not local_prev:
                    ops.append(Op("wait", s - 1, mb, "F"))
                elif kind in ("B", "I") and s < nstages - 1 and not local_next:
                    ops.append(Op("wait", s + 1, mb, "B"))
                ops.append(Op(kind, s, mb))
        ops.extend(Op("wait_send", o.stage, o.mb, o.what) for o in reversed(sends))
        result.append(tuple(ops))
    return tuple(result)


def _recv_f(s: int, i: int) -> list[Op]:
    return [] if s == 0 else [Op("post", s - 1, i, "F")]


def _recv_b(s: int, pp: int, i: int) -> list[Op]:
    return [] if s == pp - 1 else [Op("post", s + 1, i, "B")]


def _send_f(s: int, pp: int, i: int) -> list[Op]:
    return [] if s == pp - 1 else [Op("send", s, i, "F")]


def _send_b(s: int, i: int) -> list[Op]:
    return [] if s == 0 else [Op("send", s, i, "B")]


def _waited(ops: list[Op]) -> list[Op]:
    """``_wait_batch_p2p`` of a batch: every op of it waited for."""
    return [Op("wait" if o.kind == "post" else "wait_send", o.stage, o.mb, o.what) for o in ops]


def _single_gpipe(order: list, s: int, pp: int, m: int) -> tuple[Op, ...]:
    """``ScheduleGPipe._step_microbatches`` for stage ``s`` (compute order: ``order``)."""
    ops: list[Op] = []
    fwd_sends: list[Op] = []
    bwd_sends: list[Op] = []
    for a in order:
        kind, i = _COMPUTE[a.computation_type.name], a.microbatch_index
        if kind == "F":
            recv = _recv_f(s, i)
            ops += recv + _waited(recv) + [Op("F", s, i)]
            send = _send_f(s, pp, i)
            ops += send
            fwd_sends += send
        else:
            if fwd_sends:  # all forward sends waited for before the first backward
                ops += _waited(fwd_sends)
                fwd_sends = []
            recv = _recv_b(s, pp, i)
            ops += recv + _waited(recv) + [Op("B", s, i)]
            send = _send_b(s, i)
            ops += send
            bwd_sends += send
    ops += _waited(fwd_sends) + _waited(bwd_sends) + [Op("reduce_grad", s, 0)]
    _same_compute(ops, order, "ScheduleGPipe")
    return tuple(ops)


def _single_1f1b(order: list, s: int, pp: int, m: int) -> tuple[Op, ...]:
    """``Schedule1F1B._step_microbatches`` for stage ``s``, step by step; its compute order
    is checked against the class's ``pipeline_order`` (``order``)."""
    warmup = min(m, pp - s)
    ops: list[Op] = []
    send_work: list[Op] = []  # what the next _wait_batch_p2p(send_work) waits for
    fwd_sends: list[Op] = []
    f = b = 0
    for _ in range(warmup):
        recv = _recv_f(s, f)
        ops += recv + _waited(recv) + [Op("F", s, f)]
        ops += _waited(send_work)  # the previous chunk's forward sends
        send_work = []
        fwd_sends = _send_f(s, pp, f)
        if f != warmup - 1:  # fired; the last one waits to be fused with the first backward
            ops += fwd_sends
            send_work, fwd_sends = fwd_sends, []
        f += 1
    while True:  # 1B1F: each receive fused with the previous compute's sends
        batch = fwd_sends + _recv_b(s, pp, b)
        ops += batch + _waited(batch) + [Op("B", s, b)]
        bwd_sends = _send_b(s, b)
        b += 1
        if f == m:
            break
        batch = bwd_sends + _recv_f(s, f)
        ops += batch + _waited(batch) + [Op("F", s, f)]
        fwd_sends = _send_f(s, pp, f)
        f += 1
    ops += bwd_sends
    send_work = bwd_sends
    while b < m:  # cool-down
        recv = _recv_b(s, pp, b)
        ops += recv + _waited(recv) + [Op("B", s, b)]
        ops += _waited(send_work)
        send_work = _send_b(s, b)
        ops += send_work
        b += 1
    ops += _waited(send_work) + [Op("reduce_grad", s, 0)]
    _same_compute(ops, order, "Schedule1F1B")
    return tuple(ops)


def _same_compute(ops: list[Op], order: list, name: str) -> None:
    """The compute order followed is the schedule class's own (else torch changed it): the
    sequence of forwards and backwards. Microbatch numbers are not compared: torch 2.13's
    ``Schedule1F1B._get_pipeline_order`` numbers the last stage's forwards 1..m (an
    off-by-one of that IR only; its ``_step_microbatches`` runs 0..m−1, as listed here)."""
    ours = [o.kind for o in ops if o.kind in _COMPUTE.values()]
    theirs = [_COMPUTE[a.computation_type.name] for a in order]
    if ours != theirs:  # pragma: no cover - a torch version that reorders its schedule
        raise RuntimeError(f"{name}: the run-time order {ours} differs from pipeline_order "
                           f"{theirs}")
