"""The pipeline-parallel planner: a captured pipeline step
(:class:`~simddp.program.captured.CapturedPipeline`) as a step program on a world of any
data-parallel size, under any of torch's schedules and microbatch counts.

Each pipeline rank runs its schedule's actions (:mod:`~simddp.program.schedules`: torch's own
action lists with their run-time p2p placement):

* a compute action (``F``, ``B``, ``I``, ``W``) of stage s on microbatch i replays the stage's
  captured profile of that action — microbatch 0 the first captured, the last the last
  captured, the others the middle ones (so FSDP's first all-gathers and last reduce-scatters
  stay where the capture saw them) — with its in-stage collectives as marks
  (:func:`~simddp.program.fsdp.event_marks`, FSDP2's stream semantics). A full backward ``B``
  of a capture that split it replays as ``I`` then ``W`` (per microbatch where DualPipeV's
  capture mixed them: its ``None`` entries; the nearest captured profile of a kind stands in for
  a missing one); a schedule that splits backward cannot replay a capture that did not (torch
  computed both gradients together there);
* FSDP2's actions where torch runs them (:mod:`~simddp.program.schedules`): ``UNSHARD`` issues
  the stage's captured all-gathers asynchronously and the stage's next compute waits for them
  (torch's ``_assert_unsharded``), ``RESHARD`` frees the unsharded parameters, ``REDUCE_GRAD``
  replays ``perform_reduce_grad`` with its reduce-scatters in flight until the end of the step;
  a multi-stage capture under a single-stage schedule unshards before the stage's first compute;
* a message (activations to stage s + 1, gradients to stage s − 1) is one 2-member ``send``
  collective on a directed channel between neighbouring pipeline ranks (:class:`PipelineMesh`:
  ``pp>c`` carries what pipeline rank c sends to c + 1, ``pp<c`` what it sends to c − 1,
  wrapping around for interleaved stages), FIFO per channel, costed by the network; the
  receiver posts it (an arrival), the sender arrives after its compute, and it runs once both
  have; a receive is waited for where torch waits for it, a send where torch does;
* the optimizer of every local stage after the schedule (its time × the shard ratio, as FSDP2's
  local shard), after the in-stage collectives still in flight (reduce-scatters).

Memory per rank: its stages' parameters (``param_bytes``, which the capture records for the
whole stage before tensor parallelism and FSDP, / (tp × shard)) and optimizer state from the
start; with FSDP2 the all-gathered parameters from ``UNSHARD`` (or the first ``F``) until
``RESHARD`` (or the end of the step); activations (the stage's ``activation_bytes``) from each
forward until its backward frees them (``B``, or ``W`` when backward is split); with activation
checkpointing (the capture's ``activation_checkpointing``) those are the blocks' inputs, and a
backward (``B`` or ``I``) holds one block's recomputed activations (``recompute_bytes``) while
it runs.

Bubble fraction (:meth:`PipelineProgram.bubble_fractions`): per pipeline rank and iteration,
``(T − d + w) / T`` with T the iteration time (the slowest rank's), d the rank's own iteration
duration and w the time it waited on pipeline messages in it (receives and sends): the share of
the step in which the rank does none of its own work because of the pipeline — its waits for
neighbours plus the drain after its last action while the pipeline finishes. With no other
waits it is ``1 − (compute + in-stage communication waits) / T``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from fakepg.arguments import integer, number

from ..models import Network
from .contract import Program
from .captured import CapturedPipeline
from .fsdp import check_reshard, check_sharded_knobs, event_marks, fsdp_gather
from .knobs import CheckedKnobs
from .mesh import PipelineMesh
from .parallel import Parallel
from .schedules import Op, schedule_name, schedule_ops, stage_ranks
from .synthetic import uniform_pipeline
from .steps import (Collective, Compute, Instruction, Issue, Mark, Memory, Segment, Wait,
                    WaitAll, peak_memory)

__all__ = ["PipelineProgram", "plan_pipeline", "uniform_pipeline"]

_NOISE = {"F": 0, "B": 1, "I": 1, "W": 1}
_PHASE = {"F": "forward", "B": "backward", "I": "backward", "W": "backward"}
PIPELINE_WAIT = "pipeline: "  # the label prefix of waits on pipeline messages


class PipelineProgram(Program):
    """A captured pipeline step as a step program (see the module docstring)."""

    nprofiles = 1

    def __init__(self, cap: CapturedPipeline, checked: CheckedKnobs) -> None:
        k, world = checked.knobs, checked.world
        if cap.pp < 2:
            raise ValueError(f"{cap.name}: a pipeline has pp >= 2 stages' ranks, the capture "
                             f"has pp={cap.pp}")
        spec = k.parallel or _default_spec(cap, world)
        par = Parallel.parse(spec, world)
        if par.pp != cap.pp or par.tp != cap.tp_size:
            raise ValueError(f"parallel={spec!r} (pp:{par.pp}, tp:{par.tp}) cannot replay "
                             f"{cap.name}, captured with pp:{cap.pp}, tp:{cap.tp_size}: the "
                             f"stages and their tensor-parallel collectives are the capture's, "
                             f"so pp and tp must be too (data parallelism may differ)")
        data = par.replicate * par.shard
        if cap.data == "none" and data > 1:
            raise ValueError(f"parallel={spec!r} replicates the pipeline {data} times, but "
                             f"{cap.name} has no data parallelism inside its stages: use a "
                             f"world of pp × tp = {cap.pp * cap.tp_size} ranks, or capture with "
                             f"FSDP")
        if cap.data != "none" and par.data != cap.data:
            raise ValueError(f"parallel={spec!r} lays out {par.data}, the capture ran "
                             f"{cap.data} inside its stages: replay the capture's flavour")
        v = cap.stages_per_rank
        if k.stages_per_rank is not None and k.stages_per_rank != v:
            raise ValueError(f"stages_per_rank={k.stages_per_rank}, but {cap.name} was "
                             f"captured with {v} stages per rank: its stages are the "
                             f"capture's, so capture the split you replay")
        if len(cap.stages) != cap.pp * v:
            raise ValueError(f"{cap.name}: {len(cap.stages)} stages captured, pp × "
                             f"stages_per_rank = {cap.pp * v}")
        check_sharded_knobs(k, "a pipeline replay", "pipelines")
        check_reshard(k, cap)
        self.schedule = schedule_name(k.pp_schedule or cap.schedule)
        self.microbatches = m = k.microbatches or cap.microbatches
        self.ops = schedule_ops(k.pp_schedule or cap.schedule, cap.pp, m, v)
        where = stage_ranks(self.ops)
        self.stage_rank = where
        self.cap, self.world, self.parallel = cap, world, par
        self.iterations = checked.iterations
        self.mesh = PipelineMesh(par.mesh())
        self.shard_ratio = cap.shard_size / par.shard
        self.prefetch = {"forward": k.forward_prefetch, "backward": k.backward_prefetch}
        self.param_bytes = cap.param_bytes
        kinds = {op.kind for r in self.ops for op in r}
        self.split = bool(kinds & {"I", "W"})
        for st in cap.stages:
            acts = st["actions"]
            if self.split and not (any(acts.get("I") or ()) and any(acts.get("W") or ())):
                raise ValueError(
                    f"{self.schedule} splits backward into input (I) and weight (W) "
                    f"gradients, but {cap.name} was captured with "
                    f"{cap.schedule}, whose full backward computed both together: the split's "
                    f"times are not in the capture; capture with a zero-bubble schedule")
            if "B" in kinds and not (any(acts.get("B") or ())
                                     or (any(acts.get("I") or ()) and any(acts.get("W") or ()))):
                raise ValueError(f"{cap.name}: stage {st['stage']} has no backward profile")
        self._by_coord = [self._rank(c) for c in range(cap.pp)]

    # -- what engines ask ------------------------------------------------------------------
    def iteration(self, rank: int, it: int) -> Sequence[Instruction]:
        return self._by_coord[self.mesh.coord(rank)]

    def epilogue(self, rank: int) -> Sequence[Instruction]:
        return ()

    def uniform(self) -> str | None:
        return "pipeline parallelism (each pipeline rank runs its own schedule)"

    def knob_values(self) -> dict[str, Any]:
        """The pipeline knobs as replayed (the capture's where a knob was None)."""
        return {"pp_schedule": self.schedule, "microbatches": self.microbatches,
                "stages_per_rank": self.cap.stages_per_rank}

    def static_memory(self, coord: int = 0) -> dict[str, int]:
        """Per rank of pipeline rank ``coord`` before the step: its stages' parameters and
        optimizer state."""
        mine = [st for st in self.cap.stages if self.stage_rank[st["stage"]] == coord]
        split = self.parallel.tp * self.parallel.shard
        return {"parameters": sum(int(st["param_bytes"]) // split for st in mine),
                "optimizer": sum(int(st["optimizer_state_bytes"] * self.shard_ratio)
                                 for st in mine)}

    def memory_programs(self) -> list[tuple[Sequence[Instruction], dict[str, int]]]:
        """Each pipeline rank's step and its memory before the step (for
        :func:`~simddp.program.steps.job_memory`)."""
        return [(self._by_coord[c], self.static_memory(c)) for c in range(self.cap.pp)]

    def memory(self, rank: int | None = None) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per category at the peak) of ``rank`` in one step; None: the
        pipeline rank with the highest peak."""
        coords = range(self.cap.pp) if rank is None else [self.mesh.coord(rank)]
        best = (-1, {})
        for c in coords:
            peak, at_peak, _ = peak_memory(self._by_coord[c], self.static_memory(c))
            if peak > best[0]:
                best = (peak, at_peak)
        return best

    def bubble_fractions(self, timeline: Any) -> list[float]:
        """Per pipeline rank, its bubble fraction (module docstring) averaged over
        iterations."""
        times = timeline.iteration_times()
        out = []
        for c in range(self.cap.pp):
            lane = timeline.lanes[c * self.mesh.stride]
            fr = []
            for i, (lo, hi) in enumerate(lane.windows()):
                t = times[i]
                w = sum(min(e, hi) - max(s, lo) for kind, s, e, label in lane.spans
                        if kind == "wait" and label.startswith(PIPELINE_WAIT) and e > lo
                        and s < hi)
                fr.append((t - (hi - lo) + w) / t if t > 0 else 0.0)
            out.append(sum(fr) / len(fr) if fr else 0.0)
        return out

    # -- the instructions ------------------------------------------------------------------
    def _bytes(self, ev: dict[str, Any]) -> int:
        if ev["scope"] == "replicate":  # one shard's worth, across replicas
            return int(round(ev["bytes"] * self.shard_ratio))
        return int(ev["bytes"])

    def _profile(self, stage: int, kind: str, mb: int) -> dict[str, Any] | None:
        """Microbatch ``mb``'s captured profile of ``kind``: first, last, or a middle one;
        where the capture ran that microbatch's backward as the other kind (``None``,
        DualPipeV), the nearest captured one; None when the capture has none of ``kind``."""
        profs = self.cap.stages[stage]["actions"].get(kind) or []
        have = [j for j, x in enumerate(profs) if x is not None]
        if not have:
            return None
        n, m = len(profs), self.microbatches
        if mb == 0 or n == 1:
            idx = 0
        elif mb == m - 1:
            idx = n - 1
        else:
            idx = min(mb, n - 2) if n > 2 else 0
        return profs[min(have, key=lambda j: (abs(j - idx), j))]

    def _exact(self, stage: int, kind: str, mb: int) -> bool:
        """The capture ran microbatch ``mb``'s backward as ``kind`` (same microbatch count)."""
        profs = self.cap.stages[stage]["actions"].get(kind) or []
        return self.microbatches == len(profs) and profs[mb] is not None

    def _backward_kinds(self, stage: int, mb: int) -> tuple[str, ...]:
        """How a full backward ``B`` replays: the captured ``B`` of that microbatch, else its
        ``I`` then ``W`` (a split capture, or DualPipeV's mix), else the nearest of either."""
        if self._exact(stage, "B", mb):
            return ("B",)
        if self._exact(stage, "I", mb) and self._exact(stage, "W", mb):
            return ("I", "W")
        return ("B",) if self._profile(stage, "B", mb) is not None else ("I", "W")

    def _compute(self, kind: str, stage: int, mb: int,
                 prof: dict[str, Any] | None = None) -> list[Instruction]:
        prof = prof if prof is not None else self._profile(stage, kind, mb)
        phase = _PHASE[kind]
        if not prof["events"]:
            return [Compute(phase, (float(prof["seconds"]),), _NOISE[kind],
                            f"{kind}{mb} stage {stage}")]
        marks, after = event_marks([prof], 0, phase, self.prefetch[phase], self._bytes,
                                   tag=(kind, stage, mb))
        return [Segment(phase, (float(prof["seconds"]),), _NOISE[kind], tuple(marks)), *after]

    def _unshard(self, stage: int, k: int, waits: list[Wait]) -> list[Instruction]:
        """torch's UNSHARD action (the stage's k-th of the step): its all-gathers issued
        asynchronously where the capture issued them; ``waits`` receives their waits (the
        stage's next compute's ``_assert_unsharded``)."""
        profs = self.cap.stages[stage].get("unshard") or []
        if not profs:  # captured with a single-stage schedule: the first F gathers
            return []
        prof = profs[min(k, len(profs) - 1)]
        marks = []
        for j, ev in enumerate(prof["events"]):
            tag = ("U", stage, k, j)
            c = Collective(tag, ev["scope"], ev["op"], self._bytes(ev), False)
            marks.append(Mark((float(ev["offset"]),), Issue(((c, 0.0),), kind="forward",
                                                            pending=False)))
            waits.append(Wait(tag, f"wait: unshard stage {stage} all-gather {j}"))
        return [Segment("forward", (float(prof["seconds"]),), _NOISE["F"], tuple(marks)),
                Memory("parameters", _gathered(prof), f"unshard stage {stage}")]

    def _channel(self, src: int, dst: int, what: str) -> tuple[str, str]:
        """(sender's scope, receiver's scope) for a message from stage src to stage dst."""
        pp = self.cap.pp
        a, b = self.stage_rank[src], self.stage_rank[dst]
        up, down = b == (a + 1) % pp, b == (a - 1) % pp
        if up and (what == "F" or not down):
            return "pp_send_next", "pp_recv_prev"
        if down:
            return "pp_send_prev", "pp_recv_next"
        raise ValueError(f"stages {src} and {dst} are on pipeline ranks {a} and {b}, not "
                         f"neighbours")  # pragma: no cover - torch's schedules place them so

    def _p2p(self, op: Op) -> Instruction:
        src = op.stage
        dst = src + 1 if op.what == "F" else src - 1
        tag = ("p" + op.what, src, op.mb)
        label = (f"{PIPELINE_WAIT}{'activations' if op.what == 'F' else 'gradients'} "
                 f"stage {src}→{dst} mb {op.mb}")
        if op.kind in ("wait", "wait_send"):
            return Wait(tag, label)
        send, recv = self._channel(src, dst, op.what)
        nbytes = int(self.cap.stages[src]["send_bytes"][op.what])
        c = Collective(tag, send if op.kind == "send" else recv, "send", nbytes,
                       op.what == "B")
        return Issue(((c, 0.0),), kind=_PHASE[op.what], label=label, pending=False)

    def _rank(self, coord: int) -> tuple[Instruction, ...]:
        out: list[Instruction] = []
        cap = self.cap
        ops = self.ops[coord]
        waits: dict[int, list[Wait]] = {}  # per stage: its unshard's all-gathers to wait for
        held: dict[int, int] = {}  # per stage: unsharded parameter bytes held
        grads: dict[int, int] = {}  # per stage: unsharded gradient bytes held
        kept: list[int] = []  # sharded gradients, until the next step's zero_grad
        unsharded = {op.stage for op in ops if op.kind == "unshard"}
        for j, op in enumerate(ops):
            compute = op if op.kind in _NOISE else (
                ops[j + 1] if op.kind == "wait" and j + 1 < len(ops) else None)
            if compute is not None and compute.kind in _NOISE:
                s = compute.stage
                if s not in unsharded and cap.stages[s].get("unshard"):
                    # a multi-stage capture under a single-stage schedule: FSDP's pre-forward
                    # unshards (and waits) before the stage's first compute
                    unsharded.add(s)
                    out += self._unshard(s, 0, waits.setdefault(s, []))
                    held[s] = held.get(s, 0) + _gathered(cap.stages[s]["unshard"][0])
                out += waits.pop(s, [])  # _assert_unsharded, before the receive's wait
            if op.kind in _NOISE:
                st = cap.stages[op.stage]
                act = int(st.get("activation_bytes", 0))
                # activation checkpointing: the backward's recomputation of one block at a time
                rec = int(st.get("recompute_bytes", 0)) if op.kind in ("B", "I") else 0
                if rec:
                    out.append(Memory("activations", rec, f"recomputed in {op.kind}{op.mb}"))
                kinds = self._backward_kinds(op.stage, op.mb) if op.kind == "B" else (op.kind,)
                for kind in kinds:
                    prof = self._profile(op.stage, kind, op.mb)
                    out += self._compute(kind, op.stage, op.mb, prof)
                    gathered = _gathered(prof)  # FSDP2 unsharding inside a compute
                    if gathered:
                        out.append(Memory("parameters", gathered, f"unsharded in {kind}"))
                        held[op.stage] = held.get(op.stage, 0) + gathered
                if op.kind in ("B", "W") and op.stage not in grads:
                    # the stage's first weight gradients: autograd allocates them (the
                    # unsharded parameters' dtype) and accumulates into them until
                    # REDUCE_GRAD (or the step's end)
                    g = self._unsharded_grad_bytes(op.stage, held.get(op.stage, 0))
                    grads[op.stage] = g
                    if g:
                        out.append(Memory("gradients", g, f"unsharded gradients stage "
                                          f"{op.stage}", key=("ugrad", op.stage)))
                if rec:
                    out.append(Memory("activations", -rec, f"recomputed in {op.kind}{op.mb}"))
                if act and op.kind == "F":
                    out.append(Memory("activations", act, f"saved by F{op.mb}"))
                elif act and (op.kind == "W" or op.kind == "B"):
                    out.append(Memory("activations", -act, f"freed by {op.kind}{op.mb}"))
            elif op.kind == "unshard":
                out += self._unshard(op.stage, op.mb, waits.setdefault(op.stage, []))
                prof = (cap.stages[op.stage].get("unshard") or [None])[0]
                held[op.stage] = held.get(op.stage, 0) + (_gathered(prof) if prof else 0)
            elif op.kind == "reshard":
                out += waits.pop(op.stage, [])
                freed = held.pop(op.stage, 0)
                if freed:
                    out.append(Memory("parameters", -freed, f"reshard stage {op.stage}"))
            elif op.kind == "reduce_grad":
                prof = cap.stages[op.stage].get("reduce_grad")
                out += self._reduce_grad_memory(op.stage, prof, grads, kept)
                if prof is not None:
                    marks, after = event_marks([prof], 0, "backward", 0, self._bytes,
                                               tag=("R", op.stage))
                    out.append(Segment("backward", (float(prof["seconds"]),), _NOISE["B"],
                                       tuple(marks)))
                    out += after
            else:
                out.append(self._p2p(op))
        out.append(WaitAll("wait: in-stage collectives (end of backward)"))
        for s in sorted(grads):  # single-stage schedules: reduced at the step's end
            out += self._reduce_grad_memory(s, cap.stages[s].get("reduce_grad"), grads, kept)
        for s, freed in held.items():  # single-stage schedules: resharded after the step
            if freed:
                out.append(Memory("parameters", -freed, f"reshard stage {s}"))
        for st in cap.stages:
            if self.stage_rank[st["stage"]] != coord:
                continue
            prof = st["optimizer"]
            seconds = float(prof["seconds"]) * self.shard_ratio
            marks, after = event_marks([prof], 0, "optimizer", 0, self._bytes,
                                       tag=("O", st["stage"]))
            out.append(Segment("optimizer", (seconds,), 3, tuple(marks)))
            out += after
        if kept:
            out.append(Memory("gradients", -sum(kept), "zero_grad(set_to_none=True)"))
        return tuple(out)

    def _unsharded_grad_bytes(self, stage: int, gathered: int) -> int:
        """A stage's gradients before FSDP2 reduces them: its unsharded parameters' bytes
        (what FSDP2 all-gathered, in the parameters' dtype), else (no FSDP) the TP rank's
        parameters."""
        if gathered:
            return int(gathered)
        st = self.cap.stages[stage]
        return int(st["param_bytes"]) // max(1, self.parallel.tp * self.parallel.shard)

    def _reduce_grad_memory(self, stage: int, prof: dict[str, Any] | None,
                            grads: dict[int, int], kept: list[int]) -> list[Instruction]:
        """FSDP2's ``perform_reduce_grad`` for a stage (``_fsdp_collectives.foreach_reduce``):
        the reduce-scatter input (the reduce dtype) is allocated and the unsharded gradients
        freed after the copy-in; the sharded gradient (its output) is kept until zero_grad and
        the input freed when the reduce-scatter is done. Without FSDP the gradients stay."""
        g = grads.pop(stage, 0)
        if not g:
            return []
        rs = sum(int(e["bytes"]) for e in (prof or {}).get("events", [])
                 if e["op"] in ("reduce_scatter_tensor", "reduce_scatter",
                                "_reduce_scatter_base"))
        if not rs:
            kept.append(g)  # no sharding: the gradients are the optimizer's
            return []
        sharded = int(rs / max(1, self.parallel.shard))  # the input is the unsharded size
        kept.append(sharded)
        return [Memory("communication", rs, f"reduce-scatter input stage {stage}",
                       key=("rs_input", stage)),
                Memory("gradients", -g, f"unsharded gradients stage {stage} copied in",
                       key=("ugrad", stage)),
                Memory("gradients", sharded, f"sharded gradients stage {stage}",
                       stream="reduce_scatter", key=("grad", stage)),
                Memory("communication", -rs, f"reduce-scatter input stage {stage} freed",
                       key=("rs_input", stage))]


def _gathered(prof: dict[str, Any] | None) -> int:
    """Bytes FSDP2 all-gathered (unsharded parameters) in a captured profile."""
    if prof is None:
        return 0
    return sum(int(e["bytes"]) for e in prof["events"] if fsdp_gather(e))


def _default_spec(cap: CapturedPipeline, world: int) -> str:
    """The capture's layout over ``world`` ranks (the data-parallel size filling the rest)."""
    parts = [f"pp:{cap.pp}"]
    if cap.data == "fsdp":
        parts.append("fsdp")
    elif cap.data == "hsdp":
        parts.append(f"hsdp:{cap.shard_size}")
    else:
        parts.append("ddp")
    if cap.tp_size > 1:
        parts.append(f"tp:{cap.tp_size}")
    return ",".join(parts)


def plan_pipeline(cap: CapturedPipeline, checked: CheckedKnobs) -> PipelineProgram:
    """The pipeline planner: ``cap`` as a step program for ``checked``'s world and knobs."""
    return PipelineProgram(cap, checked)
