"""The DDP planner: a captured DDP iteration as a step program (:mod:`simddp.program.steps`).

Per bucket of the Reducer's layout (at the knobs' caps, with torch's own bucketing), what its
comm hook issues and the compute around it (:func:`plans`, costed with the capture's roofline
summary, :class:`Costs`); then per iteration (:class:`DDPProgram`):

1. with uneven inputs, Join's two all_reduces (the join count, the requires-grad sync);
2. **forward**: the captured forward compute, with its collectives (DDP's buffer broadcast) at
   their compute offsets and waited for where the captured rank waited;
3. **backward**, anchored at its start: bucket k issued when its last parameter's gradient is
   ready (after its comm hook's work), the captured collectives after backward (the unused-
   parameter map), then the end-of-backward wait for all of them and their callbacks;
4. post-backward (the Reducer's copies out of buckets), the rest before the optimizer step,
   the step; with LocalSGD/SlowMo every period iterations the parameters' averaging.

A rank that has run out of inputs shadows the others' iterations as Join's DDP hook does: the
join and sync all_reduces, the forward collectives, every bucket's all_reduce and the
collectives after backward, with no compute of its own; when all have joined, the last join
all_reduce and DDP's final broadcast of the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .contract import Program
from .captured import CapturedIteration
from .knobs import CheckedKnobs
from .mesh import DDPMesh
from ..models.syncs import METRIC_BYTES, sync_seconds
from .parallel import Parallel, layout_not_captured
from .steps import (Collective, Compute, Instruction, Issue, Mark, Memory, Pace, Segment, Wait,
                    WaitAll, peak_memory)

__all__ = ["plan_ddp", "DDPProgram", "BucketPlan", "Costs", "plans"]

_POWERSGD_MIN_COMPRESSION_RATE = 2.0  # torch's PowerSGDState default


class Costs:
    """Op costs from the capture's roofline summary: overhead + max(bytes/bw, FLOPs/peak)."""

    def __init__(self, costs: Mapping[str, float] | None) -> None:
        self.ok = bool(costs)
        self.overhead = float(costs["overhead_s"]) if costs else 0.0
        self.bw = float(costs["bytes_per_s"]) if costs else math.inf
        self.peak = float(costs["flops_per_s"]) if costs else math.inf

    def op(self, nbytes: float = 0.0, flops: float = 0.0) -> float:
        if not self.ok:
            return 0.0
        return self.overhead + max(nbytes / self.bw, flops / self.peak)


@dataclass
class BucketPlan:
    """How one bucket is communicated: main-stream compute before the issue, then stages:
    (op, bytes, callback seconds on the side stream after the stage's collective ends);
    stage j + 1 is issued from the side stream when stage j's callback ends."""

    params: list[int]
    nbytes: int
    pre: float
    stages: list[tuple[str, int, float]]


def plans(cap: CapturedIteration, buckets: list[list[int]], hook: str | None, rank: int,
          costs: Costs) -> list[BucketPlan]:
    """Per bucket of ``buckets``, how ``hook`` communicates it (``rank``: PowerSGD's)."""
    captured = {frozenset(b): n for b, n in zip(cap.bucket_indices, cap.bucket_bytes)}
    out = []
    for b in buckets:
        ps = [cap.params[i] for i in b]
        sparse = any(p.sparse for p in ps)
        nbytes = sum(p.nbytes for p in ps)
        if sparse:  # a sparse gradient's all_reduce moves what the capture saw (indices+values)
            nbytes = captured.get(frozenset(b), nbytes)
        numel = sum(p.numel for p in ps)
        if sparse or hook in (None, "allreduce"):
            out.append(BucketPlan(b, nbytes, 0.0, [("all_reduce", nbytes, 0.0)]))
        elif hook in ("fp16", "bf16"):
            half = 2 * numel
            pre = costs.op(nbytes + half) + costs.op(2 * half)  # cast, then div_ in place
            out.append(BucketPlan(b, nbytes, pre, [("all_reduce", half, costs.op(half + nbytes))]))
        elif hook == "powersgd":
            unc, pb, qb = 0, 0, 0
            pre = cb_p = cb_q = 0.0
            for p in ps:
                e = p.element_size
                if len(p.shape) <= 1:
                    unc += p.nbytes
                    continue
                n = int(p.shape[0])
                m = p.numel // n if n else 0
                r = min(n, m, rank)
                if not (n and m and (n + m) * r * _POWERSGD_MIN_COMPRESSION_RATE < n * m):
                    unc += p.nbytes
                    continue
                pb += n * r * e
                qb += m * r * e
                mat = n * m * e
                pre += costs.op(3 * mat)  # error feedback: M += error
                pre += costs.op(mat + (m + n) * r * e, 2.0 * n * m * r)  # P = M Q
                cb_p += costs.op(2 * n * r * e, 2.0 * n * r * r)  # orthogonalise P
                cb_p += costs.op(mat + (m + n) * r * e, 2.0 * n * m * r)  # Q = Mᵀ P
                cb_q += costs.op(mat + (m + n) * r * e, 2.0 * n * m * r)  # M = P Qᵀ
                cb_q += costs.op(3 * mat)  # error = input − M
            pre += costs.op(2 * unc)  # copy uncompressed tensors into one buffer
            out.append(BucketPlan(b, nbytes, pre, [("all_reduce", unc, costs.op(2 * unc)),
                                              ("all_reduce", pb, cb_p),
                                              ("all_reduce", qb, cb_q)]))
        else:  # pragma: no cover - checked by replay()
            raise ValueError(hook)
    return out


