"""Small wrongs and usage: what fakepg reports matches what torch reports, and bad input gets
one clear line."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg.launch.fakerun import main

pytest_plugins = ["pytester"]


def _gloo_creator(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)  # fakepg builds its own gloo group


if not hasattr(dist.Backend, "GLOOISH"):  # once per process (registration is global)
    dist.Backend.register_backend("glooish", _gloo_creator, devices=["cpu"])


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_get_backend_names_the_registered_backend_whose_creator_returns_a_gloo_group(isolation):
    def body(rank):
        dist.init_process_group("glooish")
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_backend(), t.item()

    assert fakepg.spawn(body, nprocs=2, isolation=isolation).returns == [("glooish", 2.0)] * 2


def test_an_error_inside_a_deprecated_torch_function_is_attributed_to_the_users_line():
    def body(rank):
        # all_gather_into_tensor is wrapped by typing_extensions' @deprecated in torch 2.13
        dist.all_gather_into_tensor(None, torch.ones(1))  # torch's own check raises inside it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(fakepg.RankFailedError) as info:
            fakepg.spawn(body, nprocs=2)
    site = str(info.value).split("(raised at ", 1)[1]
    assert site.startswith("tests/test_small_wrongs.py:"), site


def test_spawn_with_the_rank_count_where_args_go_says_to_name_nprocs():
    with pytest.raises(TypeError, match=r"got 4 \(int\); to run 4 ranks, write "
                                        r"fakepg.spawn\(fn, nprocs=4\)"):
        fakepg.spawn(lambda rank: rank, 4)
    assert fakepg.spawn(lambda rank, x: x, [7], nprocs=2).returns == [7, 7]


def test_fakerun_log_dir_on_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    taken = tmp_path / "a_file"
    taken.write_text("")
    assert main(["--log-dir", str(taken), "--tee", "3", "--nproc-per-node", "2", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fakerun: error: --log-dir {taken}: exists and is not a directory; name a "
                   f"directory (it is created if missing)"]


@pytest.mark.parametrize("value", ["-1", "0", "nan", "soon"])
def test_the_fakepg_timeout_option_refuses_what_is_not_a_positive_number(pytester, value):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest(f"--fakepg-timeout={value}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--fakepg-timeout: expected a number of seconds > 0, got '{value}'*"])
