"""Bad input gets a clear error naming what was wrong and what is accepted.

Each test is one probe a new user made (issue 19): a schedule token that is corrupt, out of
range or from another program or world size; exploration and marker arguments of the wrong
kind; spawn's env/faults/hooks; a backend torch lacks; more ranks than open files allow; a
SIGTERM to a process-mode parent; a fakerun rank filter naming no rank.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

import fakepg
from fakepg import faults
from fakepg.choices import schedule
from fakepg.launch.fakerun import main as fakerun
from test_schedule_exploration import store_counter as counter  # loses an update when preempted

pytest_plugins = ["pytester"]


def two_barriers(rank):
    dist.barrier()
    dist.barrier()


@pytest.fixture(scope="module")
def token() -> str:
    with pytest.raises(fakepg.ExplorationError) as info:
        fakepg.explore(counter, nprocs=2, runs=100)
    return info.value.schedule


def test_the_token_explore_prints_replays_its_failure(token):
    with pytest.raises(fakepg.RankFailedError, match="lost update"):
        fakepg.spawn(counter, nprocs=2, schedule=token)


@pytest.mark.parametrize("bad, says", [
    ("fp2:!!", "corrupt fakepg schedule token: 'fp2:!!' (copy it whole"),
    ("fp2:A", "corrupt fakepg schedule token"),
    ("abc", "not a fakepg schedule token: 'abc' (tokens start with 'fp2:'"),
    ("fp1:AAAAAQ", "not a fakepg schedule token: 'fp1:AAAAAQ' (tokens start with 'fp2:'; this "
                   "one comes from an older fakepg: run fakepg.explore again)"),
])
def test_a_corrupt_token_is_refused_before_anything_runs(bad, says):
    ran = []
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        fakepg.spawn(lambda rank: ran.append(rank), nprocs=2, schedule=bad)
    assert ran == []


def test_a_cut_token_is_corrupt(token):
    with pytest.raises(ValueError, match="corrupt fakepg schedule token"):
        fakepg.spawn(counter, nprocs=2, schedule=token[:-1])


def test_a_token_from_another_world_size_is_refused(token):
    with pytest.raises(ValueError, match="it was made on a world of 2 ranks, this one has nprocs=3"):
        fakepg.spawn(counter, nprocs=3, schedule=token)


def test_a_token_from_another_program_says_it_does_not_fit(token):
    with pytest.raises(ValueError, match=r"does not fit this run: it takes 4 choices, this run "
                                         r"made only \d+\. A token replays the program, nprocs "
                                         r"and seed fakepg.explore ran it with"):
        fakepg.spawn(two_barriers, nprocs=2, schedule=token)


def test_a_token_whose_option_is_out_of_range_names_the_choice(token):
    nprocs, fingerprint, *forced = schedule.decode(token)
    forced[-1] = 7  # choice #3 is a preemption: options 0 and 1
    bad = schedule.encode([nprocs, fingerprint, *forced])
    with pytest.raises(ValueError, match=r"its choice #3 takes option 7, but this run offers 2 "
                                         r"options \(preempt\) there") as info:
        fakepg.spawn(counter, nprocs=2, schedule=bad)
    assert info.value.__cause__ is None or "lost update" not in str(info.value)


def test_a_corrupt_schedule_option_stops_pytest_before_any_test(pytester):
    pytester.makepyfile(test_one="def test_one(fake_cluster):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--fakepg-schedule", "fp2:!!")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--fakepg-schedule: corrupt fakepg schedule token: 'fp2:!!'*"])


def test_a_schedule_option_from_another_program_fails_the_test_saying_so(pytester, token):
    pytester.makepyfile(test_one="""
        import torch.distributed as dist

        def test_one(fake_cluster):
            def body(rank):
                dist.barrier()
                dist.barrier()
            fake_cluster.run(body)
    """)
    result = pytester.runpytest("-p", "no:cacheprovider", "--fakepg-schedule", token)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"E*ValueError: fakepg schedule token '{token}' does not fit this run*"])


@pytest.mark.parametrize("kwargs, error, says", [
    ({"nprocs": 0}, ValueError, "fakepg.explore: nprocs must be an integer >= 1, got 0"),
    ({"nprocs": 2, "check": 5}, TypeError, "fakepg.explore: check must be a function of the "
                                           "SpawnResult (raising to call a run a failure) or "
                                           "None, got int 5"),
])
def test_explore_refuses_bad_arguments_instead_of_calling_them_a_breaking_schedule(kwargs, error, says):
    with pytest.raises(error, match=f"^{re.escape(says)}"):
        fakepg.explore(counter, runs=5, **kwargs)


@pytest.mark.parametrize("marker, says", [
    ("world_size(2.7)", "@pytest.mark.world_size must be an integer >= 1, got 2.7; the number of ranks"),
    ("world_size(True)", "@pytest.mark.world_size must be an integer >= 1, got True"),
    ("world_size(n=4)", "@pytest.mark.world_size takes one positional argument, e.g. "
                        "@pytest.mark.world_size(4); got world_size(n=4)"),
    ("world_size()", "@pytest.mark.world_size takes one positional argument"),
    ("fakepg_timeout(-1)", "@pytest.mark.fakepg_timeout must be a finite number > 0, got -1"),
])
def test_a_bad_marker_argument_errors_the_test_naming_the_marker(pytester, marker, says):
    pytester.makepyfile(test_one=f"""
        import pytest

        @pytest.mark.{marker}
        def test_one(fake_cluster):
            fake_cluster.run(lambda rank: None)
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"E*{says}*"])


