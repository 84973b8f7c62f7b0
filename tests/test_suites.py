"""torch's MultiProcessTestCase suites run unmodified on the fake cluster (fakepg.suites):
only the start-up of the rank processes is replaced, torch's own return-code rules decide."""

import textwrap
import unittest

import pytest
# Imported once here: pytester's in-process runs drop the modules a run imported, and torch's
# test utilities register operator libraries that cannot be registered twice.
import torch.testing._internal.common_distributed  # noqa: F401

import fakepg

pytest_plugins = ["pytester"]

# A user's own suite, as projects write them: one rank per process, torch's exit-code rules.
SUITE = '''
import sys, unittest
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, TEST_SKIPS


class UserSuite(MultiProcessTestCase):
    @property
    def world_size(self):
        return 3

    def setUp(self):
        super().setUp()
        # torch's rule for negative tests: the expected exit code, set before the ranks start
        method = self.test_expected_exit_code_passes  # wrapped by join_or_run when it runs
        self.special_return_code_checks = {getattr(method, "__wrapped__", method): 3}
        self._spawn_processes()

    def init(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}",
                                rank=self.rank, world_size=self.world_size)

    def test_all_reduce_sums(self):
        assert not dist.is_initialized()  # a fresh process: the test initialises it
        self.init()
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3.0)

    def test_wrong_expectation_fails(self):
        self.init()
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 4.0)

    def test_skip_code_skips(self):
        sys.exit(TEST_SKIPS["small_worldsize"].exit_code)

    def test_unittest_skip_skips(self):
        raise unittest.SkipTest("not here")

    def test_expected_exit_code_passes(self):
        sys.exit(3)
'''

HANG = '''
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class HangingSuite(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_rank_one_skips_the_barrier(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}",
                                rank=self.rank, world_size=self.world_size)
        if self.rank == 0:
            dist.barrier()
'''

EXPECTED = {"test_all_reduce_sums": "passed", "test_wrong_expectation_fails": "failed",
            "test_skip_code_skips": "skipped", "test_unittest_skip_skips": "skipped",
            "test_expected_exit_code_passes": "passed"}


def _outcomes(result) -> dict[str, str]:
    return {r.nodeid.rsplit("::", 1)[1]: r.outcome
            for r in result.getreports("pytest_runtest_logreport") if r.when == "call"
            or (r.when == "setup" and r.outcome != "passed")}


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_the_pytest_option_runs_a_users_suite_with_torchs_verdicts(pytester, isolation):
    pytester.makepyfile(test_user_suite=SUITE)
    result = pytester.inline_run(f"--fakepg-suites={isolation}", "-p", "no:cacheprovider")
    assert _outcomes(result) == EXPECTED


def test_the_failure_carries_each_ranks_traceback_as_torch_reports_it(pytester):
    pytester.makepyfile(test_user_suite=SUITE)
    result = pytester.runpytest("--fakepg-suites", "-k", "wrong", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    for rank in range(3):
        result.stdout.fnmatch_lines([f"*Process {rank} exited with error code 10 and exception:*"])
    result.stdout.fnmatch_lines(["*Expected 4.0 but got 3.0*"])


def test_a_hang_fails_at_once_with_fakepgs_report_instead_of_gloos_300_s_timeout(pytester):
    pytester.makepyfile(test_hang_suite=HANG)
    result = pytester.runpytest("--fakepg-suites", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Process 0 exited with error code 10*",
                                 "*hang detected: no rank can make progress*",
                                 "*rank 1: finished (returned)*"])


def test_without_the_option_the_suite_is_left_to_torch(pytester):
    pytester.makepyfile(test_user_suite=SUITE + textwrap.dedent('''
        from torch.testing._internal.common_distributed import MultiProcessTestCase
        def test_start_up_is_torchs():
            assert "_join_processes" in vars(MultiProcessTestCase)
            assert "fakepg_isolation" not in vars(MultiProcessTestCase)
    '''))
    result = pytester.inline_run("-k", "start_up", "-p", "no:cacheprovider")
    result.assertoutcome(passed=1)


def _load(source: str, name: str):
    namespace: dict = {"__name__": f"user_suite_{name}"}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - the test's own suite
    return namespace


def _run_case(cls, name: str) -> unittest.TestResult:
    result = unittest.TestResult()
    cls(name).run(result)
    return result


def test_the_decorator_puts_one_suite_class_on_the_fake_cluster():
    cls = fakepg.suites.on_fake_cluster(_load(SUITE, "decorated")["UserSuite"])
    assert _run_case(cls, "test_all_reduce_sums").wasSuccessful()
    wrong = _run_case(cls, "test_wrong_expectation_fails")
    assert len(wrong.errors) == 1 and "Expected 4.0 but got 3.0" in wrong.errors[0][1]
    assert len(_run_case(cls, "test_skip_code_skips").skipped) == 1


def test_the_base_class_form_with_process_isolation():
    namespace = _load(SUITE, "mixin")

    class OnFakeCluster(fakepg.suites.FakeClusterProcesses, namespace["UserSuite"]):
        fakepg_isolation = "process"

    assert _run_case(OnFakeCluster, "test_all_reduce_sums").wasSuccessful()
    assert len(_run_case(OnFakeCluster, "test_unittest_skip_skips").skipped) == 1


def test_the_decorator_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="expected a subclass of torch's MultiProcessTestCase"):
        fakepg.suites.on_fake_cluster(unittest.TestCase)
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process', got 'threads'"):
        fakepg.suites.on_fake_cluster(isolation="threads")


@pytest.mark.parametrize("order", ["option first", "file first"])
def test_the_option_takes_a_test_file_after_or_before_it(pytester, order):
    pytester.makepyfile(test_user_suite=SUITE)
    pytester.makepyfile(test_other="def test_not_collected():\n    assert False\n")
    args = (["--fakepg-suites", "test_user_suite.py"] if order == "option first"
            else ["test_user_suite.py", "--fakepg-suites"])
    result = pytester.inline_run(*args, "-k", "not wrong", "-p", "no:cacheprovider")
    outcomes = _outcomes(result)
    assert "test_not_collected" not in outcomes  # only the file named was collected
    assert outcomes == {k: v for k, v in EXPECTED.items() if "wrong" not in k}


def test_the_option_refuses_an_unknown_isolation(pytester):
    result = pytester.runpytest("--fakepg-suites=fork", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--fakepg-suites: invalid choice: 'fork'*"])


@pytest.mark.gloo
def test_a_users_suite_gets_the_same_verdicts_as_on_real_gloo_processes(tmp_path):
    (tmp_path / "test_user_suite.py").write_text(SUITE)

    from fakepg.conformance.suites import run_pytest

    # one test per verdict (each real-gloo test starts 3 interpreters: kept few)
    chosen = "sums or wrong or skip_code"

    def verdicts(*options: str) -> dict[str, str]:
        run = run_pytest([str(tmp_path / "test_user_suite.py")], chosen, list(options), 900)
        return {name.rsplit(".", 1)[1]: outcome for name, outcome in run.outcomes.items()}

    gloo = verdicts()
    assert gloo == {"test_all_reduce_sums": "pass", "test_wrong_expectation_fails": "fail",
                    "test_skip_code_skips": "skip"}
    assert verdicts("--fakepg-suites") == gloo
