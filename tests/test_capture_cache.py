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


def _tiny_llama_config(path, layers=2):
    """A Hugging Face Llama config.json small enough to capture in a second."""
    cfg = json.loads(open("tests/data/hf/llama3.1-8b.json").read())
    cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=layers, vocab_size=256)
    path.write_text(json.dumps(cfg))
    return str(path)


def test_a_workload_named_again_is_found_without_building_it(cache, monkeypatch):
    import simddp.whatif as w

    said = []
    first = whatif("llama3-tiny", world_size=[4, 8], parallel="fsdp", status=said.append)
    assert any(s.startswith("capturing") for s in said)
    monkeypatch.setattr(w, "load_workload", lambda *a, **k: pytest.fail("workload built"))
    said.clear()
    again = whatif("llama3-tiny", world_size=[4, 8], parallel="fsdp", status=said.append)
    assert not any(s.startswith("capturing") for s in said)
    assert any("loaded from the cache" in s for s in said)
    assert _figures(again) == _figures(first)
    assert (again.title, again.meta) == (first.title, first.meta)  # named as the build named it
    assert again.table() == first.table()


def test_a_corrupt_entry_behind_a_reference_is_captured_anew_and_found_again(cache):
    said = []
    whatif("llama3-tiny", world_size=4, parallel="fsdp", status=said.append)
    (entry,) = cache.glob("*.json")
    entry.write_text('{"kind": "CapturedStep", "schema": 1, "profiles": [')  # truncated
    said.clear()
    whatif("llama3-tiny", world_size=4, parallel="fsdp", status=said.append)
    assert any("ignoring the cache entry" in s for s in said)
    assert any(s.startswith("capturing") for s in said)
    said.clear()
    whatif("llama3-tiny", world_size=4, parallel="fsdp", status=said.append)
    assert not any(s.startswith("capturing") for s in said)
    assert any("loaded from the cache" in s for s in said)


def test_an_edited_config_file_is_captured_anew(cache, tmp_path):
    path = _tiny_llama_config(tmp_path / "config.json")
    said = []
    whatif(path, world_size=4, parallel="fsdp", status=said.append)
    whatif(path, world_size=4, parallel="fsdp", status=said.append)
    assert sum(s.startswith("capturing") for s in said) == 1
    _tiny_llama_config(tmp_path / "config.json", layers=3)  # same file, another model
    said.clear()
    whatif(path, world_size=4, parallel="fsdp", status=said.append)
    assert any(s.startswith("capturing") for s in said)


_WARM = """
import json, sys
from simddp.cli import main
main(sys.argv[1:])
print(json.dumps({m: m in sys.modules for m in %r}))
"""


@pytest.fixture(scope="module")
def warm_modules(tmp_path_factory):
    """Which modules a warm ``simddp whatif`` of a Hugging Face config loaded (a fresh
    process; the cache filled in this one)."""
    import os
    import subprocess
    import sys

    from simddp.cli import main

    tmp = tmp_path_factory.mktemp("warm")
    args = ["whatif", _tiny_llama_config(tmp / "config.json"), "--parallel", "fsdp",
            "--world-size", "4", "--no-progress"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SIMDDP_CACHE_DIR", str(tmp / "cache"))
        mp.delenv("SIMDDP_NO_CACHE", raising=False)
        assert main(args) == 0
        names = ["torch", "transformers", "simddp.cosim.capture",
                 "simddp.cosim.simulate", "simddp.models.compute"]
        proc = subprocess.run([sys.executable, "-c", _WARM % names, *args], env=os.environ,
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_warm_whatif_builds_no_model_and_runs_no_capture_machinery(warm_modules):
    loaded = [m for m, there in warm_modules.items() if there and m != "torch"]
    assert not loaded, f"a warm whatif loaded {loaded}"


def test_a_warm_whatif_imports_no_torch(warm_modules):
    assert not warm_modules["torch"]
