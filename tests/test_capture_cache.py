"""The on-disk capture cache: a second what-if of the same configuration loads its capture,
a different model, layout or capture option captures afresh, a corrupt entry is ignored with
a note, and the cache lives where the user's cache directory is."""

import json

import pytest
from fakepg import zoo

from simddp.capture_cache import cache_dir
from simddp.whatif import whatif


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("SIMDDP_NO_CACHE", raising=False)
    monkeypatch.setenv("SIMDDP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(**kw):
    """(rows, capture lines, cache-hit lines) of one what-if of the small transformer."""
    said = []
    args = dict(world_size=[4, 8], parallel="fsdp", cache=None)
    args.update(kw)
    rows = whatif(zoo.get("llama3-tiny"), status=said.append, **args)
    return (rows, [s for s in said if s.startswith("capturing")],
            [s for s in said if "loaded from the cache" in s])


def _figures(rows):
    return [(r["world_size"], r["iteration_time_s"], r["peak_memory_bytes"]) for r in rows]


def test_a_second_whatif_of_the_same_configuration_loads_its_capture(cache):
    rows, captured, hits = _run()
    assert len(captured) == 1 and not hits and len(list(cache.glob("*.json"))) == 1
    again, captured, hits = _run()
    assert not captured and len(hits) == 1
    assert _figures(again) == _figures(rows)  # the same answer from the stored capture


@pytest.mark.parametrize("change", [dict(parallel="hsdp:2"), dict(param_dtype="bf16"),
                                   dict(reshard_after_forward=False), dict(seed=1),
                                   dict(gpu="h100"), dict(parallel="zero2")])
def test_what_changes_the_capture_misses_the_cache(cache, change):
    _run()
    _, captured, hits = _run(**change)
    assert len(captured) == 1 and not hits


def test_replay_only_knobs_reuse_the_capture(cache):
    _run()
    _, captured, hits = _run(world_size=[16], forward_prefetch=2, jitter=0.1)
    assert not captured and len(hits) == 1


def test_a_corrupt_entry_is_ignored_with_a_note_and_written_anew(cache):
    _run()
    (entry,) = cache.glob("*.json")
    entry.write_text('{"kind": "CapturedStep", "schema": 1, "profiles": [')  # truncated
    said = []
    whatif(zoo.get("llama3-tiny"), world_size=4, parallel="fsdp", status=said.append)
    assert any("ignoring the cache entry" in s for s in said)
    assert any(s.startswith("capturing") for s in said)
    assert json.loads(entry.read_text())["kind"] == "CapturedStep"  # replaced whole
    assert not list(cache.glob(".tmp-*"))  # written through a temporary file, renamed


def test_no_cache_and_the_suite_switch_bypass_it(cache, monkeypatch):
    _run(cache=False)
    assert not cache.exists() or not list(cache.glob("*.json"))
    monkeypatch.setenv("SIMDDP_NO_CACHE", "1")
    _run()
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SIMDDP_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SIMDDP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "simddp"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "simddp"


@pytest.mark.slow  # three processes that import torch
def test_the_command_line_reuses_captures_across_commands(cache, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "SIMDDP_CACHE_DIR": str(cache)}
    env.pop("SIMDDP_NO_CACHE", None)
    cmd = [sys.executable, "-m", "simddp", "whatif", "mlp", "--world-size", "2,4"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    bypass = subprocess.run(cmd + ["--no-cache"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert "capturing mlp" in first.stderr and "capturing mlp" not in second.stderr
    assert "loaded from the cache" in second.stderr and "capturing mlp" in bypass.stderr
    assert first.stdout == second.stdout == bypass.stdout
