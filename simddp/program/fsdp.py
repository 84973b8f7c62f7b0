"""The FSDP2 planner: a captured FSDP2/HSDP step (:class:`~simddp.program.captured.CapturedStep`)
as a step program on a world of any size.

What the capture gives (torch's real ``fully_shard`` on the fake cluster): per phase the
compute and every collective in the order FSDP2 issued it — its all-gathers (one per
``fully_shard`` unit), reduce-scatters and, for HSDP, the all-reduce of each reduced shard
across replicas — at compute offsets, and where the rank waited for each. On the fake
cluster's CPU ranks FSDP2 waits for every all-gather as soon as it issues it; on a GPU the wait
is a stream wait and the CPU runs ahead, so all-gathers overlap the compute before them. The
planner applies that stream semantics, with FSDP2's prefetching as knobs:

* all-gather j of a phase is *needed* where the capture waited for it; it is *issued* where
  all-gather ``j - prefetch`` was needed (``forward_prefetch``/``backward_prefetch``: 1, FSDP2's
  default of one unit ahead; 0: no overlap), on the shard dimension's communicator, which runs
  its collectives in order;
* reduce-scatters are issued where the capture issued them and waited for at the end of
  backward (FSDP2's root post-backward), overlapping the compute after them; with HSDP each
  reduce-scatter's all-reduce across replicas is chained after it;
* tensor parallelism's collectives (scope ``"tp"``: DTensor's all-gathers, reduce-scatters
  and all-reduces, forward and backward) are synchronous — on a GPU they run on the compute
  stream and the next op waits for them — so each is issued at its captured offset and waited
  for where the capture waited (at once where it did not: the collective had ended before
  its output was read), on the TP dimension's communicator. A TP replay needs a capture of
  the same TP degree (the per-rank shapes, hence compute and bytes, are the degree's);
* other collectives (a loss all-reduce, gradient-norm clipping) keep their captured issue and
  wait points.

Bytes: all-gathers and reduce-scatters carry the unsharded size at any shard size (as
nccl-tests counts); an HSDP all-reduce carries one shard, so it scales with 1 / shard size.
Compute: forward and backward are the capture's (the local batch is the same at any world
size); the optimizer updates the local shard, so its time scales with 1 / shard size.

Memory per rank (program order, as FSDP2 allocates it: see :func:`event_marks`; replayed
through the caching allocator model by :func:`~simddp.program.steps.job_memory`; under TP the
parameters are the TP rank's, the capture's ``tp_param_bytes``, before FSDP2 shards them): sharded
parameters and optimizer state from the start; each unit's unsharded parameters from its
all-gather until FSDP2 reshards them (after its forward when ``reshard_after_forward`` — the
units the capture all-gathers again in backward — else after its backward), with the
all-gather output buffers; each unit's share of the activations (what autograd saved in the
captured forward, tensor by tensor) from the end of its forward to its reduce-scatter; the
step's temporaries (the capture's ``temporary_bytes``) at the start of backward; each unit's
unsharded gradient and reduce-scatter input around its reduce-scatter, then its sharded
gradient until the next step's ``zero_grad``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

from .contract import Program
from .captured import CapturedStep
from .knobs import CheckedKnobs, Knobs
from .parallel import Parallel, degrees_not_captured, layout_not_captured
from .steps import (Collective, Instruction, Issue, Mark, Memory, Segment, Wait, WaitAll,
                    peak_memory)

__all__ = ["FSDPProgram", "ShardedProgram", "plan_fsdp", "event_marks", "check_sharded_knobs",
           "check_reshard", "fsdp_gather", "GATHERS"]

_NOISE = {"forward": 0, "backward": 1, "optimizer": 3}
GATHERS = ("all_gather_into_tensor", "all_gather", "_allgather_base")
_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter", "_reduce_scatter_base")
_ITEMSIZE = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def fsdp_gather(ev: dict[str, Any]) -> bool:
    """An all-gather of FSDP2's (a unit's parameters), not tensor parallelism's (``"tp"``) nor
    a context-parallel ring's (``"cp"``)."""
    return ev["op"] in GATHERS and ev["scope"] not in ("tp", "cp")


