"""The planner contract: every member the engines read from a step program, in one base class.
:func:`simddp.replay.check_planner` is the conformance kit a new planner runs (as pytest's
hookspecs say what a plugin must provide, these say what a planner must).

A planner is a function ``planner(captured, checked) -> Program``; the engines
(:mod:`simddp.replay`) read nothing of a program that :class:`Program` does not declare::

    >>> from simddp.program.contract import Program
    >>> sorted(Program.__abstractmethods__)
    ['epilogue', 'iteration', 'memory', 'uniform']

Optional members have defaults here (no ``hasattr`` in the engines): :meth:`Program.rank_kinds`
(no rank differs but by durations), :meth:`Program.knob_values` (nothing resolved from the
capture), :meth:`Program.bubble_fractions` (no pipeline), :meth:`Program.communication_buckets`
(DDP's buckets; none for the others).
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

from .steps import Instruction

__all__ = ["Program"]


class Program(abc.ABC):
    """One world's step program, as a planner writes it and the engines run it.

    Attributes every program sets: ``nprofiles`` (captured profiles; rank r runs profile
    r % nprofiles), ``iterations``, ``mesh`` (:class:`~simddp.program.mesh.Mesh`: the
    communicators of its collectives' scopes), ``param_bytes`` (the model's), ``parallel``
    (the :class:`~simddp.program.parallel.Parallel` layout replayed, or None for DDP's own)."""

    nprofiles: int
    iterations: int
    mesh: Any
    param_bytes: int
    parallel: Any = None

    @abc.abstractmethod
    def iteration(self, rank: int, it: int) -> Sequence[Instruction]:
        """``rank``'s instructions in iteration ``it``."""

    @abc.abstractmethod
    def epilogue(self, rank: int) -> Sequence[Instruction]:
        """What ``rank`` runs after its last iteration (often nothing)."""

    @abc.abstractmethod
    def uniform(self) -> str | None:
        """None when every rank runs the same instructions in every iteration (only their
        durations differ: the vectorised engine runs it), else why not."""

    @abc.abstractmethod
    def memory(self, rank: int | None = None) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per category at the peak) of ``rank`` in one step (None: the
        rank with the highest peak)."""

    def memory_programs(self) -> list[tuple[Sequence[Instruction], dict[str, int]]] | None:
        """Each distinct rank's step and its bytes per category before it, which the caching
        allocator model replays (:func:`~simddp.program.steps.job_memory`); None: the program
        offers :meth:`memory` only (its program-order peak)."""
        return None

    def rank_kinds(self) -> dict[int, tuple]:
        """Ranks whose instructions differ from the others' by more than durations (each gets
        its own equivalence class in the simpy engine)."""
        return {}

    def knob_values(self) -> dict[str, Any]:
        """Knobs the planner resolved from the capture (shown in the result's knobs)."""
        return {}

    def bubble_fractions(self, timeline: Any) -> list[float] | None:
        """Per pipeline rank, the idle fraction of an iteration (None: not a pipeline)."""
        return None

    def communication_buckets(self) -> tuple[list[list[int]], list[list[int]]]:
        """DDP's buckets (parameter indices) and the bytes of each of their collectives'
        stages; empty for parallelisms without buckets."""
        return [], []
