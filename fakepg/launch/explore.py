"""Search interleavings for a failing one, shrink it, and give it back as a replay token.

:func:`explore` runs a program under many schedules (:mod:`fakepg.choices.schedule`): the default
one first, then schedules whose first choices hypothesis draws as a list of small integers
(each taken modulo the point's number of options; 0, the default, is what it shrinks
towards; choices past the list take the default). The first failure (an exception in a
rank, a hang, a mismatch, a timeout, or ``check(result)`` raising) is shrunk by hypothesis to
the fewest and smallest deviations from the default schedule, and raised as
:class:`ExplorationError` with the token that replays it::

    fakepg.explore(train, nprocs=2, runs=200)
    # fakepg.ExplorationError: ... 1 deviation from the default schedule:
    #   choice #3 (preempt) took option 1
    # replay: fakepg.spawn(train, nprocs=2, seed=0, schedule='fp2:AsDvAwAAAAE')

hypothesis is a test dependency: this module imports it when :func:`explore` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import FakePGError
from ..choices.schedule import Schedule

_MAX_DRAWN = 64  # choices drawn per run; later ones take the default


class ExplorationError(FakePGError):
    """A schedule under which the program fails. ``.schedule`` is its replay token, ``.deviations``
    its non-default choices, ``.faults`` the injected faults it needs (when ``explore`` searched
    them), ``.runs`` the runs it took to find and shrink it; the failure is ``__cause__``."""

    def __init__(self, message: str, schedule: str, deviations: list, runs: int):
        super().__init__(message)
        self.schedule = schedule
        self.deviations = deviations
        self.runs = runs


@dataclass
class ExplorationSummary:
    """What :func:`explore` saw when every schedule passed."""

    runs: int
    distinct_outcomes: int  # distinct per-rank return values
    choice_points: dict[str, int] = field(default_factory=dict)  # kind -> times seen (max per run)

    def __str__(self) -> str:
        points = ", ".join(f"{k}: {v}" for k, v in sorted(self.choice_points.items())) or "none"
        return (f"{self.runs} schedules, no failure; {self.distinct_outcomes} distinct outcome(s); "
                f"choice points per run (max): {points}")


def explore(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 2, *, runs: int = 200,
            seed: int = 0, check: Callable[[Any], Any] | None = None,
            **spawn_kwargs: Any) -> ExplorationSummary:
    """Run ``fn`` under ``runs`` schedules; raise :class:`ExplorationError` for the first that
    fails, shrunk to the fewest deviations, or return an :class:`ExplorationSummary`.

    ``seed`` is both the world's seed and the search's, so the same call finds the same token.
    ``check(result)`` (a :class:`fakepg.SpawnResult`) may raise to call a run a failure (e.g.
    replicas that diverge). Other keyword arguments go to :func:`fakepg.spawn`.
    """
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as hyp_seed
        from hypothesis import strategies as st
    except ImportError:  # pragma: no cover - hypothesis is in the test extra
        raise ImportError("fakepg.explore needs hypothesis: pip install hypothesis "
                          "(or the project's test extra)") from None
    from ..arguments import function, integer
    from .spawn import spawn

    function("fakepg.explore: fn", fn, what="callable")
    nprocs = integer("fakepg.explore: nprocs", nprocs, minimum=1)
    runs = integer("fakepg.explore: runs", runs, minimum=1)
    if check is not None:
        function("fakepg.explore: check", check, what="a function of the SpawnResult (raising "
                 "to call a run a failure) or None")
    fault_strategy = spawn_kwargs.pop("faults", None)
    if fault_strategy is not None and not isinstance(fault_strategy, st.SearchStrategy):
        spawn_kwargs["faults"], fault_strategy = fault_strategy, None  # fixed faults, every run
    if "schedule" in spawn_kwargs:
        raise TypeError("fakepg.explore chooses the schedules itself; replay one with "
                        "fakepg.spawn(..., schedule=TOKEN)")
    runs_made = _Runs(spawn, fn, args, nprocs, seed, check, spawn_kwargs)
    run_once = runs_made.run

    default = Schedule()
    try:
        run_once(default)
    except BaseException as e:  # noqa: BLE001 - fails without any deviation
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _error(fn, nprocs, seed, default, e, runs_made.count) from e

    width = max(2, nprocs)  # option indices wrap modulo each point's number of options

    @hyp_seed(seed)
    @settings(max_examples=max(1, runs - 1), database=None, deadline=None,
              phases=[Phase.generate, Phase.shrink], verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(st.lists(st.integers(0, width - 1), max_size=_MAX_DRAWN),
           fault_strategy if fault_strategy is not None else st.just([]))
    def search(choices, drawn_faults):
        # Drawn up front: hypothesis draws only on the test's thread, choices are made on
        # rank threads. Shrinking removes and lowers entries: towards the default schedule.
        it = iter(choices)
        run_once(Schedule(chooser=lambda kind, n: next(it, 0) % n), drawn_faults)

    try:
        search()
    except BaseException as e:  # noqa: BLE001
        if runs_made.last is None or isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        schedule, failure = runs_made.last  # hypothesis replays the shrunk case last
        found_faults = runs_made.last_faults
        rerun = lambda sched: run_once(sched, found_faults)  # noqa: E731 - same faults
        schedule, failure = _drop_deviations(rerun, schedule, failure, runs_made)
        if len(schedule.deviations) > 1:
            schedule, failure = _one_deviation(rerun, schedule, failure, runs_made)
        raise _error(fn, nprocs, seed, schedule, failure, runs_made.count, found_faults) from failure
    return ExplorationSummary(runs_made.count, len(runs_made.outcomes), dict(runs_made.points))


class _Runs:
    """The runs :func:`explore` makes: how many, the last failure (and its faults), the
    distinct outcomes and the most choices of each kind one run made."""

    def __init__(self, spawn: Callable[..., Any], fn: Callable[..., Any], args: Sequence[Any],
                 nprocs: int, seed: int, check: Callable[[Any], None] | None,
                 spawn_kwargs: dict[str, Any]):
        self.spawn, self.fn, self.args, self.nprocs, self.seed = spawn, fn, args, nprocs, seed
        self.check, self.spawn_kwargs = check, spawn_kwargs
        self.count = 0
        self.last: tuple[Schedule, BaseException] | None = None
        self.last_faults: Any = None
        self.outcomes: set[str] = set()
        self.points: dict[str, int] = {}

    def run(self, schedule: Schedule, drawn_faults: list | None = None) -> None:
        """One run under ``schedule`` (raises what the run raised, or what ``check`` did)."""
        self.count += 1
        kwargs = dict(self.spawn_kwargs)
        if drawn_faults:
            kwargs["faults"] = drawn_faults
        faults = drawn_faults or kwargs.get("faults")
        try:
            result = self.spawn(self.fn, self.args, nprocs=self.nprocs, seed=self.seed,
                                schedule=schedule, **kwargs)
            if self.check is not None:
                self.check(result)
        except BaseException as e:  # noqa: BLE001 - every failure is a finding
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.last = (schedule, e)
            self.last_faults = faults
            raise
        seen: dict[str, int] = {}
        for kind, _, _ in schedule.made:
            seen[kind] = seen.get(kind, 0) + 1
        for kind, k in seen.items():
            self.points[kind] = max(self.points.get(kind, 0), k)
        self.outcomes.add(repr(result.returns))


def _drop_deviations(run_once: Callable[[Schedule], None], schedule: Schedule,
                     failure: BaseException, runs: _Runs) -> tuple[Schedule, BaseException]:
    """Greedy last step of shrinking: put single deviations back to the default while the
    run still fails (hypothesis shrinks the drawn list, whose entries shift meaning when an
    earlier choice changes; this works on the choices actually made)."""
    improved = True
    while improved:
        improved = False
        chosen = [i for _, _, i in schedule.made]
        for pos, _, _ in schedule.deviations:
            trial = Schedule(chosen[:pos] + [0] + chosen[pos + 1:])
            try:
                run_once(trial)
            except BaseException:  # noqa: BLE001 - still fails without that deviation
                schedule, failure = runs.last  # type: ignore[misc]
                improved = True
                break
    return schedule, failure


_ONE_DEVIATION_BUDGET = 256


def _one_deviation(run_once: Callable[[Schedule], None], schedule: Schedule,
                   failure: BaseException, runs: _Runs) -> tuple[Schedule, BaseException]:
    """Whether one deviation suffices: try every single non-default option at every choice
    point of the default run (up to a budget of runs), earliest first."""
    points = Schedule(chooser=lambda kind, n: 0)
    try:
        run_once(points)
    except BaseException:  # noqa: BLE001 - cannot happen: the default run passed
        return schedule, failure
    tried = 0
    for pos, (_, n, _) in enumerate(points.made):
        for option in range(1, n):
            if tried >= _ONE_DEVIATION_BUDGET:
                return schedule, failure
            tried += 1
            try:
                run_once(Schedule([0] * pos + [option]))
            except BaseException:  # noqa: BLE001 - one deviation is enough
                return runs.last  # type: ignore[return-value]
    return schedule, failure


def _error(fn: Callable[..., Any], nprocs: int, seed: int, schedule: Schedule,
           failure: BaseException, runs: int, faults: Any = None) -> ExplorationError:
    token = schedule.token
    devs = schedule.deviations
    name = getattr(fn, "__qualname__", repr(fn))
    first = str(failure).splitlines()[0] if str(failure) else ""
    lines = [f"fakepg.explore: a schedule breaks {name} (after {runs} runs, shrunk); "
             f"{len(devs)} deviation(s) from the default schedule:"]
    lines += [f"  choice #{i} ({kind}) took option {opt}" for i, kind, opt in devs]
    if faults:
        lines.append(f"with faults: {list(faults)!r}")
    lines.append(f"failure: {type(failure).__name__}: {first}")
    with_faults = f", faults={list(faults)!r}" if faults else ""
    lines.append(f"replay: fakepg.spawn({name}, nprocs={nprocs}, seed={seed}, schedule={token!r}"
                 f"{with_faults})  or  pytest ... --fakepg-schedule {token}")
    err = ExplorationError("\n".join(lines), token, devs, runs)
    err.faults = list(faults or [])
    return err
