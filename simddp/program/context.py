"""The context-parallel planner: a captured ring-attention step
(:func:`~simddp.cosim.context_parallel.capture_cp`: torch's context parallelism with FSDP2,
optionally tensor parallelism) as a step program on a world of any size.

What the capture gives, per phase and rank: the compute (waits excluded) and every collective
in torch's issue order at its compute offset — FSDP2's all-gathers and reduce-scatters on the
flattened data-parallel × CP dimension (``"shard_cp"``, torchtitan's ``dp_shard_cp``), HSDP's
all-reduces across replicas, DTensor's TP collectives (``"tp"``) and the ring attention's
(``"cp"``), each ring collective with the compute offset where torch waited for it (the next
ring step's ``_maybe_wait``). The planner keeps torch's order and overlap:

* the ring's K/V exchanges (``allgather``: one all-gather of every rank's K and V per
  attention forward and backward; ``alltoall``: one ``permute_tensor`` per ring step) and
  backward's dK/dV rotation (one ``permute_tensor`` per step) are issued where torch issued
  them and waited for where torch waited — on a GPU they run on the communication stream
  while the ring step before the wait computes, so a step's exchange is hidden behind the
  attention of the step before it whenever it is shorter;
* a ``permute_tensor`` (an all-to-all whose splits send the whole buffer to the next rank) is
  costed as what it moves: each rank sends its buffer to one peer and receives one, a
  point-to-point transfer of its bytes on the CP communicator (cost kind ``p2p``);
* FSDP2's, TP's and the other collectives as the FSDP2 planner places them
  (:func:`~simddp.program.fsdp.event_marks`: all-gathers prefetched, reduce-scatters waited for
  at the end of backward, TP's synchronous), on the communicators of their dimensions.

Bytes: the ring's are the capture's at any world size (the CP degree fixes the sequence shard);
FSDP2's all-gathers and reduce-scatters carry the unsharded size, an HSDP all-reduce one shard
(it scales with 1 / (shard × cp)). Compute: forward and backward are the capture's (the local
batch and sequence shard are the same at any world size); the optimizer updates the local
shard, so it scales with 1 / (shard × cp). A replay needs the capture's CP and TP degrees:
each degree has its own per-rank shapes, ring steps and bytes.

Memory per rank as the FSDP2 planner counts it (parameters sharded over shard × cp; under TP
the TP rank's), with the activations the capture measured on a CP rank (its sequence shard:
about 1 / cp of a whole sequence's) and, in ``"communication"``, each ring collective's output
(the gathered K/V, a rotated block) from its issue until the next ring collective of the phase
replaces it.

The replay's mesh (:class:`CPMesh`) is torchtitan's row-major ``replicate × shard × cp × tp``
(TP innermost, then CP), with the flattened ``"shard_cp"`` dimension FSDP2 shards over.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from .captured import ShardedStep
from .fsdp import ShardedProgram, check_reshard, check_sharded_knobs, event_marks
from .knobs import CheckedKnobs
from .mesh import DeviceMesh
from .parallel import Parallel, degrees_not_captured, layout_not_captured
from .steps import Collective, Instruction, Issue, Mark, Memory, Wait, WaitAll, peak_memory

__all__ = ["CapturedCP", "CPMesh", "CPProgram", "plan_cp", "ring_collectives"]


@dataclass
class CapturedCP(ShardedStep):
    """One context-parallel training step as
    :func:`~simddp.cosim.context_parallel.capture_cp` recorded it; JSON-serialisable. The
    fields FSDP2's :class:`~simddp.program.captured.CapturedStep` has
    (:class:`~simddp.program.captured.ShardedStep`'s; not a ``CapturedStep``: a registry that
    finds a planner by ``isinstance`` must not take it for FSDP2's) — ``mesh``: ``{"shard": s,
    "cp": c}``, optionally ``"replicate"`` first and ``"tp"`` last; event scopes ``"shard_cp"``,
    ``"cp"``, ``"tp"``, ``"replicate"``; every ``"cp"`` event has its ``wait_at`` — plus the
    sequence length (whole, before sharding), torch's rotate method, whether the causal load
    balancing was on and the device. ``activation_bytes``: one CP rank's (its sequence
    shard's)."""

    seq_len: int = 0
    rotate_method: str = "allgather"
    load_balance: bool = True
    device: str = "cpu"

    @property
    def cp_size(self) -> int:
        return int(self.mesh.get("cp", 1))