class ShardedProgram(Program):
    """What FSDP2's planner and the planners built on its pieces (context parallelism's:
    :class:`~simddp.program.context.CPProgram`) share: one program per distinct captured
    profile (one for all when every captured rank issued the same collectives), parameters,
    gradients and optimizer state sharded over ``fsdp_size`` ranks.

    A subclass's ``__init__`` checks its layout, sets ``cap``, ``world``, ``parallel``,
    ``mesh``, ``fsdp_size`` (the ranks FSDP2 shards over) and ``shard_ratio`` (a rank's shard
    bytes vs the capture's), then calls :meth:`_plan`, which writes each distinct profile's
    step with the subclass's ``_iteration(p)``."""

    cap: Any
    fsdp_size: int
    shard_ratio: float

    def _plan(self, checked: CheckedKnobs) -> None:
        k, cap = checked.knobs, self.cap
        self.iterations = checked.iterations
        self.nprofiles = cap.world_size
        self.prefetch = {"forward": k.forward_prefetch, "backward": k.backward_prefetch}
        self.param_bytes = cap.param_bytes
        shapes = {self._shape(p) for p in cap.profiles}
        self._why = None if len(shapes) == 1 else \
            "captured ranks issue different collectives (per-rank programs)"
        self._by_profile = [self._iteration(p) for p in
                            (range(self.nprofiles) if self._why else [0])]

    def _iteration(self, p: int) -> tuple[Instruction, ...]:
        raise NotImplementedError

    # -- what engines ask ------------------------------------------------------------------
    def iteration(self, rank: int, it: int) -> Sequence[Instruction]:
        return self._by_profile[rank % self.nprofiles if self._why else 0]

    def epilogue(self, rank: int) -> Sequence[Instruction]:
        return ()

    def uniform(self) -> str | None:
        return self._why

    def static_memory(self) -> dict[str, int]:
        """Per rank before the step: parameters and optimizer state sharded over
        ``fsdp_size`` ranks (under TP, the TP rank's parameters)."""
        return {"parameters": int(self.cap.tp_param_bytes / self.fsdp_size),
                "optimizer": int(self.cap.optimizer_state_bytes * self.shard_ratio)}

    def memory_programs(self) -> list[tuple[Sequence[Instruction], dict[str, int]]]:
        """Each distinct rank's step and its memory before the step (for
        :func:`~simddp.program.steps.job_memory`, the caching allocator's replay)."""
        return [(prog, self.static_memory()) for prog in self._by_profile]

    def memory(self, rank: int | None = None) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per category at the peak) of ``rank`` in one step (None: the
        captured profile with the highest peak)."""
        ranks = range(self.nprofiles) if rank is None else [rank]
        return max((peak_memory(self.iteration(r, 0), self.static_memory())[:2] for r in ranks),
                   key=lambda x: x[0])

    # -- the pieces of a step --------------------------------------------------------------
    @staticmethod
    def _shape(profile: dict[str, Any]) -> tuple:
        return tuple((ph, tuple((e["op"], e["scope"], e["bytes"]) for e in v["events"]))
                     for ph, v in profile.items())

    def _bytes(self, ev: dict[str, Any]) -> int:
        if ev["scope"] == "replicate":  # one shard's worth, across replicas
            return int(round(ev["bytes"] * self.shard_ratio))
        return int(ev["bytes"])

    def _sharded_grad(self, unit_bytes: int) -> int:
        """A unit's sharded gradient (fp32 as its sharded parameter) from its all-gather size."""
        itemsize = _ITEMSIZE.get(self.cap.param_dtype or "fp32", 4)
        return int(unit_bytes * 4 / itemsize / self.fsdp_size)

    def _units(self, p: int) -> tuple[list[int], list[bool]]:
        """Profile ``p``'s FSDP2 units (their all-gather bytes, forward order) and, per unit,
        whether FSDP2 resharded it after forward (it is all-gathered again in backward)."""
        prof = self.cap.profiles[p]
        units = [e["bytes"] for e in prof["forward"]["events"] if fsdp_gather(e)]
        regathered = Counter(e["bytes"] for e in prof["backward"]["events"] if fsdp_gather(e))
        resharded = []
        for b in units:
            resharded.append(regathered[b] > 0)
            regathered[b] -= 1
        return units, resharded

    def _segment(self, phase: str, marks: Sequence[Mark]) -> Segment:
        """``phase``'s compute with ``marks``: the capture's per profile (the optimizer
        updates the local shard: its time scales with ``shard_ratio``)."""
        seconds = tuple(float(q[phase]["seconds"]) * (self.shard_ratio if phase == "optimizer"
                                                      else 1.0) for q in self.cap.profiles)
        return Segment(phase, seconds, _NOISE[phase], tuple(marks))


