"""The fake_cluster fixture's cluster: what ``fakepg``'s pytest plugin does once a test uses it.

pytest loads the plugin's light half, ``_fakepg_pytestplugin`` (options, markers, the fixture),
without torch; the fixture imports this module on first use. A failing run adds the hang or
mismatch report and the command that replays it to the test's failure output.
``--fakepg-seed N`` changes the seed of every fake world; ``--fakepg-timeout S`` (or
``@pytest.mark.fakepg_timeout(S)`` on a test) bounds each of the test's worlds to S seconds of
wall clock (``fakepg.spawn(timeout=S)``). ``--fakepg-isolation process`` (or
``@pytest.mark.fakepg_isolation("process")``) runs the fixture's worlds with every rank in its
own OS process (``fakepg.spawn(isolation=...)``); ``--fakepg-schedule TOKEN`` replays a schedule.
``--fakepg-suites`` (``=process``) runs torch ``MultiProcessTestCase`` suites unmodified on the
fake cluster (:mod:`fakepg.launch.suites`, public as ``fakepg.suites``): the light half calls
:func:`start_suites` and :func:`stop_suites`.
"""

from __future__ import annotations

import shlex
from typing import Any, Callable, Sequence

import pytest

from .arguments import integer, number
from .errors import FakePGError
from .launch.explore import ExplorationSummary, explore
from .launch.spawn import SpawnResult, spawn

_SUITES = pytest.StashKey[Any]()  # the entered fake_cluster_suites() of --fakepg-suites


def start_suites(config: pytest.Config) -> None:
    """``--fakepg-suites[=process]``: every ``MultiProcessTestCase`` of the session runs its
    ranks as one fake world (until :func:`stop_suites`)."""
    from .launch.suites import fake_cluster_suites

    seed = config.getoption("--fakepg-seed")
    suites = fake_cluster_suites(config.getoption("--fakepg-suites"), 0 if seed is None else seed)
    suites.__enter__()
    config.stash[_SUITES] = suites


def stop_suites(config: pytest.Config) -> None:
    """The end of the session: ``MultiProcessTestCase`` starts its processes again."""
    suites = config.stash.get(_SUITES, None)
    if suites is not None:
        suites.__exit__(None, None, None)


class FakeCluster:
    """What the ``fake_cluster`` fixture gives a test."""

    def __init__(self, nprocs: int, seed: int, nodeid: str, timeout: float | None = None,
                 schedule: str | None = None, isolation: str = "thread"):
        self.nprocs = nprocs
        self.isolation = isolation
        self.seed = seed
        self.timeout = timeout
        self.schedule = schedule
        self.nodeid = nodeid
        self.failure: FakePGError | None = None
        self.results: list[SpawnResult] = []

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), *, nprocs: int | None = None,
            seed: int | None = None, **kwargs: Any) -> SpawnResult:
        """``fakepg.spawn(fn, args, nprocs=<marker>, seed=<option or 0>, timeout=<marker or option>)``."""
        __tracebackhide__ = True
        kwargs.setdefault("timeout", self.timeout)
        kwargs.setdefault("schedule", self.schedule)
        kwargs.setdefault("isolation", self.isolation)
        try:
            result = spawn(fn, args, nprocs=nprocs or self.nprocs,
                           seed=self.seed if seed is None else seed, **kwargs)
        except FakePGError as e:
            self.failure = e
            raise
        self.results.append(result)
        return result

    def explore(self, fn: Callable[..., Any], args: Sequence[Any] = (), *, runs: int = 200,
                nprocs: int | None = None, **kwargs: Any) -> ExplorationSummary:
        """``fakepg.explore`` with this test's world size, seed and timeout."""
        __tracebackhide__ = True
        kwargs.setdefault("timeout", self.timeout)
        try:
            return explore(fn, args, nprocs or self.nprocs, runs=runs, seed=self.seed, **kwargs)
        except FakePGError as e:
            self.failure = e
            raise

    @property
    def replay_command(self) -> str:
        cmd = f"python -m pytest {shlex.quote(self.nodeid)} -p no:xdist --fakepg-seed {self.seed}"
        if self.isolation != "thread":
            cmd += f" --fakepg-isolation {self.isolation}"
        token = getattr(self.failure, "schedule", None) or self.schedule
        return f"{cmd} --fakepg-schedule {token}" if token else cmd


def _marker_value(marker: Any, convert: Callable[[str, Any], Any], example: str) -> Any:
    """The one positional argument of a fakepg marker, checked (None without the marker)."""
    if marker is None:
        return None
    name = f"@pytest.mark.{marker.name}"
    if marker.kwargs or len(marker.args) != 1:
        given = ", ".join([*map(repr, marker.args), *(f"{k}={v!r}" for k, v in marker.kwargs.items())])
        raise TypeError(f"{name} takes one positional argument, e.g. {name}({example}); "
                        f"got {marker.name}({given})")
    return convert(name, marker.args[0])


def cluster_for(request: pytest.FixtureRequest) -> FakeCluster:
    """The ``fake_cluster`` fixture's value for one test, from its markers and the options."""
    nprocs = _marker_value(request.node.get_closest_marker("world_size"),
                           lambda name, v: integer(name, v, minimum=1, hint="the number of ranks"),
                           "4") or 2
    seed = request.config.getoption("--fakepg-seed")
    timeout = _marker_value(request.node.get_closest_marker("fakepg_timeout"),
                            lambda name, v: number(name, v, positive=True, hint="seconds"), "30")
    if timeout is None:
        timeout = request.config.getoption("--fakepg-timeout")
    mode = request.node.get_closest_marker("fakepg_isolation")
    isolation = (str(mode.args[0]) if mode and mode.args
                 else request.config.getoption("--fakepg-isolation") or "thread")
    return FakeCluster(nprocs, 0 if seed is None else seed, request.node.nodeid, timeout,
                       request.config.getoption("--fakepg-schedule"), isolation)
