"""Specs for pipeline and 3-D what-ifs from the command line: ``simddp whatif --parallel
pp:P,fsdp,tp:T --pp-schedule … --microbatches …`` (one capture of torch's real pipelining per
schedule, replayed per microbatch count) and ``simddp replay`` of a saved pipeline capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simddp.program.parallel import Parallel

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "simddp", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[list[dict], Path, str]:
    out = tmp_path_factory.mktemp("pp")
    p = run_cli("whatif", "llama3-tiny", "--parallel", "pp:2,fsdp,tp:2", "--world-size", "16,32",
                "--network", "dgx-h100", "--gpu", "h100", "--pp-schedule",
                "1f1b,interleaved1f1b", "--microbatches", "4,8", "--json",
                str(out / "rows.json"), "--save-capture", str(out / "cap.json"),
                "--no-progress")
    assert p.returncode == 0, p.stderr
    return json.loads((out / "rows.json").read_text()), out, p.stdout


def test_a_3d_whatif_gives_a_row_per_schedule_microbatch_count_and_world(rows):
    data, _, _ = rows
    assert len(data) == 2 * 2 * 2
    assert {(r["pp_schedule"], r["microbatches"], r["world_size"]) for r in data} == {
        (s, m, n) for s in ("1F1B", "Interleaved1F1B") for m in (4, 8) for n in (16, 32)}
    for r in data:
        assert r["parallel"] == "pp:2,fsdp,tp:2"  # as given; resolved at this world size:
        assert r["layout"] == f"pp:2,fsdp:{r['world_size'] // 4},tp:2"
        assert 0 < r["bubble_fraction"] < 1
        assert r["peak_memory_bytes"] > 0
        # p2p between stages, FSDP2 inside them and TP inside blocks, each its own figure
        assert {"pp", "tp"} <= set(r["exposed_comm_by_dim"])


def test_more_microbatches_and_interleaving_shrink_the_bubble(rows):
    data, _, _ = rows
    bubble = {(r["pp_schedule"], r["microbatches"], r["world_size"]): r["bubble_fraction"]
              for r in data}
    for n in (16, 32):
        for s in ("1F1B", "Interleaved1F1B"):
            assert bubble[s, 8, n] < bubble[s, 4, n]
        for m in (4, 8):
            assert bubble["Interleaved1F1B", m, n] < bubble["1F1B", m, n]


def test_the_table_shows_schedule_microbatches_bubble_and_memory_in_80_columns(rows):
    _, _, stdout = rows
    header = next(line for line in stdout.splitlines() if line.lstrip().startswith("ranks"))
    for col in ("schedule", "mb", "bubble", "peak mem"):
        assert col in header
    assert max(len(line) for line in stdout.splitlines()) <= 80


def test_a_saved_pipeline_capture_replays_under_another_schedule(rows):
    _, out, _ = rows
    p = run_cli("replay", str(out / "cap.json"), "--world-size", "64", "--network", "dgx-h100",
                "--parallel", "pp:2,fsdp:16,tp:2", "--pp-schedule", "gpipe,1f1b",
                "--microbatches", "8", "--json", str(out / "replayed.json"), "--no-progress")
    assert p.returncode == 0, p.stderr
    got = json.loads((out / "replayed.json").read_text())
    assert [r["pp_schedule"] for r in got] == ["GPipe", "1F1B"]
    # GPipe and 1F1B have the same bubble at uniform stages; their iteration times differ by
    # where the p2p waits fall and what memory they hold, not by the bubble's closed form
    assert all(r["world_size"] == 64 and r["microbatches"] == 8 for r in got)


def test_pipeline_layouts_are_refused_with_what_is_accepted():
    p = run_cli("whatif", "llama3-tiny", "--parallel", "pp:2,ddp:4", "--world-size", "8",
                "--no-progress")
    assert p.returncode != 0
    assert "pipeline stages are replicated with FSDP2" in p.stderr
    p = run_cli("whatif", "llama3-tiny", "--parallel", "pp:2,fsdp", "--world-size", "8",
                "--batch-size", "8", "--microbatches", "3", "--no-progress")
    assert p.returncode != 0
    assert "--microbatches 3 does not divide --batch-size 8" in p.stderr


def test_the_issues_3d_layout_parses_pipeline_outermost_and_tp_innermost():
    par = Parallel.parse("pp:4,fsdp:16,tp:8", 512)
    assert (par.pp, par.shard, par.tp, par.data) == (4, 16, 8, "fsdp")
    mesh = par.mesh()
    assert mesh.dims == {"pp": 4, "shard": 16, "tp": 8}
    # rank 9: pipeline stage 0, shard 1, tp 1 — its TP group is the 8 consecutive ranks
    assert list(mesh.members(9, "tp")) == list(range(8, 16))
    assert list(mesh.members(9, "pp")) == [9, 137, 265, 393]


def test_a_spec_with_every_size_is_its_own_world_size_and_otherwise_one_is_asked_for():
    p = run_cli("whatif", "llama3-tiny", "--parallel", "pp:2,fsdp:2,tp:2", "--network",
                "dgx-h100", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert any(line.split()[:1] == ["8"] for line in p.stdout.splitlines())
    p = run_cli("whatif", "llama3-tiny", "--parallel", "pp:2,fsdp,tp:2", "--no-progress")
    assert p.returncode != 0
    assert "--world-size is needed" in p.stderr


def test_activation_checkpointing_is_refused_for_ddp_layouts_it_does_not_capture():
    p = run_cli("whatif", "mlp", "--world-size", "4", "--activation-checkpointing",
                "--no-progress")
    assert p.returncode != 0
    assert "activation checkpointing is captured for FSDP2, tensor and pipeline layouts" \
        in p.stderr