class FSDPProgram(ShardedProgram):
    """A captured FSDP2 step as a step program for one world and set of knobs (see the module
    docstring). ``parallel``: the layout replayed; ``memory``: per category at the peak."""

    def __init__(self, cap: CapturedStep, checked: CheckedKnobs) -> None:
        k = checked.knobs
        world = checked.world
        spec = k.parallel or (("fsdp" if cap.parallel == "fsdp" else f"hsdp:{cap.shard_size}")
                              + (f",tp:{cap.tp_size}" if cap.tp_size > 1 else ""))
        par = Parallel.parse(spec, world)
        if par.data != cap.parallel or par.pp > 1:
            raise layout_not_captured(spec, cap.parallel.upper(), cap.name)
        if par.tp != cap.tp_size:
            raise degrees_not_captured(
                spec, f"tensor-parallel degree {par.tp}", cap.name, f"tp={cap.tp_size}",
                "shapes, compute and TP collectives depend on the degree", "TP degree",
                f"capture_fsdp(mesh={{'shard': s, 'tp': {par.tp}}}); simddp whatif --parallel "
                f"does")
        check_reshard(k, cap)
        check_sharded_knobs(k, "an FSDP2 replay", "FSDP2")
        self.cap, self.world, self.parallel = cap, world, par
        self.mesh = par.mesh()
        self.fsdp_size = par.shard
        self.shard_ratio = cap.shard_size / par.shard  # per-rank shard bytes vs the capture's
        self._plan(checked)

    def _iteration(self, p: int) -> tuple[Instruction, ...]:
        cap = self.cap
        units, resharded = self._units(p)
        out: list[Instruction] = []
        act = int(cap.activation_bytes)
        chunks = _activation_chunks(act, tuple(getattr(cap, "activation_sizes", ()) or ()),
                                    units)
        for phase in ("forward", "backward", "optimizer"):
            marks, after = self._phase_marks(p, phase, units, resharded, chunks)
            out.append(self._segment(phase, marks))
            out.extend(after)
            if phase == "forward" and act and not units:
                out.append(Memory("activations", act, "saved for backward",
                                  key=("activations", 0)))
            tmp = int(getattr(cap, "temporary_bytes", 0) or 0)
            if phase == "forward" and tmp:  # the loss's backward, all activations still held
                out.append(Memory("temporary", tmp, "temporaries (loss and its backward)",
                                  key=("temporary",)))
                out.append(Memory("temporary", -tmp, "temporaries freed", key=("temporary",)))
            if phase == "forward" and cap.recompute_bytes:
                out.append(Memory("activations", cap.recompute_bytes, "one block recomputed",
                                  key=("recomputed",)))
            if phase == "backward":
                out.append(WaitAll("wait: reduce-scatters (end of backward)"))
                if act and not units:
                    out.append(Memory("activations", -act, "freed by backward",
                                      key=("activations", 0)))
                if cap.recompute_bytes:
                    out.append(Memory("activations", -cap.recompute_bytes,
                                      "freed by backward", key=("recomputed",)))
        grads = sum(self._sharded_grad(b) for b in units)
        if grads:
            out.append(Memory("gradients", -grads, "zero_grad(set_to_none=True)"))
        return tuple(out)

    def _phase_marks(self, p: int, phase: str, units: list[int], resharded: list[bool],
                     activations: list[tuple[int, ...]] | None = None
                     ) -> tuple[list[Mark], list[Instruction]]:
        return event_marks([q[phase] for q in self.cap.profiles], p, phase,
                           self.prefetch.get(phase, 0), self._bytes, units=units,
                           resharded=resharded, sharded_grad=self._sharded_grad,
                           activations=activations)


