"""Replay's vectorised engine: every rank of an SPMD step program advanced as numpy arrays.

All ranks run the same instructions (:mod:`simddp.program.steps`); only their times differ
(their profile, speed and noise draws). So instead of a simpy process per rank
(:class:`~simddp.replay.simpy_engine._Replay`), this engine walks the instructions once and
each one updates an array over ranks (one pass: :class:`~simddp.replay.vector_pass.PlanPass`).
Each collective is one scalar per communicator (a DDP group's, or a node subgroup's):
``start = max(latest arrival of its members, end of the communicator's previous
collective)``, ``end = start + duration``, the duration being the network model's time (for
the communicator's size and placement, :meth:`~simddp.program.mesh.Mesh.placements`) times
the same noise factor the simpy engine draws (:mod:`simddp.models.noise`: one factor per
collective, in the order the collectives are created — see :meth:`VectorReplay.run` for how
that order is found when several communicators interleave). Every float is computed with the
same operations in the same order as in :class:`_Replay`, so iteration boundaries are the
simpy engine's bit for bit; the per-iteration compute, wait, comm and exposed-comm figures are
sums of the same intervals in another order (equal to float rounding).

Results keep no per-rank spans: per rank and iteration arrays of boundaries, compute per
phase, waits, comm and exposed comm (:class:`~simddp.analysis.arrays.ArrayTimeline`). A rank's
spans and collectives are materialised on demand by re-running the plan for that rank alone
against the recorded collectives (:meth:`VectorReplay.lanes`).

Not vectorised (:func:`unsupported` names why; :func:`~simddp.replay.replay` says which
engine ran and why in the result): programs that are not uniform (Join's shadow iterations,
captured ranks whose forward collectives differ in order), shared NICs that several DDP
groups contend for (``shared_nic``: links couple communicators in time), the network's
contention, and a mix of chained and single-stage gradient buckets (PowerSGD with sparse
buckets: they share the side stream in time order).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..analysis.arrays import ArrayTimeline
from ..models import noise
from ..program.knobs import CheckedKnobs
from ..program.steps import Instruction, Issue, Segment
from .vector_pass import PlanPass
from .vector_records import Record, ResultRecords, Scope, Step, comm_figures

__all__ = ["VectorReplay", "unsupported", "DrawOrderUnsettled", "issues_of"]

_MAX_PASSES = 64  # passes to settle the draw order of interleaved communicators


class DrawOrderUnsettled(RuntimeError):
    """The noise draw order of interleaved communicators did not settle (replay() then runs
    the simpy engine)."""


def issues_of(instructions: Sequence[Instruction]) -> list[Issue]:
    """Every issue of ``instructions``, segments' marks included, in program order."""
    out = []
    for ins in instructions:
        if type(ins) is Issue:
            out.append(ins)
        elif type(ins) is Segment:
            out.extend(m.do for m in ins.marks if type(m.do) is Issue)
    return out


def unsupported(program: Any, checked: CheckedKnobs) -> str | None:
    """Why this engine cannot run ``program`` with these knobs (None: it can). The one
    predicate that decides; extend it with every new instruction or knob."""
    why = program.uniform()
    if why is not None:
        return why
    net = checked.network
    contention = getattr(net, "contention", None)
    if contention is not None and contention.active:
        return ("the network's Contention (compute slowed while communicating; on GPU "
                "presets by default: gpu_contention='off' / --no-gpu-contention for a study "
                "without it)")
    mesh = program.mesh
    if getattr(mesh, "shared_nic", False) and mesh.groups > 1 and \
            checked.world > (net.gpus_per_node or checked.world):
        return "shared NICs contended by several DDP groups"
    for it in range(program.iterations):
        issues = issues_of(program.iteration(0, it))
        if any(len(x.stages) > 1 and not x.pending for x in issues):
            return "a chained issue waited for on its own"
        buckets = {len(x.stages) > 1 for x in issues if x.pending and x.first.in_backward}
        if len(buckets) > 1:
            return "a mix of chained (PowerSGD) and single-stage buckets"
    if program.epilogue(0):
        return "an epilogue after the last iteration"
    return None


