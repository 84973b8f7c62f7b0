"""Coarse-grained charging of backward passes: co-simulation's fast path.

A do-nothing ``TorchDispatchMode`` alone nearly doubles the cost of a DDP step (torch boxes
every op's arguments into Python), and two thirds of a training step's ops run in
backward. So a backward pass whose ops the rank has already seen, twice in a row and
identically, runs with the rank's :class:`~simddp.cosim.dispatch.ClockMode` off, and its
cost comes from a *tape*: the charges of its ops (each op's ticks, or with jitter its noise
entry: the factors are still drawn from the noise streams, op by op, in the recorded order)
cut at the *events* where the clock is read — a collective's issue, a wait, the end of
backward. At each event the clock is advanced by the ops before it, so every collective's
issue time, every wait and every span is exactly what the per-op path gives.

The key of a backward pass is its autograd graph, walked from the roots: each node's type,
edges, input metadata and saved state (scalars, sizes, strides; saved tensors' shapes,
dtypes and strides, without unpacking them), each leaf's parameter (identity, shape, its
``.grad``'s layout), the gradients fed in, the engine's flags, and each DDP forward since the
last backward with its sync flags (``no_sync``: its Reducer issues nothing). Not coarse (per-op, as
before): ranks with ``slow_rank`` faults, compute models other than roofline and constant
(others may depend on anything), graphs holding Python autograd Functions or saved-tensor
hooks (checkpointing), leaves with Python hooks, anomaly mode, ``inputs=``, reentrant
backward, other dispatch modes, a collective in flight at the start, and any tape that saw
what a tape cannot hold (a future callback, an optimizer step, ``simddp.now()``, an access to
a tensor a collective writes). What the key cannot see — Python hooks on non-leaf tensors or
nodes that do different work from one iteration to the next on the same graph — is checked
where it would show: a replay that meets an event its tape does not have raises
:class:`Divergence`, and :func:`~simddp.cosim.simulate.simulate` reruns the world per-op
(so does an exception escaping a replay). The one assumption left: such a hook whose changing
work adds no event, only ops between two events, goes uncharged (``simulate(coarse=False)``).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..compat import (current_graph_task_id, len_torch_dispatch_stack, pop_torch_dispatch_stack,
                      push_on_torch_dispatch_stack, queue_callback)
from .bound import current
from .keys import SCALARS, TENSORS, Ineligible, backward_key, note_subgraph, t_meta

if TYPE_CHECKING:
    from .clock import RankClock

__all__ = ["Divergence", "install", "uninstall", "event", "interrupt", "segment", "store",
           # the keys' pieces modules and steps use (from .keys)
           "Ineligible", "SCALARS", "TENSORS", "note_subgraph", "t_meta"]

_floor = math.floor
_gtid = current_graph_task_id
_TAPE_LIMIT = 256  # keys kept per rank (a program with more shapes than this rebuilds them)
BWD = 1  # clock.BWD (not imported: clock imports this module)


class Divergence(RuntimeError):
    """A replayed backward met an event its tape does not hold: the program did something
    its graph did not show. :func:`simulate` reruns the world per-op."""


def pure(compute: Any) -> bool:
    """Whether ``compute``'s costs are a function of the ops alone (a tape may hold them)."""
    from ..models.compute import ConstantCompute, RooflineCompute
    return type(compute) in (ConstantCompute, RooflineCompute)


def eligible(r: "RankClock") -> bool:
    return eligible_in(r, None)


def eligible_in(r: "RankClock", override: int | None) -> bool:
    """Whether a segment may start now on ``r`` (its clock's override being ``override``)."""
    return (r.coarse and r.rec is None and r.play is None and r.override == override
            and not r.flights and not r.rank_faults and _gtid() == -1
            and len_torch_dispatch_stack() == 1 and not torch.is_anomaly_enabled())


# -- tapes ---------------------------------------------------------------------------------
class Tape:
    """One backward's charges, cut at its events: ``events`` [(signature, ops before it)],
    ``tail``: the ops after the last event; ops are ticks (int) or noise entries."""

    __slots__ = ("events", "tail", "confirmed")

    def __init__(self, events: list, tail: list) -> None:
        self.events = events
        self.tail = tail
        self.confirmed = False

    def form(self) -> tuple:
        """What two recordings must share to confirm each other (noise streams by identity)."""
        def ops(xs: list) -> tuple:
            return tuple([x if x.__class__ is int else (x[0], id(x[1]), x[2]) for x in xs])
        return (tuple([(s, ops(o)) for s, o in self.events]), ops(self.tail))


class Recorder:
    """A backward being observed per-op: the ops (appended by ClockMode) and the events."""

    __slots__ = ("ops", "events", "clean", "start")

    def __init__(self) -> None:
        self.ops: list = []
        self.events: list = []
        self.clean = True
        self.start = 0

    def mark(self, sig: tuple) -> None:
        self.events.append((sig, self.ops[self.start:]))
        self.start = len(self.ops)

    def tape(self) -> Tape:
        return Tape(self.events, self.ops[self.start:])


class Player:
    """A segment being replayed from its tape (ClockMode off); its ops are of ``phase``."""

    __slots__ = ("tape", "i", "phase")

    def __init__(self, tape: Tape, phase: int = BWD) -> None:
        self.tape = tape
        self.i = 0
        self.phase = phase

    def charge(self, r: "RankClock", ops: list) -> None:
        """Advance ``r`` by ``ops`` as the per-op path would."""
        if not ops:
            return
        if r.phase != self.phase:
            r.switch(self.phase)
        noise = r.noise
        if noise is None:
            r.ticks += sum(ops)
            return
        t = 0
        for q, st, k in ops:
            i = st[0]
            st[0] = (i + k) & 0xFFFF
            t += _floor(q * noise[i])
        r.ticks += t

    def advance(self, r: "RankClock", sig: tuple) -> None:
        events = self.tape.events
        if self.i >= len(events) or events[self.i][0] != sig:
            want = events[self.i][0] if self.i < len(events) else "the end of backward"
            raise diverged_at(r, f"met {sig}, its tape holds {want}")
        self.charge(r, events[self.i][1])
        self.i += 1