def check_reshard(k: Knobs, cap: Any) -> None:
    """``k.reshard_after_forward``, when set, is the capture's (``cap``'s): FSDP2 issues other
    collectives with the other setting, so each needs its own capture."""
    if k.reshard_after_forward is not None and \
            bool(k.reshard_after_forward) != cap.reshard_after_forward:
        raise ValueError(f"reshard_after_forward={k.reshard_after_forward} but the capture "
                         f"ran with {cap.reshard_after_forward}: FSDP2's collectives differ "
                         f"between the two, so each needs its own capture")


def check_sharded_knobs(k: Knobs, replay: str, who: str) -> None:
    """The knobs a sharded replay (FSDP2's, a pipeline's) reads are valid, and DDP's are not
    set: ``replay`` names it in errors ("an FSDP2 replay"), ``who`` in the cost-mechanism
    note."""
    for name in ("forward_prefetch", "backward_prefetch"):
        v = getattr(k, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0 (units all-gathered ahead), "
                             f"got {v!r}")
    if k.comm_hook is not None or k.bucket_cap_mb is not None or k.period is not None \
            or k.uneven or k.groups != 1:
        raise ValueError(f"DDP's knobs (comm_hook, bucket_cap_mb, localsgd/slowmo, uneven, "
                         f"groups) do not apply to {replay}")
    default = type(k)()
    ddp_only = [n for n in ("overlap", "host_per_sample_us", "loader_workers", "sync_points",
                            "metric_allreduces")
                if getattr(k, n, None) != getattr(default, n, None)]
    if ddp_only:
        raise ValueError(f"{', '.join(ddp_only)}: these cost mechanisms are modelled for DDP "
                         f"replays only so far (the network's protocol latency and GPU "
                         f"contention apply to {who} too)")