def _noop(rank):
    return rank


@pytest.mark.parametrize("kwargs, says", [
    ({"env": 5}, "fakepg.spawn: env must be a mapping of variable names to strings, a function "
                 "of the rank returning one, or None, got int 5"),
    ({"faults": faults.crash(0)}, "fakepg.spawn: faults must be a list of faults, got the single "
                                  "fault faults.crash(0, at=0); write faults=[faults.crash(0, at=0)]"),
    ({"faults": 3}, "fakepg.spawn: faults must be a list of faults from fakepg.faults"),
    ({"hooks": object()}, "fakepg.spawn: hooks must be a fakepg.WorldHooks (simddp's "
                          "co-simulation passes one) or None, got object"),
])
def test_spawn_refuses_arguments_of_the_wrong_kind_before_running(kwargs, says):
    with pytest.raises(TypeError, match=f"^{re.escape(says)}"):
        fakepg.spawn(_noop, nprocs=2, **kwargs)


def test_more_ranks_than_open_files_allow_says_the_limit_and_what_to_do():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        with pytest.raises(fakepg.FakePGError) as info:
            fakepg.spawn(_noop, nprocs=1024, isolation="process")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    message = str(info.value)
    assert message.startswith("fakepg.spawn(isolation='process') with 1024 ranks needs about ")
    assert "but its limit is 256 (RLIMIT_NOFILE" in message
    assert "ulimit -n" in message and "or use isolation='thread'" in message


_TERMINATED = """
    import os, sys, torch, torch.distributed as dist, fakepg
    def body(rank):
        # a segment as torch names it, as if the process were killed while making one
        open(f"/dev/shm/torch_{os.getpid()}_0_{rank}", "w").close()
        print(os.getpid(), flush=True)
        while True:
            dist.all_reduce(torch.ones(100))
    fakepg.spawn(body, nprocs=2, isolation="process")
"""


def test_sigterm_to_a_process_mode_parent_ends_it_by_sigterm_leaving_no_process_or_segment(tmp_path):
    script = tmp_path / "terminated.py"
    script.write_text(textwrap.dedent(_TERMINATED))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    pids = [int(proc.stdout.readline()) for _ in range(2)]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    for pid in pids:
        assert not os.path.exists(f"/dev/shm/torch_{pid}_0_{pids.index(pid)}")
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_init_process_group_of_mpi_is_refused_as_torch_without_mpi_refuses_it():
    def body(rank):
        dist.init_process_group("mpi")

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(body, nprocs=2)
    assert str(info.value.__cause__).startswith(
        "Distributed package doesn't have MPI built in. MPI is only included if you build "
        "PyTorch from source on a host that has MPI installed.")


def test_fakerun_local_ranks_filter_naming_no_rank_is_a_usage_error(tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise AssertionError('must not run')\n")
    assert fakerun(["--nproc-per-node", "2", "--local-ranks-filter", "5", str(script)]) == 2
    err = capsys.readouterr().err
    assert err == ("fakerun: error: --local-ranks-filter 5: no local rank 5; the local ranks are "
                   "0..1 (--nproc-per-node 2)\n")