class VectorReplay(ResultRecords):
    """One vectorised replay of ``program`` (see the module docstring)."""

    def __init__(self, program: Any, checked: CheckedKnobs) -> None:
        self.program, self.mesh = program, program.mesh
        world = self.world = checked.world
        self.net = checked.network
        self.iterations = program.iterations
        self.jitter, self.seed = checked.knobs.jitter, checked.knobs.seed
        self.nprof = program.nprofiles
        self.slow = np.ones(world)
        for r, v in checked.speeds.items():
            self.slow[r] = 1.0 / v
        self.noise = None
        if self.jitter > 0:  # the simpy engine's draws: same generator, same shape
            self.noise = noise.lognormal(noise.generator(self.seed, 0), self.jitter,
                                         (world, self.iterations, 4))
        used = {c.scope for it in range(self.iterations)
                for x in issues_of(program.iteration(0, it)) for c, _ in x.stages}
        # placement: per communicator, its members per node and the tiers it spans
        self.scopes = {k: Scope(k, *self.mesh.codes(k), self.mesh.placements(k, self.net))
                       for k in self.mesh.scopes if k in used}
        self.multi = sum(len(s.present) for s in self.scopes.values()) > 1
        self.steps: dict[tuple, Step] = {}
        self.order: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 2
        # ^ (step index, communicator code) of every collective, in creation order
        self._lane_cache: dict[int, Any] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self.passes = 0

    def per_profile(self, seconds: tuple[float, ...]) -> np.ndarray:
        """A duration's per-profile values as an array (cached per tuple)."""
        a = self._arrays.get(id(seconds))
        if a is None:
            a = self._arrays[id(seconds)] = np.array(seconds, dtype=float)
        return a

    # -- collective durations ----------------------------------------------------------------
    def _factors(self, n: int) -> np.ndarray:
        """The first n network noise factors, exactly as :class:`noise.Stream` yields them."""
        rng = noise.generator(self.seed, 1)
        blocks = [noise.lognormal(rng, self.jitter, noise.BLOCK)
                  for _ in range(max(1, -(-n // noise.BLOCK)))]
        return np.concatenate(blocks)[:n]

    def _draws(self) -> int:
        """How many noise factors the run draws: one per collective of more than one rank."""
        per = {k: int((sc.size > 1).sum()) for k, sc in self.scopes.items()}
        return sum(per[c.scope] for it in range(self.iterations)
                   for x in issues_of(self.program.iteration(0, it)) for c, _ in x.stages)

    def units(self, it: int) -> int:
        """Progress units of iteration ``it``: its issues and segments, and its end."""
        ins = self.program.iteration(0, it)
        return len(issues_of(ins)) + sum(type(x) is Segment for x in ins) + 1

    # -- one pass over the plan -------------------------------------------------------------
    def _pass(self, ranks: np.ndarray, rec: Record, full: bool, factors: np.ndarray | None,
              progress: Any = None) -> None:
        """One pass over the plan for ``ranks``, phase by phase (:class:`PlanPass`)."""
        PlanPass(self, ranks, rec, full, factors).run(progress)

    # -- the run -----------------------------------------------------------------------------
    def run(self, progress: Any = None) -> ArrayTimeline:
        """Replay every rank; returns the timeline. ``progress(done, total, description)``.

        With one communicator (one DDP group, no node subgroups) collectives are created in
        plan order, which is the simpy engine's noise draw order. With several, the simpy
        engine creates them in virtual-time order (a communicator's collective when its first
        member issues it; ties by the lowest rank, as simpy runs rank processes started at
        one time in rank order), interleaving communicators. That order depends on the draws
        themselves, so the pass is repeated with the order the previous pass produced until
        it reproduces itself (a causal fixed point: the earliest collectives are right after
        the first pass, and each pass fixes at least the next; in practice a few passes).
        After :data:`_MAX_PASSES` it raises :class:`DrawOrderUnsettled` and replay() uses simpy.

        Ties at a later instant (collectives on two communicators created at one time, after
        a wait released their ranks together) are broken the same way, where simpy wakes
        ranks in the order they began to wait. Ranks' compute carries their own noise, so
        that only happens with no jitter (no draws: only the order of the ``collectives``
        list can differ) or a vanishing one (~1e-16, the factors' last bits)."""
        what = f"replay: {self.world:,} ranks, vectorised"
        ranks = np.arange(self.world, dtype=np.int64)
        factors = None
        if self.noise is not None:
            factors = self._factors(self._draws())
        total = sum(self.units(it) for it in range(self.iterations))

        def tick(done: int, tot: int) -> None:
            if progress is not None:
                progress(done, total + 1, what if self.passes == 0 else
                         f"{what} (pass {self.passes + 1})")

        if progress is not None:
            progress(0, total + 1, what)
        while True:
            rec = Record(self.world, self.iterations, rows=False)
            self._pass(ranks, rec, True, factors, tick)
            self.passes += 1
            steps = list(self.steps.values())
            if not self.multi:
                order = (np.arange(len(steps)), np.zeros(len(steps), dtype=np.int64))
                break
            order = self._creation_order(steps)
            if factors is None or not self._redraw(steps, *order):
                break
            if self.passes >= _MAX_PASSES:
                raise DrawOrderUnsettled(f"the draw order of {self.world} ranks' collectives "
                                         f"did not settle in {_MAX_PASSES} passes")
        self.order = order
        if progress is not None:
            progress(total, total + 1, f"{what}: statistics")
        steps = list(self.steps.values())
        comm, exposed = comm_figures(steps, self.scopes, rec)
        by_scope = {}
        for name in sorted({st.scope for st in steps}):  # each dimension's collectives alone
            mine = [st for st in steps if st.scope == name]
            by_scope[name] = exposed if len(mine) == len(steps) else \
                comm_figures(mine, self.scopes, rec)[1]
        tl = ArrayTimeline(self.world, self.iterations, bounds=rec.bounds,
                           forward=rec.forward, backward=rec.backward, optimizer=rec.optimizer,
                           wait=rec.wait, comm=comm, exposed=exposed, lanes=self.lanes,
                           exposed_by_scope=by_scope)
        if progress is not None:
            progress(total + 1, total + 1, f"{what}: done")
        return tl

    def _creation_order(self, steps: list[Step]) -> tuple[np.ndarray, np.ndarray]:
        """Every (step index, communicator code), in the order the simpy engine creates them."""
        keys_t, keys_r, keys_p, who_s, who_c = [], [], [], [], []
        for i, st in enumerate(steps):
            pres = self.scopes[st.scope].present
            keys_t.append(st.ctime[pres])
            keys_r.append(st.crank[pres])
            keys_p.append(np.full(len(pres), st.pos))
            who_s.append(np.full(len(pres), i))
            who_c.append(pres)
        t, r, p = np.concatenate(keys_t), np.concatenate(keys_r), np.concatenate(keys_p)
        o = np.lexsort((p, r, t))
        return np.concatenate(who_s)[o], np.concatenate(who_c)[o]

    def _redraw(self, steps: list[Step], step_of: np.ndarray, code_of: np.ndarray) -> bool:
        """Give every collective of more than one rank the noise factor of its place in
        creation order; whether any changed."""
        sizes = np.empty(len(step_of), dtype=np.int64)
        for i, st in enumerate(steps):
            m = step_of == i
            sizes[m] = self.scopes[st.scope].size[code_of[m]]
        drawn = sizes > 1
        index = np.cumsum(drawn) - 1
        changed = False
        for i, st in enumerate(steps):
            m = (step_of == i) & drawn
            new = index[m]
            if not np.array_equal(st.draw[code_of[m]], new):
                st.draw[code_of[m]] = new
                changed = True
        return changed