def event_marks(phases: Sequence[dict[str, Any]], p: int, phase: str, prefetch: int,
                nbytes: Callable[[dict[str, Any]], int], *, tag: tuple = (),
                units: list[int] | None = None, resharded: list[bool] | None = None,
                sharded_grad: Callable[[int], int] | None = None,
                activations: list[tuple[int, ...]] | None = None
                ) -> tuple[list[Mark], list[Instruction]]:
    """A captured phase's collectives as the marks of its :class:`Segment` (see the module
    docstring: all-gathers issued ``prefetch`` ahead and waited where captured, reduce-scatters
    (with HSDP's all-reduce chained) waited at the end of backward, others where captured).

    ``phases``: per captured profile that phase's ``{"seconds", "events"}``; marks are ordered
    by profile ``p``'s offsets. ``nbytes(event)``: the bytes replayed. ``tag``: words after the
    phase's in every collective's tag (unique per phase within an iteration). ``units`` (the
    forward's all-gather sizes), ``resharded`` (per unit: resharded after forward) and
    ``sharded_grad`` (a unit's sharded gradient bytes from its all-gather's): FSDP2's memory
    marks; None: no memory marks. ``activations``: per unit, the tensors autograd saves in its
    forward (allocated as its compute ends, freed by its backward). Returns the marks and
    what follows the segment.

    Memory marks follow FSDP2's own allocations (``_fsdp_collectives.py``): an all-gather's
    output buffer is allocated on the all-gather copy-in stream when it is issued and freed
    when the next all-gather is issued (``comm_ctx.all_gather_state``); the unit's unsharded
    parameters are allocated by the copy-out where the all-gather is waited for and freed at
    reshard; a reduce-scatter's input (in the reduce dtype) is allocated on the compute stream
    and the unsharded gradients freed after the copy-in; its output — the sharded gradient —
    is allocated on the reduce-scatter stream; the input is held until the next
    reduce-scatter (``comm_ctx.reduce_scatter_states``), the last until the end of backward."""
    memory = sharded_grad is not None
    units = units or []
    resharded = resharded or []
    evs = phases[p]["events"]
    at = lambda i, key: tuple(  # noqa: E731 - per profile: event i's offset
        float(q["events"][i][key] if q["events"][i][key] is not None
              else q["events"][i]["offset"]) for q in phases)
    if len(phases) == 1:  # the same, without a generator (a pipeline asks this ~10^6 times)
        at = lambda i, key: (float(evs[i][key] if evs[i][key] is not None  # noqa: E731
                                   else evs[i]["offset"]),)
    # FSDP's unit all-gathers (tensor parallelism's keep their captured points, as others)
    gathers = [i for i, e in enumerate(evs) if fsdp_gather(e)]
    # the unit each all-gather unshards: forward, in order; backward, the resharded units
    # in reverse
    if phase == "backward":
        order = [u for u in range(len(units)) if u < len(resharded) and resharded[u]][::-1]
    else:
        order = list(range(len(units)))
    unit_of = lambda j: order[j] if j < len(order) else ("extra", phase, j)  # noqa: E731
    d = prefetch
    items: list[tuple[tuple[float, ...], int, int, Any]] = []  # (at, order, index, do)
    tags = {}
    for j, i in enumerate(gathers):  # issued where gather j - d was needed
        src = gathers[max(0, j - d)]
        t = (phase[0] + "ag", *tag, j)
        tags[i] = t
        c = Collective(t, evs[i]["scope"], evs[i]["op"], nbytes(evs[i]), phase == "backward")
        issue_at = at(src, "wait_at") if j - d >= 0 else at(i, "offset")
        items.append((issue_at, 0, i, Issue(((c, 0.0),), kind=phase, pending=False)))
        if memory:
            b = evs[i]["bytes"]
            if j > 0:
                items.append((issue_at, 1, i, Memory(
                    "communication", -evs[gathers[j - 1]]["bytes"], "all-gather output freed",
                    stream="all_gather_copy_in", key=("ag_output", phase, *tag, j - 1))))
            items.append((issue_at, 1, i, Memory("communication", b, "all-gather output",
                                                 stream="all_gather_copy_in",
                                                 key=("ag_output", phase, *tag, j))))
            items.append((at(i, "wait_at"), 3, i, Memory(
                "parameters", b, "unsharded (all-gather copy-out)",
                key=("unsharded", *tag, unit_of(j)))))
        items.append((at(i, "wait_at"), 2, i, Wait(t, f"wait: all-gather {j}")))
    after: list[Instruction] = []
    if memory and gathers:
        after.append(Memory("communication", -evs[gathers[-1]]["bytes"],
                            "all-gather output freed", stream="all_gather_copy_in",
                            key=("ag_output", phase, *tag, len(gathers) - 1)))
    # forward: a unit's activations are saved as its compute ends (where the next unit's
    # compute starts), and a resharded unit's parameters are freed then
    if phase == "forward" and memory:
        for j, i in enumerate(gathers):
            mem: list[Memory] = []
            if activations and j < len(activations) and activations[j]:
                mem.append(Memory("activations", sum(activations[j]), "saved for backward",
                                  sizes=tuple(activations[j]), key=("activations", *tag, j)))
            if j < len(resharded) and resharded[j]:
                mem.append(Memory("parameters", -evs[i]["bytes"], "resharded after forward",
                                  key=("unsharded", *tag, unit_of(j))))
            if j + 1 < len(gathers):
                # before the next unit's pre-forward (its wait, copy-out and prefetch)
                items.extend((at(gathers[j + 1], "wait_at"), -2 + n, i, m)
                             for n, m in enumerate(mem))
            else:
                after.extend(mem)
    nscatter = 0
    prev_input: tuple[Any, int] | None = None
    skip = set()
    for i, e in enumerate(evs):
        if i in tags or i in skip:
            continue
        c = Collective((phase[0] + "c", *tag, i), e["scope"], e["op"], nbytes(e),
                       phase == "backward")
        if e["scope"] == "tp":  # DTensor's: synchronous, on the compute stream
            items.append((at(i, "offset"), 0, i, Issue(((c, 0.0),), kind=phase,
                                                       pending=False)))
            items.append((at(i, "wait_at"), 2, i, Wait(c.tag, f"wait: {e['op']} (tp)")))
        elif e["op"] in _SCATTERS:
            stages = [(c, 0.0)]
            nxt = i + 1
            if nxt < len(evs) and evs[nxt]["scope"] == "replicate" and \
                    evs[nxt]["op"] == "all_reduce":  # HSDP: the shard's all-reduce
                skip.add(nxt)
                stages.append((Collective((phase[0] + "c", *tag, nxt), "replicate",
                                          "all_reduce", nbytes(evs[nxt]), True), 0.0))
            unit = len(units) - 1 - nscatter  # reduce-scatters run in reverse unit order
            nscatter += 1
            ub = units[unit] if 0 <= unit < len(units) else 0
            mem = []
            if memory:
                if prev_input is not None:
                    mem.append(Memory("communication", -prev_input[1],
                                      "reduce-scatter input freed",
                                      key=("rs_input", *tag, prev_input[0])))
                mem.append(Memory("gradients", ub or e["bytes"], "unsharded gradient",
                                  key=("unsharded_grad", *tag, unit)))
                mem.append(Memory("communication", e["bytes"], "reduce-scatter input",
                                  key=("rs_input", *tag, unit)))
                mem.append(Memory("gradients", -(ub or e["bytes"]), "copied in, freed",
                                  key=("unsharded_grad", *tag, unit)))
                prev_input = (unit, e["bytes"])
            items.extend((at(i, "offset"), n, i, m) for n, m in enumerate(mem))
            items.append((at(i, "offset"), len(mem), i, Issue(tuple(stages), kind=phase,
                                                              pending=True)))
            if memory:
                mem = [Memory("gradients", sharded_grad(ub), "sharded gradient",
                              stream="reduce_scatter", key=("grad", *tag, unit))]
                if ub:
                    mem.append(Memory("parameters", -ub, "resharded after backward",
                                      key=("unsharded", *tag, unit)))
                if activations and 0 <= unit < len(activations) and activations[unit]:
                    mem.append(Memory("activations", -sum(activations[unit]),
                                      "freed by backward", key=("activations", *tag, unit)))
                items.extend((at(i, "offset"), 10 + n, i, m) for n, m in enumerate(mem))
        elif e["wait_at"] is not None:
            items.append((at(i, "offset"), 0, i, Issue(((c, 0.0),), kind=phase,
                                                       pending=False)))
            items.append((at(i, "wait_at"), 2, i, Wait(c.tag, f"wait: {e['op']}")))
        else:
            items.append((at(i, "offset"), 0, i, Issue(((c, 0.0),), kind=phase,
                                                       pending=True)))
    if memory and prev_input is not None:  # the root's post-backward frees the last input
        after.append(Memory("communication", -prev_input[1], "reduce-scatter input freed",
                            key=("rs_input", *tag, prev_input[0])))
    items.sort(key=lambda x: (x[0][p], x[1], x[2]))
    return [Mark(a, do) for a, _, _, do in items], after


