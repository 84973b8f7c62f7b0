"""``simddp.explore``: search timings for one that breaks a program, shrink it, replay it.

A program that passes under one timing can fail under another: a straggler turns a barrier
into a watchdog timeout, a slower link lets a rank read a buffer an async collective still
writes, jitter reorders who waits for whom. :func:`explore` runs the program under
:func:`simddp.simulate` with timings drawn by :func:`simddp.strategies.timings` (the base
timing first), stops at the first failure — any exception: a virtual-time
:class:`~simddp.CollectiveTimeoutError`, a :class:`~simddp.CollectiveRaceError`, a hang, a
mismatch, a user assertion (replicas diverging, checked by the program or by ``check``) —
shrinks it toward the base timing with hypothesis, and raises :class:`ExplorationError`
with a replay token. Everything is a function of the program, ``seed`` and the bounds:
exploring twice finds the same timing, and its token replays bitwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from fakepg.arguments import integer

from .errors import ExplorationError
from .faults import check as check_faults
from .timing import Timing

__all__ = ["explore", "ExplorationSummary", "ExplorationError"]


@dataclasses.dataclass
class ExplorationSummary:
    """What :func:`explore` returns when every timing passed.

    ``runs``: timings run (the base one included); ``distinct``: distinct timings among them;
    ``fastest``/``slowest``: the smallest and largest makespan (latest rank's final virtual
    clock, seconds); ``slowest_token``: the replay token of the slowest timing.
    """

    runs: int
    distinct: int
    fastest: float
    slowest: float
    slowest_token: str

    def __str__(self) -> str:
        return (f"simddp.explore: {self.runs} runs ({self.distinct} distinct timings) passed; "
                f"makespan {self.fastest:.6g} s .. {self.slowest:.6g} s "
                f"(slowest: {self.slowest_token})")


class _Failed(Exception):
    """One failing run, carried through hypothesis (which shrinks on it)."""

    def __init__(self, timing: Timing, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.timing, self.error = timing, error


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    head = f"{type(e).__name__}"
    rank = getattr(e, "rank", None)
    if rank is not None:
        head += f" on rank {rank}"
    return f"{head}: {text[0]}" if text else head


def explore(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, *,
            timing: Timing | None = None, runs: int = 100, seed: int = 0,
            check: Callable[[Any], Any] | None = None, hang_timeout: float = 1.0,
            strategy: Any = None, **bounds: Any) -> ExplorationSummary:
    """Run ``fn(rank, *args)`` on ``nprocs`` simulated ranks under up to ``runs`` timings
    perturbed from ``timing`` (default ``Timing()``), base first; ``check(result)`` (optional)
    may raise on a :class:`~simddp.SimResult` (e.g. replicas diverged).

    ``bounds`` go to :func:`simddp.strategies.timings` (``max_slowdown``, ``max_jitter``,
    ``max_network_jitter``, ``max_links``, ``max_link_slowdown``, ``horizon``, ``steps``);
    ``strategy`` replaces it with any strategy of timings. ``seed`` seeds the ranks (as in
    :func:`simddp.simulate`) and the search.

    Returns an :class:`ExplorationSummary` when all pass; raises :class:`ExplorationError`
    for the first failure, shrunk toward ``timing``: ``.schedule`` is its token, replayed by
    ``simddp.simulate(fn, args, nprocs, seed=seed, timing=timing.with_token(token))``.

    Inside a hypothesis ``@given`` test, give that test
    ``@settings(suppress_health_check=[HealthCheck.nested_given])`` (explore is a @given).

    Example (a barrier under a 50 ms virtual timeout; a straggler breaks it)::

        base = simddp.Timing(compute=simddp.Compute.constant(1e-3), timeout=0.05)
        simddp.explore(work, nprocs=4, timing=base, runs=50, max_slowdown=4.0)
        # ExplorationError: ... rank 2 2.875x slower ... replay: simddp.simulate(...)
    """
    from . import strategies  # needs hypothesis (a test extra): imported only here
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis.errors import Flaky

    from .cosim.simulate import simulate

    if not callable(fn):  # an argument error, not a failure to explore
        raise TypeError(f"simddp.explore: fn must be callable (called as fn(rank, *args)), "
                        f"got {type(fn).__name__} {fn!r:.80}")
    base = Timing() if timing is None else timing
    if not isinstance(base, Timing):
        raise TypeError(f"simddp.explore(timing=...) needs a simddp.Timing, got "
                        f"{type(base).__name__}")
    nprocs = integer("simddp.explore: nprocs", nprocs, minimum=1)
    unknown = sorted(r for r in base.rank_speed if r >= nprocs)
    if unknown:  # argument errors fail at once, before any run
        raise ValueError(f"simddp.explore: Timing.rank_speed names ranks {unknown}, but the "
                         f"world has ranks 0..{nprocs - 1} (nprocs={nprocs})")
    check_faults(base.faults, nprocs)
    runs = integer("simddp.explore: runs", runs, minimum=1)
    seed = integer("simddp.explore: seed", seed, minimum=0)
    if strategy is None:
        strategy = strategies.timings(base, nprocs, **bounds)
    elif bounds:
        raise TypeError(f"simddp.explore: pass either strategy= or bounds "
                        f"({', '.join(sorted(bounds))}), not both")
    args = tuple(args)
    seen: dict[str, float] = {}
    state = {"runs": 0, "first_failure": 0}

    def run_one(t: Timing) -> None:
        state["runs"] += 1
        try:
            res = simulate(fn, args, nprocs, timing=t, seed=seed, hang_timeout=hang_timeout)
            if check is not None:
                check(res)
        except Exception as e:  # noqa: BLE001 - any failure is what we search for
            if not state["first_failure"]:
                state["first_failure"] = state["runs"]
            raise _Failed(t, e) from e
        seen[t.token()] = res.timeline.makespan

    run_one = hypothesis.example(base)(run_one)
    test = settings(max_examples=runs, database=None, deadline=None, derandomize=False,
                    report_multiple_bugs=False, verbosity=Verbosity.quiet,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck))(given(strategy)(run_one))
    test = hypothesis.seed(seed)(test)
    try:
        test()
    except _Failed as f:
        raise _error(fn, args, nprocs, seed, base, f, state, check is not None) from f.error
    except Flaky as e:
        raise ExplorationError(
            f"simddp.explore: a timing failed once and passed when run again; the program is "
            f"not a function of its timing and seed (wall-clock time, unseeded randomness, "
            f"threads of its own?): {e}", schedule="", runs=state["runs"]) from e
    if not seen:  # pragma: no cover - the base timing always runs
        return ExplorationSummary(state["runs"], 0, 0.0, 0.0, base.token())
    slow_tok = max(seen, key=lambda k: (seen[k], k))
    return ExplorationSummary(state["runs"], len(seen), min(seen.values()), seen[slow_tok],
                              slow_tok)


def _error(fn: Any, args: tuple, nprocs: int, seed: int, base: Timing, f: _Failed,
           state: dict, checked: bool) -> ExplorationError:
    token = f.timing.token()
    dev = f.timing.deviations(base)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "fn")
    argtxt = ""
    if args:
        r = repr(args)
        argtxt = f", {r if len(r) <= 60 else 'args'}"
    call = (f"simddp.simulate({name}{argtxt}, nprocs={nprocs}, seed={seed}, "
            f"timing=timing.with_token({token!r}))")
    if checked:
        call = f"check({call})"
    first = state["first_failure"] or state["runs"]
    lines = [f"simddp.explore: a timing breaks {name}: found at run {first}, shrunk in "
             f"{state['runs'] - first} more runs; "
             + ("it is the base timing itself." if not dev else
                f"it deviates from the base timing by {len(dev)}:")]
    lines += [f"  - {d}" for d in dev]
    lines.append(f"failure: {_first_line(f.error)}")
    lines.append(f"replay (timing = the base timing given to explore): {call}")
    return ExplorationError("\n".join(lines), schedule=token, timing=f.timing, deviations=dev,
                            runs=state["runs"], shrink_runs=state["runs"] - first)
