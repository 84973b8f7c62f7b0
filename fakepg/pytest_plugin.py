"""pytest plugin (entry point ``pytest11``): run test bodies on a fake cluster.

    import pytest, torch, torch.distributed as dist

    @pytest.mark.world_size(4)
    def test_allreduce_sums(fake_cluster):
        def body(rank):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return t.item()
        assert fake_cluster.run(body).returns == [6.0] * 4

A failing run adds the hang/mismatch report and the command that replays it to the
test's failure output. ``--fakepg-seed N`` changes the seed of every fake world;
``--fakepg-timeout S`` (or ``@pytest.mark.fakepg_timeout(S)`` on a test) bounds each of the
test's worlds to S seconds of wall clock (``fakepg.spawn(timeout=S)``).
``--fakepg-isolation process`` (or ``@pytest.mark.fakepg_isolation("process")``) runs the
fixture's worlds with every rank in its own OS process (``fakepg.spawn(isolation=...)``).
``--fakepg-suites`` (``=process``) runs torch ``MultiProcessTestCase`` suites unmodified on the
fake cluster (:mod:`fakepg.suites`).
"""

from __future__ import annotations

import shlex
from typing import Any, Callable, Sequence

import pytest

from .errors import FakePGError
from .exploration import ExplorationSummary, explore
from .world import SpawnResult, spawn

_CLUSTER = pytest.StashKey["FakeCluster"]()
_SUITES = pytest.StashKey[Any]()  # the entered fake_cluster_suites() of --fakepg-suites


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fakepg")
    group.addoption("--fakepg-seed", type=int, default=None,
                    help="seed for every fake cluster run through the fake_cluster fixture")
    group.addoption("--fakepg-timeout", type=float, default=None,
                    help="wall-clock limit in seconds for every fake cluster run through the "
                         "fake_cluster fixture (a fakepg_timeout marker overrides it)")
    group.addoption("--fakepg-isolation", choices=("thread", "process"), default=None,
                    help="run every fake cluster of the fake_cluster fixture with ranks as "
                         "threads (default) or as OS processes (a fakepg_isolation marker "
                         "overrides it)")
    group.addoption("--fakepg-suites", nargs="?", const="thread", default=None,
                    choices=("thread", "process"), metavar="ISOLATION",
                    help="run every torch MultiProcessTestCase (DTensorTestBase, "
                         "DistributedTest, your own) on the fake cluster instead of one OS "
                         "process per rank; ranks as threads (default) or as forked processes "
                         "(--fakepg-suites=process); torch's own return-code rules decide")
    group.addoption("--fakepg-schedule", default=None, metavar="TOKEN",
                    help="replay one schedule (a token fakepg.explore printed) in every fake "
                         "cluster run through the fake_cluster fixture")


def pytest_configure(config: pytest.Config) -> None:
    suites = config.getoption("--fakepg-suites", None)
    if suites is not None:
        from .suites import fake_cluster_suites  # only when asked: it imports torch

        seed = config.getoption("--fakepg-seed")
        config.stash[_SUITES] = fake_cluster_suites(suites, 0 if seed is None else seed)
        config.stash[_SUITES].__enter__()
    config.addinivalue_line("markers", "world_size(n): number of ranks for the fake_cluster fixture")
    config.addinivalue_line("markers", "fakepg_timeout(seconds): wall-clock limit of each world "
                                       "the fake_cluster fixture runs")
    config.addinivalue_line("markers", "fakepg_isolation(mode): 'thread' or 'process' for the "
                                       "worlds the fake_cluster fixture runs")


def pytest_unconfigure(config: pytest.Config) -> None:
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


@pytest.fixture
def fake_cluster(request: pytest.FixtureRequest) -> FakeCluster:
    marker = request.node.get_closest_marker("world_size")
    nprocs = int(marker.args[0]) if marker and marker.args else 2
    seed = request.config.getoption("--fakepg-seed")
    limit = request.node.get_closest_marker("fakepg_timeout")
    timeout = float(limit.args[0]) if limit and limit.args else request.config.getoption("--fakepg-timeout")
    mode = request.node.get_closest_marker("fakepg_isolation")
    isolation = (str(mode.args[0]) if mode and mode.args
                 else request.config.getoption("--fakepg-isolation") or "thread")
    cluster = FakeCluster(nprocs, 0 if seed is None else seed, request.node.nodeid, timeout,
                          request.config.getoption("--fakepg-schedule"), isolation)
    request.node.stash[_CLUSTER] = cluster
    return cluster


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    cluster = item.stash.get(_CLUSTER, None)
    if cluster is None or report.when != "call" or not report.failed:
        return report
    # The failure's own message already carries fakepg's report: add only how to replay it.
    report.sections.append(("fakepg", f"replay: {cluster.replay_command}"))
    return report
