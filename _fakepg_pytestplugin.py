"""fakepg's pytest plugin, as pytest loads it (entry point ``pytest11``): light on purpose.

Every pytest run in an environment where fakepg is installed loads this module, also runs that
use nothing of fakepg. So it imports neither torch nor fakepg: it declares the ``--fakepg-*``
options and the markers, and registers the ``fake_cluster`` fixture, whose body imports the
heavy half (``fakepg.pytest_plugin``: the world, torch) the first time a test asks for it.
It is a top-level module because importing anything inside the ``fakepg`` package runs
``fakepg/__init__.py``, which imports torch (hypothesis ships its plugin the same way).

Add an option or a marker here; what it does belongs in ``fakepg.pytest_plugin``.

    import pytest, torch, torch.distributed as dist

    @pytest.mark.world_size(4)
    def test_allreduce_sums(fake_cluster):
        def body(rank):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return t.item()
        assert fake_cluster.run(body).returns == [6.0] * 4
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import os

import pytest

if TYPE_CHECKING:  # the heavy half, imported only for type checkers here
    from fakepg.pytest_plugin import FakeCluster

# The fixture's cluster, kept on the test item so the report hook can add its replay line.
CLUSTER = pytest.StashKey[Any]()


def _seconds(text: str) -> float:
    """A positive number of seconds (argparse turns the error into a usage error, exit 4)."""
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r} "
                                         f"(leave the option out for no limit)")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fakepg")
    group.addoption("--fakepg-seed", type=int, default=None,
                    help="seed for every fake cluster run through the fake_cluster fixture")
    group.addoption("--fakepg-timeout", type=_seconds, default=None, metavar="SECONDS",
                    help="wall-clock limit in seconds for every fake cluster run through the "
                         "fake_cluster fixture (a fakepg_timeout marker overrides it)")
    group.addoption("--fakepg-isolation", choices=("thread", "process"), default=None,
                    help="run every fake cluster of the fake_cluster fixture with ranks as "
                         "threads (default) or as OS processes (a fakepg_isolation marker "
                         "overrides it)")
    group.addoption("--fakepg-suites", nargs="?", const="thread", default=None,
                    metavar="ISOLATION",
                    help="run every torch MultiProcessTestCase (DTensorTestBase, "
                         "DistributedTest, your own) on the fake cluster instead of one OS "
                         "process per rank; ranks as threads (default) or as forked processes "
                         "(--fakepg-suites=process); torch's own return-code rules decide")
    group.addoption("--fakepg-schedule", default=None, metavar="TOKEN",
                    help="replay one schedule (a token fakepg.explore printed) in every fake "
                         "cluster run through the fake_cluster fixture")


def _suites_mode(config: pytest.Config) -> None:
    """``--fakepg-suites FILE``: argparse took FILE as the option's value (it is optional);
    give it back to the test paths, as if written ``FILE --fakepg-suites``."""
    value = config.getoption("--fakepg-suites", None)
    if value is None or value in ("thread", "process"):
        return
    if value.startswith("-") or not (value.endswith(".py") or "/" in value or "::" in value
                                     or os.path.exists(value.split("::")[0])):
        raise pytest.UsageError(f"--fakepg-suites: invalid choice: {value!r} (choose from "
                                f"'thread', 'process', or give no value)")
    config.option.fakepg_suites = "thread"
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.insert(0, value)
    else:  # no other path given: pytest would otherwise collect its default directory
        config.args[:] = [value]
        config.args_source = pytest.Config.ArgsSource.ARGS


def pytest_configure(config: pytest.Config) -> None:
    _suites_mode(config)
    if config.getoption("--fakepg-suites", None) is not None:
        from fakepg.pytest_plugin import start_suites  # asked for fakepg: its import is paid

        start_suites(config)
    config.addinivalue_line("markers", "world_size(n): number of ranks for the fake_cluster fixture")
    config.addinivalue_line("markers", "fakepg_timeout(seconds): wall-clock limit of each world "
                                       "the fake_cluster fixture runs")
    config.addinivalue_line("markers", "fakepg_isolation(mode): 'thread' or 'process' for the "
                                       "worlds the fake_cluster fixture runs")
    token = config.getoption("--fakepg-schedule", None)
    if token is not None:  # a corrupt token stops the session before any test runs
        from fakepg.choices.schedule import decode  # asked for fakepg: its import is paid

        try:
            decode(token)
        except ValueError as e:
            raise pytest.UsageError(f"--fakepg-schedule: {e}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.getoption("--fakepg-suites", None) is not None:
        from fakepg.pytest_plugin import stop_suites

        stop_suites(config)


@pytest.fixture
def fake_cluster(request: pytest.FixtureRequest) -> "FakeCluster":
    """A fake cluster for this test: ``fake_cluster.run(fn)`` is ``fakepg.spawn`` with the
    test's world size (``@pytest.mark.world_size(n)``, default 2), seed and timeout."""
    from fakepg.pytest_plugin import cluster_for  # the first use pays for torch and fakepg

    cluster = cluster_for(request)
    request.node.stash[CLUSTER] = cluster
    return cluster


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    cluster = item.stash.get(CLUSTER, None)
    if cluster is None or report.when != "call" or not report.failed:
        return report
    # The failure's own message already carries fakepg's report: add only how to replay it.
    report.sections.append(("fakepg", f"replay: {cluster.replay_command}"))
    return report