def diverged_at(r: "RankClock", what: str) -> Divergence:
    r.sim.diverged = True
    return Divergence(f"simddp: rank {r.rank}'s replayed backward {what}; rerunning per-op")


def event(r: "RankClock", sig: tuple, empty: bool = False) -> None:
    """A point inside a backward where the clock is read (a collective's issue, a wait, a
    future's completion, the end of backward): cut the recording here, or advance the replay
    to it. ``empty``: no op may run since the last event (those of a future callback would
    run on the side stream, which a tape does not hold)."""
    rec = r.rec
    if rec is not None:
        if empty and len(rec.ops) > rec.start:
            rec.clean = False
        rec.mark(sig)
    elif r.play is not None:
        r.play.advance(r, sig)


def interrupt(r: "RankClock", what: str) -> None:
    """Something a tape cannot hold happened inside a backward (a callback, an optimizer
    step, a read of the clock from Python, a tensor a collective writes was touched)."""
    if r.rec is not None:
        r.rec.clean = False
    elif r.play is not None:
        raise diverged_at(r, f"met {what}")


# -- running a segment ------------------------------------------------------------------------
def segment(r: "RankClock", key: tuple, run: Any, phase: int, before: Any = None) -> Any:
    """``run()``, a segment of the rank's program whose ops ``key`` determines: observed
    per-op and recorded, or (its last two recordings alike) replayed with ClockMode off, its
    ops of ``phase``; ``before(tape)`` prepares a replay."""
    tape = r.tapes.get(key, False)
    if tape is None:  # seen unclean: per-op for good
        return run()
    if tape is not False and tape.confirmed:
        return _replay(r, tape, run, phase, before)
    return _record(r, key, tape or None, run)


def _record(r: "RankClock", key: tuple, prev: Tape | None, run: Any) -> Any:
    rec = r.rec = Recorder()
    r.rec_ops = rec.ops
    try:
        out = run()
    finally:
        r.rec = r.rec_ops = None
    store(r, key, prev, rec)
    return out


def store(r: "RankClock", key: tuple, prev: Tape | None, rec: Recorder) -> None:
    """Keep what ``rec`` saw under ``key``: confirmed if ``prev`` (the last recording) agrees;
    None (per-op for good) if it saw what a tape cannot hold."""
    if len(r.tapes) >= _TAPE_LIMIT:
        r.tapes.clear()
    if not rec.clean:
        r.tapes[key] = None
    else:
        tape = rec.tape()
        tape.confirmed = prev is not None and prev.form() == tape.form()
        r.tapes[key] = tape


def _replay(r: "RankClock", tape: Tape, run: Any, phase: int, before: Any) -> Any:
    play = r.play = Player(tape, phase)
    try:
        if before is not None:
            before(tape)
        mode = pop_torch_dispatch_stack(None)
        try:
            out = run()
        except BaseException:  # its ops up to here are not charged: a program that goes on
            r.sim.diverged = True  # would run on a wrong clock, so the world reruns per-op
            raise
        finally:
            push_on_torch_dispatch_stack(mode)
        if play.i != len(tape.events):
            raise diverged_at(r, f"ended before {tape.events[play.i][0]}")
        play.charge(r, tape.tail)
    finally:
        r.play = None
    return out


def _run(orig: Any, t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
    """A backward pass (torch.autograd's ``_engine_run_backward``): a segment."""
    r = current()
    if r is None or not eligible(r):
        return orig(t_outputs, *args, **kwargs)
    try:
        key = backward_key(r, t_outputs, args, kwargs)
        hash(key)
    except (Ineligible, TypeError):  # TypeError: an unhashable value in the key
        r.fwd_context.clear()
        return orig(t_outputs, *args, **kwargs)

    def before(tape: Tape) -> None:  # the engine's first step does what the first op did
        wants_eob = any(s == ("eob",) for s, _ in tape.events)

        def first(grad_outputs: Any) -> None:
            handle.remove()
            r.gtid = _gtid()
            if wants_eob:
                queue_callback(r.end_of_backward)
        handle = t_outputs[0].grad_fn.register_prehook(first)
    try:
        return segment(r, key, lambda: orig(t_outputs, *args, **kwargs), BWD, before)
    finally:
        r.subgraphs.clear()  # (they hold graphs alive)
        r.fwd_context.clear()


# -- installing ------------------------------------------------------------------------------
class SharedPatch:
    """``owner.name`` replaced by ``wrap(original)`` while at least one simulation uses it
    (simulations in several threads install it once, and the last one out restores it)."""

    def __init__(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        self.owner, self.name, self.wrap = owner, name, wrap
        self.users = 0
        self.original: Any = None
        self.lock = threading.Lock()

    def install(self) -> None:
        with self.lock:
            if self.users == 0:
                self.original = getattr(self.owner, self.name)
                setattr(self.owner, self.name, self.wrap(self.original))
            self.users += 1

    def uninstall(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                setattr(self.owner, self.name, self.original)
                self.original = None


def _routed_backward(orig: Any) -> Any:
    def run(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        return _run(orig, t_outputs, *args, **kwargs)
    return run


# Routes torch's backward passes through :func:`_run` while any simulation runs.
_BACKWARD = SharedPatch(torch.autograd, "_engine_run_backward", _routed_backward)
install, uninstall = _BACKWARD.install, _BACKWARD.uninstall