def _activation_chunks(total: int, sizes: tuple[int, ...], weights: Sequence[int]
                       ) -> list[tuple[int, ...]]:
    """``total`` saved bytes split over the units in forward order, in proportion to
    ``weights`` (each unit's parameter bytes: a unit's activations grow with its matmuls): the
    captured tensors (``sizes``, in the order autograd saved them) in consecutive runs, else
    one share each."""
    n, w = len(weights), sum(weights)
    if n == 0 or total <= 0 or w <= 0:
        return []
    bounds, acc = [], 0
    for x in weights:
        acc += x
        bounds.append(total * acc / w)
    if not sizes or sum(sizes) != total:
        out, prev = [], 0
        for b in bounds:
            out.append((int(round(b)) - prev,))
            prev = int(round(b))
        return out
    runs: list[list[int]] = [[] for _ in range(n)]
    done, j = 0, 0
    for x in sizes:
        while j < n - 1 and done + x / 2 > bounds[j]:
            j += 1
        runs[j].append(x)
        done += x
    return [tuple(r) for r in runs]


def plan_fsdp(cap: CapturedStep, checked: CheckedKnobs) -> FSDPProgram:
    """The FSDP2 planner: ``cap`` as a step program for ``checked``'s world and knobs."""
    return FSDPProgram(cap, checked)