def _per_profile(cap: CapturedIteration, value) -> tuple[float, ...]:
    return tuple(float(value(p)) for p in cap.profiles)


def _forward_events(prof) -> list[tuple[float, int, int]]:
    """A profile's forward collectives' issues (0) and waits (1), by compute offset."""
    ev = []
    for k, fc in enumerate(prof.forward_collectives):
        ev.append((float(fc["offset"]), 0, k))
        if fc.get("wait_at") is not None:
            ev.append((float(fc["wait_at"]), 1, k))
    return sorted(ev)


class DDPProgram(Program):
    """A captured DDP iteration as a step program, for one world and set of knobs (see the
    module docstring). ``buckets``/``plans``: the layout and per-bucket plans it replays."""

    def __init__(self, cap: CapturedIteration, checked: CheckedKnobs) -> None:
        k = checked.knobs
        if checked.core_slowdown != 1.0:  # ranks sharing a host's cores (simddp.models.host)
            cap = cap.with_compute_scaled(checked.core_slowdown)
        self.knobs, self.loader = k, checked.loader
        if k.metric_allreduces and checked.uneven:
            raise ValueError("metric_allreduces with uneven inputs: a joined rank would not "
                             "issue them (Join shadows DDP's collectives only)")
        if cap.parallel != "ddp":
            raise ValueError(f"{cap.name} was captured under {cap.parallel!r} by capture() (the "
                             f"whole iteration, for co-simulation checks); the DDP planner "
                             f"replays DDP captures only. Replay an FSDP2 layout from "
                             f"simddp.cosim.capture_fsdp.capture_fsdp's CapturedStep (simddp "
                             f"whatif --parallel fsdp captures it)")
        self.cap, self.world, self.iterations = cap, checked.world, checked.iterations
        self.nprofiles = len(cap.profiles)
        self.period = k.period
        self.uneven = checked.uneven
        self.param_bytes = cap.param_bytes
        self.costs = Costs(cap.costs)
        self.buckets = cap.buckets(k.bucket_cap_mb, k.first_bucket_mb)
        self.plans = plans(cap, self.buckets, k.comm_hook, k.powersgd_rank, self.costs)
        self.mesh = DDPMesh(checked.world, k.groups, checked.network.gpus_per_node,
                            k.shared_nic, node_classes=bool(self.period))
        self.slowmo = k.slowmo_period is not None
        par = None if k.parallel is None else Parallel.parse(k.parallel, checked.world)
        if par is not None and par.data != "ddp":
            raise layout_not_captured(k.parallel, "DDP", cap.name)
        if par is not None and par.not_replayed():
            raise ValueError(f"parallel={k.parallel!r}: {par.not_replayed()}")
        # the forward's marks in each profile's own order; the vectorised engine needs one
        orders = [tuple((w, i) for _, w, i in _forward_events(p)) for p in cap.profiles]
        self._orders_differ = len(set(orders)) > 1
        prefix = self._host_head() + (self._join_prefix() if self.uneven else ())
        tail = self._tail()
        host = self._host_tail()
        train = [prefix + (self._forward(p),) + self._backward() + tail
                 for p in (range(self.nprofiles) if self._orders_differ else [0])]
        self._train = [t + host for t in train]
        self._averaged = [t + self._average() + host for t in train] if self.period else None
        self._shadow = self._shadow_iteration() if self.uneven else ()

    # -- what engines ask ------------------------------------------------------------------
    def iteration(self, rank: int, it: int) -> Sequence[Instruction]:
        if self.uneven and it >= self.uneven.get(rank, self.iterations):
            return self._shadow
        p = rank % self.nprofiles if self._orders_differ else 0
        if self.period and it % self.period == 0:
            return self._averaged[p]
        return self._train[p]

    def epilogue(self, rank: int) -> Sequence[Instruction]:
        if not self.uneven:
            return ()
        return (self._issue(("join", "final"), "dp", "all_reduce", 4, costed=False),
                Wait(("join", "final"), "wait: join"),
                self._issue(("final",), "dp", "broadcast", self.param_bytes, costed=False),
                Wait(("final",), "wait: final broadcast"))

    def uniform(self) -> str | None:
        if self.uneven:
            return "uneven inputs (Join's shadow iterations)"
        if self._orders_differ:
            return "captured ranks issue their forward collectives in different orders"
        return None

    def rank_kinds(self) -> dict[int, tuple]:
        """Ranks whose instructions differ from the others' by more than durations."""
        return {r: ("uneven", n) for r, n in self.uneven.items()}

    def communication_buckets(self) -> tuple[list[list[int]], list[list[int]]]:
        return self.buckets, [[b for _, b, _ in p.stages] for p in self.plans]

    def static_memory(self) -> dict[str, int]:
        """Per rank for the whole step: parameters, their gradients (views of the buckets with
        ``gradient_as_bucket_view``), the Reducer's buckets, the optimizer's state."""
        cap = self.cap
        pb = cap.param_bytes
        return {"parameters": pb, "gradients": 0 if cap.gradient_as_bucket_view else pb,
                "communication": sum(sum(cap.params[i].nbytes for i in b)
                                     for b in self.buckets),
                "optimizer": int(getattr(cap, "optimizer_state_bytes", 0))}

    def memory_programs(self) -> list[tuple[Sequence[Instruction], dict[str, int]]]:
        """Rank 0's step for :func:`~simddp.program.steps.job_memory`: the activations
        autograd saves (held from forward into backward, then freed), then the iteration (its
        optimizer step creates the optimizer state in the first one)."""
        act = int(getattr(self.cap, "activation_bytes", 0))
        mem = [Memory("activations", act, "saved for backward", key=("activations",)),
               Memory("activations", -act, "freed by backward", key=("activations",))] \
            if act else []
        return [((*mem, *self.iteration(0, 0)), self.static_memory())]

    def memory(self, rank: int | None = None) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per category at the peak): the static memory and the
        activations autograd saves in forward (live from forward's end into backward)."""
        act = int(getattr(self.cap, "activation_bytes", 0))
        peak, at_peak, _ = peak_memory([Memory("activations", act)], self.static_memory())
        return peak, at_peak

    # -- the instructions ------------------------------------------------------------------
    @staticmethod
    def _issue(tag: tuple, scope: str, op: str, nbytes: int, *, kind: str = "forward",
               label: str | None = None, pending: bool = False, costed: bool = True) -> Issue:
        return Issue(((Collective(tag, scope, op, int(nbytes)), 0.0),), kind=kind,
                     label=label or f"issue: {op}", pending=pending, costed=costed)

    def _join_prefix(self) -> tuple[Instruction, ...]:
        # Join.notify_join_context and DDP's requires-grad-sync, both async
        return tuple(self._issue((t,), "dp", "all_reduce", 4, label="issue: join", pending=True)
                     for t in ("join", "sync"))

    def _forward(self, p: int) -> Segment:
        """Profile p's forward (every profile's durations, in profile p's mark order)."""
        cap = self.cap
        marks = []
        for _, what, k in _forward_events(cap.profiles[p]):
            fc = cap.profiles[p].forward_collectives[k]
            if what == 0:
                at = _per_profile(cap, lambda q: _offset(q, k, "offset"))
                marks.append(Mark(at, self._issue(("fwd", k), "dp", fc["op"], fc["bytes"])))
            else:
                at = _per_profile(cap, lambda q: _offset(q, k, "wait_at"))
                marks.append(Mark(at, Wait(("fwd", k), f"wait: {fc['op']}")))
        return Segment("forward", _per_profile(cap, lambda q: q.forward), 0, tuple(marks))

    def _bucket_stages(self, k: int, plan: BucketPlan, scope: str) -> tuple:
        return tuple((Collective(("b", k, j), scope, op, nbytes, True), cb)
                     for j, (op, nbytes, cb) in enumerate(plan.stages))

    def _backward(self) -> tuple[Instruction, ...]:
        cap = self.cap
        scope = "node" if self.period else "dp"
        marks = []
        for k, plan in enumerate(self.plans):
            def ready(q, params=plan.params):
                if not self.knobs.overlap:  # a framework that reduces after backward
                    return q.backward
                rd = [0.0 if t is None else float(t) for t in q.ready]
                return max((rd[i] for i in params), default=0.0)
            marks.append(Mark(_per_profile(cap, ready),
                              Issue(self._bucket_stages(k, plan, scope), pre=plan.pre,
                                    kind="backward", pending=True)))
        for k, bc in enumerate(cap.backward_collectives):
            marks.append(Mark(None, self._issue(("bwd", k), scope, bc["op"], bc["bytes"],
                                                kind="backward", pending=True)))
        seg = Segment("backward", _per_profile(cap, lambda q: q.backward), 1, tuple(marks),
                      anchored=True)
        return (seg, WaitAll("wait: collectives of backward"))

    def _tail(self) -> tuple[Instruction, ...]:
        cap = self.cap
        return (Compute("backward", _per_profile(cap, lambda q: q.post_backward), 2),
                Compute("forward", _per_profile(cap, lambda q: q.before_step), 2),
                Compute("optimizer", _per_profile(cap, lambda q: q.optimizer), 3))

    def _samples(self) -> int:
        n = self.knobs.samples_per_rank or self.cap.batch_size
        if not n:
            raise ValueError("the host loader needs the samples each rank loads per iteration: "
                             "the capture does not know its batch size, give samples_per_rank")
        return n

    def _host_head(self) -> tuple[Instruction, ...]:
        """Main-process data loading (simddp.models.host), before the forward."""
        if self.loader is None or not self.loader.inline(1):
            return ()
        return (Compute("host", (self.loader.inline(self._samples()),) * self.nprofiles, None,
                        "data loading (main process)"),)

    def _host_tail(self) -> tuple[Instruction, ...]:
        """After the step: host syncs, metric all_reduces (simddp.models.syncs), and the wait
        for the loader's next batch (simddp.models.host)."""
        k, n = self.knobs, self.nprofiles
        out: list[Instruction] = []
        if k.sync_points:
            out.append(Compute("host", (sync_seconds(k.sync_points, k.sync_us),) * n, None,
                               "sync (host waits for the device)"))
        for j in range(k.metric_allreduces):
            out += [self._issue(("metric", j), "dp", "all_reduce", METRIC_BYTES,
                                kind="optimizer", label="issue: metric all_reduce"),
                    Wait(("metric", j), "wait: metric all_reduce")]
        if self.loader is not None and self.loader.period(1):
            out.append(Pace(self.loader.period(self._samples())))
        return tuple(out)

    def _average(self) -> tuple[Instruction, ...]:
        """PeriodicModelAverager (LocalSGD) / SlowMo: all_reduce of all parameters."""
        pb, op = self.param_bytes, self.costs.op
        n = self.nprofiles
        post = op(2 * pb) + op(2 * pb)  # divide, unflatten
        if self.slowmo:
            post += 4 * op(3 * pb)  # slow momentum: diff, momentum, update, copy
        return (Compute("optimizer", (op(2 * pb),) * n, None, "flatten"),
                self._issue(("avg",), "dp", "all_reduce", pb, kind="optimizer"),
                Wait(("avg",), "wait: model averaging"),
                Compute("optimizer", (post,) * n, None, "model averaging"))

    def _shadow_iteration(self) -> tuple[Instruction, ...]:
        """A joined rank's shadow of one iteration (Join's DDP hook)."""
        out: list[Instruction] = []
        for t in ("join", "sync"):
            out += [self._issue((t,), "dp", "all_reduce", 4, label="issue: join"),
                    Wait((t,), "wait: join")]
        for k, fc in enumerate(self.cap.profiles[0].forward_collectives):
            # the buffers' broadcast (DDP's _check_and_sync_module_buffers in the hook)
            out += [self._issue(("fwd", k), "dp", fc["op"], fc["bytes"]),
                    Wait(("fwd", k), f"wait: {fc['op']}")]
        for k, plan in enumerate(self.plans):
            if plan.pre > 0:
                out.append(Compute("backward", (plan.pre,) * self.nprofiles, None, "comm hook"))
            out.append(Issue(self._bucket_stages(k, plan, "dp"), kind="backward",
                             label="issue: all_reduce", pending=True))
        for k, bc in enumerate(self.cap.backward_collectives):  # the unused-parameter map
            out.append(self._issue(("bwd", k), "dp", bc["op"], bc["bytes"], kind="backward",
                                   pending=True))
        out.append(WaitAll("wait: join shadow all_reduces"))
        return tuple(out)


def _offset(q, k: int, key: str) -> float:
    """Profile q's offset of its forward collective k (0 where it has none)."""
    fcs = q.forward_collectives
    return float(fcs[k][key]) if k < len(fcs) and fcs[k].get(key) is not None else 0.0


def plan_ddp(cap: CapturedIteration, checked: CheckedKnobs) -> DDPProgram:
    """The DDP planner: ``cap`` as a step program for ``checked``'s world and knobs."""
    return DDPProgram(cap, checked)