class CPMesh(DeviceMesh):
    """torch's ``DeviceMesh`` of a context-parallel layout: the dimensions ``dims`` in
    torchtitan's row-major order (``replicate``, ``shard``, ``cp``, ``tp``), plus the
    flattened ``"shard_cp"`` scope — ``shard`` × ``cp`` together, FSDP2's sharding group —
    whose ranks are the strided range of ``cp``'s stride that the two adjacent dimensions
    span."""

    def __init__(self, world: int, dims: dict[str, int]) -> None:
        super().__init__(world, dims)
        if "cp" not in dims or "shard" not in dims:
            raise ValueError(f"CPMesh: {dims} needs 'shard' and 'cp' dimensions")
        self._own = dict(dims)
        self.dims["shard_cp"] = dims["shard"] * dims["cp"]
        self._stride["shard_cp"] = self._stride["cp"]
        self.scopes = (*self.scopes, "shard_cp")

    def describe(self) -> dict[str, Any]:
        return dict(self._own)


def ring_collectives(events: Sequence[dict[str, Any]]) -> Counter:
    """How many of each op the ring issued (the ``"cp"`` events of a phase profile)."""
    return Counter(e["op"] for e in events if e["scope"] == "cp")


def _p2p(ev: dict[str, Any]) -> bool:
    """torch's ``permute_tensor`` (an all-to-all sending the whole buffer to one peer)."""
    return ev["op"].startswith("all_to_all")


