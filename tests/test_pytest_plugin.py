"""The pytest plugin: the ``fake_cluster`` fixture, the ``world_size`` marker, ``--fakepg-seed``,
and failure output that carries the hang/mismatch report and a command that replays it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# tests/conftest.py imports torch and fakepg before any of pytester's in-process runs
pytest_plugins = ["pytester"]

DDP_TEST = '''
import pytest, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@pytest.mark.world_size(3)
def test_all_reduce_on_three_ranks(fake_cluster):
    def body(rank):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return dist.get_world_size(), dist.get_rank(), t.item()

    assert fake_cluster.run(body).returns == [(3, 0, 3.0), (3, 1, 3.0), (3, 2, 3.0)]


@pytest.mark.world_size(4)
def test_ddp_keeps_replicas_equal(fake_cluster):
    def train(rank):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()   # each rank draws its own batch
            opt.step()
        return model.module.weight.detach()

    result = fake_cluster.run(train)
    assert all(torch.equal(w, result.returns[0]) for w in result.returns)
    assert [r.op for r in result.trace[0]].count("all_reduce") == 3


def test_without_a_marker_the_world_has_two_ranks(fake_cluster):
    assert fake_cluster.run(lambda rank: dist.get_world_size()).returns == [2, 2]
    assert fake_cluster.run(lambda rank: dist.get_world_size(), nprocs=5).returns == [5] * 5
'''

HANG_TEST = '''
import pytest, torch, torch.distributed as dist


@pytest.mark.world_size(2)
def test_uneven(fake_cluster):
    def body(rank):
        for i in range(1 + rank):
            dist.all_reduce(torch.ones(3))
    fake_cluster.run(body)


def test_mismatch(fake_cluster):
    def body(rank):
        dist.all_reduce(torch.ones(4 + rank))
    fake_cluster.run(body)
'''

SEED_TEST = '''
import json, torch


def test_record(fake_cluster):
    result = fake_cluster.run(lambda rank: torch.rand(2).tolist())
    pinned = fake_cluster.run(lambda rank: torch.rand(2).tolist(), seed=3)
    with open("seen.json", "w") as f:
        json.dump({"seed": fake_cluster.seed, "result_seed": result.seed,
                   "draws": result.returns, "pinned_seed": pinned.seed, "pinned": pinned.returns}, f)
    assert fake_cluster.seed != 5, "fail on purpose when the seed is 5, to show the replay line"
'''


def line_of(source: str, text: str) -> int:
    """Line number of ``text`` in ``source`` as pytester writes it (leading newline dropped)."""
    [n] = [i + 1 for i, line in enumerate(source.lstrip("\n").splitlines()) if text in line]
    return n


def test_fake_cluster_fixture_runs_the_function_on_the_world_size_the_marker_names(pytester):
    pytester.makepyfile(test_ddp=DDP_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_a_hanging_test_fails_with_the_hang_report_once_and_the_command_that_replays_it(pytester):
    pytester.makepyfile(test_hang=HANG_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    uneven = line_of(HANG_TEST, "dist.all_reduce(torch.ones(3))")
    mismatch = line_of(HANG_TEST, "dist.all_reduce(torch.ones(4 + rank))")
    result.stdout.fnmatch_lines([
        "E*fakepg.errors.CollectiveHangError: fakepg: hang detected: no rank can make progress "
        "(2 ranks, seed 0). Per rank:",
        "E*  rank 0: finished (returned)",
        "E*  rank 1: blocked waiting on all_reduce(shapes=[[](3,)[]], dtypes=[[]float32[]], op=SUM) #1 "
        f"on group '0' (ranks [[]0, 1[]]), issued at test_hang.py:{uneven}; waits for ranks [[]0[]]",
        "*use torch.distributed.algorithms.Join*",
        "*- fakepg -*",
        "replay: python -m pytest test_hang.py::test_uneven -p no:xdist --fakepg-seed 0",
    ])
    result.stdout.fnmatch_lines([
        "E*fakepg.errors.CollectiveMismatchError: collective #0 on group '0' (ranks [[]0, 1[]]) "
        "does not match across ranks (differs in: tensors):",
        f"E*  rank 0: all_reduce(shapes=[[](4,)[]], dtypes=[[]float32[]], op=SUM) at test_hang.py:{mismatch}",
        f"E*  rank 1: all_reduce(shapes=[[](5,)[]], dtypes=[[]float32[]], op=SUM) at test_hang.py:{mismatch}",
        "*- fakepg -*",
        "replay: python -m pytest test_hang.py::test_mismatch -p no:xdist --fakepg-seed 0",
    ])
    out = result.stdout.str()
    # the report once (not again in the fakepg section, nor in c10d's debug log, whose echo
    # led with the 30-minute group timeout), and no harness frame with its locals; the short
    # summary (untruncated where $CI is set) quotes the error's first line
    shown = [line for line in out.splitlines() if not line.startswith("FAILED ")]
    assert sum("hang detected: no rank can make progress" in line for line in shown) == 1
    assert "c10d_logger" not in out and "1800000ms" not in out
    assert "fakepg/launch/spawn.py" not in out and "fakepg/world/outcome.py" not in out
    assert "raise_outcome" not in out and "sched = " not in out


def test_fakepg_seed_option_changes_the_seed_of_every_fake_world_and_the_replay_line(pytester):
    pytester.makepyfile(test_seed=SEED_TEST)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    default = json.loads((pytester.path / "seen.json").read_text())
    result = pytester.runpytest("-p", "no:cacheprovider", "--fakepg-seed", "5")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*replay: python -m pytest test_seed.py::test_record -p no:xdist --fakepg-seed 5*"])
    seeded = json.loads((pytester.path / "seen.json").read_text())
    assert (default["seed"], default["result_seed"]) == (0, 0)
    assert (seeded["seed"], seeded["result_seed"]) == (5, 5)
    assert seeded["draws"] != default["draws"]  # unseeded ranks start from a state fixed by the seed
    assert len({tuple(d) for d in default["draws"]}) == 2  # ... and by the rank
    # run(..., seed=) pins one world's seed whatever the option says
    assert default["pinned_seed"] == seeded["pinned_seed"] == 3 and default["pinned"] == seeded["pinned"]


LIGHT_TEST = '''
import sys


def test_nothing_of_fakepg(request):
    assert request.config.pluginmanager.has_plugin("fakepg")
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fakepg", "simddp"))
    assert heavy == [], heavy


def test_fakepg_options_and_markers_are_declared_without_loading_it(request):
    assert request.config.getoption("--fakepg-seed") == 7
    assert any(line.startswith("world_size(") for line in request.config.getini("markers"))
    assert "torch" not in sys.modules
'''

USES_FIXTURE = '''
import sys


def test_the_fixture_loads_fakepg_on_first_use(fake_cluster):
    assert "torch" in sys.modules and "fakepg.pytest_plugin" in sys.modules
    assert fake_cluster.run(lambda rank: rank).returns == [0, 1]
'''


def test_loading_the_plugin_imports_neither_torch_nor_fakepg_until_a_test_uses_the_fixture(tmp_path):
    # A fresh interpreter, as any pytest run in an environment where fakepg is installed starts.
    (tmp_path / "test_light.py").write_text(LIGHT_TEST)
    (tmp_path / "test_fixture.py").write_text(USES_FIXTURE)
    light = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "--fakepg-seed", "7", "test_light.py"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert light.returncode == 0, light.stdout + light.stderr
    used = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_fixture.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert used.returncode == 0, used.stdout + used.stderr
