"""Collective sites name the user's line, and the installed library's line under it."""

import os
import sys
import sysconfig
import textwrap

import pytest
import torch
import torch.distributed as dist

import fakepg

_HERE = "tests/test_sites.py"


def _line_of(fn, text: str) -> int:
    """Line number, in fn's file, of the first line of fn that contains text."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _sites(body, nprocs: int = 2) -> list[str]:
    return [rec.site for rec in fakepg.spawn(body, nprocs=nprocs).trace[0]]


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
    """An importable package under a site-packages directory, as pip would install it."""
    pkg = tmp_path / "site-packages" / "fakelib_sites"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .strategy import gather\n")
    (pkg / "strategy.py").write_text(textwrap.dedent("""
        import torch, torch.distributed as dist

        def gather(t):
            return _inner(t)

        def _inner(t):
            out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(out, t)
            return out

        def per_rank(rank):
            return _inner(torch.ones(1))
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.delitem(sys.modules, "fakelib_sites", raising=False)
    monkeypatch.delitem(sys.modules, "fakelib_sites.strategy", raising=False)
    import fakelib_sites

    return fakelib_sites


def test_a_collective_issued_by_an_installed_library_names_the_users_line_via_the_librarys(fake_library):
    def body(rank):
        fake_library.gather(torch.ones(2))

    assert _sites(body) == [f"{_HERE}:{_line_of(body, 'gather(')} (via fakelib_sites/strategy.py:9)"]


def test_a_library_called_from_no_user_code_is_named_alone(fake_library):
    # spawn calls the library function itself: every frame outside it is fakepg or the stdlib
    trace = fakepg.spawn(fake_library.strategy.per_rank, nprocs=2).trace
    assert trace[0][0].site == "fakelib_sites/strategy.py:9"


def test_site_packages_inside_the_stdlib_directory_is_library_code_not_stdlib():
    # pyenv/conda layouts put the global site-packages under lib/pythonX.Y/
    path = os.path.join(sysconfig.get_paths()["stdlib"], "site-packages", "fakelib_std", "ddp.py")
    ns = {}
    exec(compile("import torch, torch.distributed as dist\n"
                 "def reduce(t):\n    dist.all_reduce(t)\n", path, "exec"), ns)

    def body(rank):
        ns["reduce"](torch.ones(1))

    line = _line_of(body, "ns[")
    assert _sites(body) == [f"{_HERE}:{line} (via fakelib_std/ddp.py:3)"]


def test_collectives_behind_torchs_deprecation_wrapper_name_the_users_line():
    def body(rank):
        dist.all_gather_into_tensor(torch.zeros(4), torch.ones(2))
        dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(2))

    assert _sites(body) == [f"{_HERE}:{_line_of(body, 'all_gather_into_tensor')}",
                            f"{_HERE}:{_line_of(body, 'reduce_scatter_tensor')}"]


def test_test_code_under_torch_testing_counts_as_user_code():
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    path = os.path.join(torch_dir, "testing", "_internal", "distributed", "fakepg_sites_case.py")
    ns = {}
    exec(compile("import torch, torch.distributed as dist\n"
                 "def test_body(rank):\n    dist.all_reduce(torch.ones(1))\n", path, "exec"), ns)
    (site,) = _sites(ns["test_body"])
    assert site.endswith(os.path.join("torch", "testing", "_internal", "distributed",
                                      "fakepg_sites_case.py") + ":3")