class CPProgram(ShardedProgram):
    """A captured context-parallel step as a step program for one world and set of knobs (see
    the module docstring). ``parallel``: the layout replayed (a
    :class:`~simddp.program.parallel.Parallel`, ``cp:N`` with ``fsdp``, ``hsdp:S`` or ``dp``,
    optionally ``tp:T``; ``cp:N`` alone is FSDP2 over the ring's ranks, as torchtitan shards
    over ``dp_shard_cp``). FSDP2's part is the FSDP2 planner's
    (:class:`~simddp.program.fsdp.ShardedProgram`, sharded over shard × cp)."""

    def __init__(self, cap: CapturedCP, checked: CheckedKnobs) -> None:
        k = checked.knobs
        world = checked.world
        shard_word = "fsdp" if cap.parallel == "fsdp" else f"hsdp:{cap.shard_size}"
        spec = k.parallel or (f"{shard_word},cp:{cap.cp_size}"
                              + (f",tp:{cap.tp_size}" if cap.tp_size > 1 else ""))
        par = Parallel.parse(spec, world)
        why = par.not_replayed()
        if why:
            raise ValueError(f"parallel={spec!r}: {why}")
        data = "fsdp" if par.data == "ddp" else par.data  # cp:N alone: FSDP2 over the ring
        if par.cp < 2 or data != cap.parallel:
            raise layout_not_captured(spec, f"{cap.parallel.upper()} × CP", cap.name,
                                      f"give cp:{cap.cp_size} with "
                                      f"{shard_word.partition(':')[0]}")
        cp = par.cp
        if cp != cap.cp_size or par.tp != cap.tp_size:
            raise degrees_not_captured(
                spec, f"cp={cp}, tp={par.tp}", cap.name, f"cp={cap.cp_size}, tp={cap.tp_size}",
                "sequence shard, ring steps and bytes depend on the degrees", "degrees",
                f"capture_cp with mesh cp={cp}{f', tp={par.tp}' if par.tp > 1 else ''}")
        check_reshard(k, cap)
        check_sharded_knobs(k, "a context-parallel replay", "CP")
        self.cap, self.world, self.cp = cap, world, cp
        self.parallel = par
        dims = {"replicate": par.replicate, "shard": par.shard, "cp": cp, "tp": par.tp}
        self.mesh = CPMesh(world, {d: v for d, v in dims.items()
                                   if v > 1 or d in ("shard", "cp")
                                   or (d == "replicate" and data == "hsdp")})
        self.fsdp_size = par.shard * cp  # FSDP2's group: shard × cp
        self.shard_ratio = (cap.shard_size * cap.cp_size) / self.fsdp_size
        self._plan(checked)

    def memory(self, rank: int | None = None) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per category at the peak) of ``rank`` in one step (every rank
        runs the same memory events: None is any rank)."""
        peak, at_peak, _ = peak_memory(self.iteration(rank or 0, 0), self.static_memory())
        return peak, at_peak

    # -- the instructions ------------------------------------------------------------------
    def _iteration(self, p: int) -> tuple[Instruction, ...]:
        cap = self.cap
        units, resharded = self._units(p)
        out: list[Instruction] = []
        act = int(cap.activation_bytes)
        for phase in ("forward", "backward", "optimizer"):
            phases = [q[phase] for q in cap.profiles]
            rest = [{**q, "events": [e for e in q["events"] if e["scope"] != "cp"]}
                    for q in phases]
            marks, after = event_marks(rest, p, phase, self.prefetch.get(phase, 0), self._bytes,
                                       units=units, resharded=resharded,
                                       sharded_grad=self._sharded_grad)
            ring = self._ring_marks(phases, p, phase)
            if ring:  # merged by offset, the ring's after FSDP2's at the same point
                marks = [m for _, _, m in sorted(
                    [(m.at[p], 0, m) for m in marks] + [(m.at[p], 1, m) for m in ring],
                    key=lambda x: (x[0], x[1]))]
            out.append(self._segment(phase, marks))
            out.extend(after)
            if phase == "forward" and act:
                out.append(Memory("activations", act, "saved for backward"))
            if phase == "forward" and cap.recompute_bytes:
                out.append(Memory("activations", cap.recompute_bytes, "one block recomputed"))
            if phase == "backward":
                out.append(WaitAll("wait: reduce-scatters (end of backward)"))
                if act or cap.recompute_bytes:
                    out.append(Memory("activations", -act - cap.recompute_bytes,
                                      "freed by backward"))
        grads = sum(self._sharded_grad(b) for b in units)
        if grads:
            out.append(Memory("gradients", -grads, "zero_grad(set_to_none=True)"))
        return tuple(out)

    def _ring_marks(self, phases: list[dict[str, Any]], p: int, phase: str) -> list[Mark]:
        """The ring's collectives of ``phase``: issued at their captured offsets, waited for
        where torch waited, their output held (``communication``) until the next one."""
        idx = [i for i, e in enumerate(phases[p]["events"]) if e["scope"] == "cp"]
        if not idx:
            return []
        for q in phases:
            if [e["scope"] for e in q["events"]] != [e["scope"] for e in phases[p]["events"]]:
                raise ValueError("capture_cp's ranks issued their ring collectives in "
                                 "different orders; replay needs the same program per rank")
        at = lambda i, key: tuple(float(q["events"][i][key]) for q in phases)  # noqa: E731
        marks: list[Mark] = []
        held = 0
        for n, i in enumerate(idx):
            e = phases[p]["events"][i]
            tag = (phase[0] + "ring", n)
            op = "send" if _p2p(e) else e["op"]
            c = Collective(tag, "cp", op, int(e["bytes"]), phase == "backward")
            recv = int(e["bytes"])  # all-gather: the gathered buffer; permute: one block
            if held:
                marks.append(Mark(at(i, "offset"), Memory("communication", -held,
                                                          "ring buffer replaced")))
            marks.append(Mark(at(i, "offset"), Memory("communication", recv,
                                                      f"ring {e['op']} output")))
            held = recv
            marks.append(Mark(at(i, "offset"), Issue(((c, 0.0),), kind=phase, pending=False)))
            marks.append(Mark(at(i, "wait_at"), Wait(tag, f"wait: ring {e['op']} {n}")))
        # the last buffer is held until the phase's end
        marks.append(Mark(tuple(float(q["seconds"]) for q in phases),
                          Memory("communication", -held, "ring buffer freed")))
        return marks


def plan_cp(cap: CapturedCP, checked: CheckedKnobs) -> CPProgram:
    """The context-parallel planner: ``cap`` as a step program for ``checked``'s world."""
    if not isinstance(cap, CapturedCP):
        raise TypeError(f"plan_cp plans a CapturedCP, got {type(cap).__name__}")
    return CPProgram(cap, checked)

