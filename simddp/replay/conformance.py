"""The planner conformance kit: :func:`check_planner` runs a planner on a capture and checks
its step program against :class:`~simddp.program.contract.Program`'s contract, then runs it on
both engines. A new parallelism's tests call it on its captures::

    from simddp.replay import check_planner
    program = check_planner(plan_fsdp, captured, Knobs(parallel="fsdp").checked(64, network))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..program.contract import Program
from ..program.steps import (MEMORY_CATEGORIES, Compute, Instruction, Issue, Mark, Memory, Pace,
                             Segment, Wait, WaitAll)
from .simpy_engine import SimpyReplay
from .vector_engine import VectorReplay, unsupported

__all__ = ["check_planner", "PlannerContractError"]


class PlannerContractError(AssertionError):
    """A planner's program breaks the contract; the message says which member and how."""


def _issues_and_waits(ins: Sequence[Instruction]) -> tuple[list[Issue], list[tuple]]:
    issues, waits = [], []
    for x in ins:
        items = [m.do for m in x.marks] if isinstance(x, Segment) else [x]
        for y in items:
            if isinstance(y, Issue):
                issues.append(y)
            elif isinstance(y, Wait):
                waits.append(y.tag)
    return issues, waits


def _check_instructions(where: str, ins: Sequence[Instruction], mesh: Any, nprofiles: int,
                        rank: int) -> None:
    for x in ins:
        if not isinstance(x, (Compute, Segment, Issue, Wait, WaitAll, Memory, Pace)):
            raise PlannerContractError(f"{where}: {x!r} is not an instruction of "
                                       f"simddp.program.steps")
        if isinstance(x, (Compute, Segment)) and len(x.seconds) != nprofiles:
            raise PlannerContractError(f"{where}: {type(x).__name__} {x.kind!r} has "
                                       f"{len(x.seconds)} durations, nprofiles is {nprofiles}")
        if isinstance(x, (Compute, Segment)) and any(not s >= 0 for s in x.seconds):
            raise PlannerContractError(f"{where}: negative or NaN duration in {x.kind!r}")
        if isinstance(x, Memory) and x.category not in MEMORY_CATEGORIES:
            raise PlannerContractError(f"{where}: memory category {x.category!r} is not one of "
                                       f"{MEMORY_CATEGORIES}")
        if isinstance(x, Segment):
            for m in x.marks:
                if not isinstance(m, Mark) or not isinstance(m.do, (Issue, Wait, Memory)):
                    raise PlannerContractError(f"{where}: a segment's mark must hold an Issue, "
                                               f"Wait or Memory, got {m!r}")
                if m.at is not None and len(m.at) != nprofiles:
                    raise PlannerContractError(f"{where}: a mark has {len(m.at)} offsets, "
                                               f"nprofiles is {nprofiles}")
    issues, waits = _issues_and_waits(ins)
    tags = set()
    for iss in issues:
        for c, cb in iss.stages:
            if c.tag in tags:
                raise PlannerContractError(f"{where}: collective tag {c.tag!r} issued twice "
                                           f"in one iteration")
            tags.add(c.tag)
            if c.nbytes < 0 or cb < 0:
                raise PlannerContractError(f"{where}: {c.tag!r} has negative bytes or callback")
            try:
                mesh.members(rank, c.scope)
            except Exception as e:  # noqa: BLE001 - any failure is the planner's to fix
                raise PlannerContractError(f"{where}: collective {c.tag!r} runs on scope "
                                           f"{c.scope!r}, which the program's mesh does not "
                                           f"have ({e})") from None
    missing = [t for t in waits if t not in tags]
    if missing:
        raise PlannerContractError(f"{where}: waits for {missing[:3]} that it never issued")


def check_planner(planner: Callable[[Any, Any], Any], captured: Any, checked: Any, *,
                  replay: bool = True) -> Program:
    """Run ``planner(captured, checked)`` and check its program against the contract: it is a
    :class:`Program`; every rank's instructions are the step program's types with one duration
    per profile, collectives on scopes its mesh has, every wait for a collective issued in the
    same iteration; memory is non-negative per known category; planning twice gives equal
    programs (determinism); and, with ``replay``, both engines run it to the same iteration
    ends where the vectorised engine takes it. Returns the program; raises
    :class:`PlannerContractError` naming the member that breaks the contract."""
    program = planner(captured, checked)
    name = getattr(planner, "__name__", repr(planner))
    if not isinstance(program, Program):
        raise PlannerContractError(f"{name} returned a {type(program).__name__}; a planner "
                                   f"returns a simddp.program.contract.Program subclass")
    for attr in ("nprofiles", "iterations", "mesh", "param_bytes"):
        if not hasattr(program, attr):
            raise PlannerContractError(f"{name}'s program has no {attr!r}")
    if program.nprofiles < 1 or program.iterations < 1:
        raise PlannerContractError(f"{name}: nprofiles and iterations must be >= 1")
    world = checked.world
    ranks = sorted({0, world - 1, world // 2, *program.rank_kinds()})
    for r in ranks:
        for it in range(program.iterations):
            _check_instructions(f"{name}: rank {r}, iteration {it}", program.iteration(r, it),
                                program.mesh, program.nprofiles, r)
        _check_instructions(f"{name}: rank {r}, epilogue", program.epilogue(r), program.mesh,
                            program.nprofiles, r)
        peak, by_cat = program.memory(r)
        if peak < 0 or any(v < 0 for v in by_cat.values()) or \
                set(by_cat) - set(MEMORY_CATEGORIES):
            raise PlannerContractError(f"{name}: memory({r}) = {peak}, {by_cat}: bytes must be "
                                       f">= 0 in the categories {MEMORY_CATEGORIES}")
    why = program.uniform()
    if why is not None and not isinstance(why, str):
        raise PlannerContractError(f"{name}: uniform() returns None or a reason, got {why!r}")
    again = planner(captured, checked)
    for r in ranks:
        if list(again.iteration(r, 0)) != list(program.iteration(r, 0)):
            raise PlannerContractError(f"{name}: planning twice gave rank {r} different "
                                       f"instructions (a planner is a function of its inputs)")
    if replay:
        _check_engines(program, checked, name)
    return program


def _check_engines(program: Program, checked: Any, name: str) -> None:
    """Both engines end every iteration at the same time (where the vectorised one runs it)."""
    ends = SimpyReplay(program, checked, classes=True).run(None).iteration_times()
    if unsupported(program, checked) is None:
        vec = VectorReplay(program, checked).run(None).iteration_times()
        if [round(x, 12) for x in vec] != [round(x, 12) for x in ends]:
            raise PlannerContractError(f"{name}: the simpy engine ends iterations at {ends}, the "
                                       f"vectorised one at {vec}")
