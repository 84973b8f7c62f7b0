"""Specs for the ``simddp`` command, the what-if engine, sweep results and executors.

The command runs as users run it (``python -m simddp``, the console script's module) in a
subprocess, with small worlds of the zoo's MLP, so each call costs a few seconds.
"""

from __future__ import annotations

import concurrent.futures
import csv
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import simddp
from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.whatif import calibrate_compute, load_workload, step_time, whatif
from simddp.replay import replay
from simddp import capture, sweep

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"world_size", "bucket_cap_mb", "comm_hook", "iteration_time_s", "exposed_comm_s"}


def run_cli(*args: str, cwd: Path = ROOT, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "simddp", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def cap():
    return capture(zoo.get("mlp", iterations=3), nprocs=1,
                   timing=Timing(network=Network.preset("100gbe"),
                                 compute=Compute.roofline("a100")))


# -- the command -------------------------------------------------------------------------------


def test_whatif_prints_an_80_column_table_and_writes_csv_plots_json_and_capture(tmp_path):
    out = tmp_path / "results"
    proc = run_cli("whatif", "mlp", "--world-size", "8,64", "--network", "ib-ndr",
                   "--gpus-per-node", "8", "--bucket-cap-mb", "1,25", "--straggler", "17:0.5",
                   "--out", str(out), "--json", str(tmp_path / "rows.json"))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("wrote ")]
    assert all(len(line) <= 80 for line in lines), lines  # the table; paths are the user's
    body = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [b[:2] for b in body] == [["8", "1"], ["8", "25"], ["64", "1"], ["64", "25"]]
    assert "capturing mlp" in proc.stderr  # progress on stderr, not in the table

    with open(out / "rows.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and KEYS <= set(rows[0])
    # rank 17 exists only in the 64-rank world: the straggler slows that world alone
    assert [r["rank_speed"] for r in rows] == ["", "", '{"17": 0.5}', '{"17": 0.5}']
    assert {r["slowest_rank"] for r in rows[2:]} == {"17"}
    assert float(rows[2]["iteration_time_s"]) > float(rows[0]["iteration_time_s"])

    for name in ("scaling.png", "breakdown.png", "timeline.png"):
        w, h = png_size(out / name)
        assert w >= 400 and h >= 300 and (out / name).stat().st_size > 10_000, name
    js = json.loads((tmp_path / "rows.json").read_text())
    assert len(js) == 4 and all(KEYS <= set(r) for r in js)
    assert js[0]["world_size"] == 8 and js[1]["bucket_cap_mb"] == 25.0
    assert js[0]["comm_hook"] is None and js[0]["exposed_comm_s"] >= 0

    assert js[0]["gpu_memory_gb"] == 80 * 2 ** 30 / 1e9 and js[0]["oom"] is False  # a100: 80 GiB
    again = run_cli("replay", str(out / "capture.json"), "--world-size", "8,64",
                    "--gpus-per-node", "8", "--bucket-cap-mb", "1,25", "--straggler", "17:0.5",
                    "--gpu-memory", "80", "--json", str(tmp_path / "again.json"),  # GiB
                    "--no-progress")
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again.json").read_text()) == js  # one result, replayed


def test_whatif_runs_a_user_script_defining_scenario(tmp_path):
    script = tmp_path / "my_workload.py"
    script.write_text("from fakepg import zoo\n"
                      "def scenario(batch_size=8):\n"
                      "    return zoo.get('mlp', depth=2, width=16, batch_size=batch_size)\n")
    proc = run_cli("whatif", str(script), "--world-size", "2,4", "--batch-size", "4",
                   "--comm-hook", "none,fp16", "--json", str(tmp_path / "r.json"),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["world_size"], r["comm_hook"]) for r in rows] == [
        (2, None), (2, "fp16"), (4, None), (4, "fp16")]


def test_bad_input_is_one_line_naming_it_and_exit_status_1_or_2(tmp_path):
    proc = run_cli("whatif", "no_such_model", "--world-size", "2", "--no-progress")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "no_such_model" in proc.stderr and "mlp" in proc.stderr
    proc = run_cli("whatif", "mlp", "--world-size", "2", "--straggler", "3")
    assert proc.returncode == 2 and "RANK:SPEED" in proc.stderr
    (tmp_path / "empty.py").write_text("x = 1\n")
    proc = run_cli("whatif", str(tmp_path / "empty.py"), "--world-size", "2")
    assert proc.returncode == 1 and "defines no `scenario`" in proc.stderr


def test_the_console_script_is_declared_and_main_returns_the_exit_status(capsys, tmp_path):
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["simddp"] == "simddp.cli:main"
    extras = meta["project"]["optional-dependencies"]
    for dep in ("pandas", "dask[distributed]"):
        assert any(d.startswith(dep) for d in extras["sweeps"])
        assert any(d.startswith(dep) for d in extras["test"])
    from simddp.cli import main

    assert main(["whatif", "mlp", "--world-size", "2", "--no-progress",
                 "--json", str(tmp_path / "r.json")]) == 0
    assert "ranks" in capsys.readouterr().out


@pytest.mark.gloo
def test_calibrate_measures_gloo_collectives_and_fits_alpha_beta(tmp_path):
    proc = run_cli("calibrate", "--world-size", "2", "--sizes", "4K,1M", "--reps", "3",
                   "--json", str(tmp_path / "cal.json"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "cal.json").read_text())
    assert [(m["op"], m["world_size"], m["bytes"], m["backend"]) for m in doc["measurements"]] \
        == [("all_reduce", 2, 4096, "gloo"), ("all_reduce", 2, 1 << 20, "gloo")]
    assert all(m["seconds"] > 0 for m in doc["measurements"])
    # noise on a shared machine may leave no α–β line, but the line says which way it went
    assert any(line.startswith(("all_reduce: α–β fit", "all_reduce: no α–β fit"))
               for line in proc.stdout.splitlines())
    # the file is a network model: the measured points come back as measured
    net = Network.from_measurements(tmp_path / "cal.json")
    for m in doc["measurements"]:
        assert net.collective_time("all_reduce", m["bytes"], 2) == m["seconds"]
    whatif = run_cli("whatif", "mlp", "--world-size", "2,4", "--network", str(tmp_path / "cal.json"),
                     "--no-progress", "--json", str(tmp_path / "rows.json"))
    assert whatif.returncode == 0, whatif.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["world_size"], r["network"]) for r in rows] == [(2, "measured:cal.json"),
                                                                (4, "measured:cal.json")]


# -- the engine ----------------------------------------------------------------------------------


def test_step_time_calibration_makes_a_no_ddp_step_take_the_given_time():
    sc = zoo.get("mlp", iterations=3)
    model, factor = calibrate_compute(sc, Compute.kernels("v100"), 0.097)  # whatif's default
    assert step_time(sc, model) == pytest.approx(0.097, rel=1e-9)
    assert factor > 1  # a 6-layer, 64-wide MLP is far below 97 ms on a V100
    # the meta device (shapes only) charges exactly what real CPU tensors charge
    assert step_time(sc, model, device="meta") == pytest.approx(
        step_time(sc, model, device="cpu"), rel=1e-12)
    rows = whatif(sc, world_size=[1, 8], network="dgx1-v100", gpu="v100", step_time_s=0.097)
    assert rows.meta["calibration_factor"] == pytest.approx(factor)
    assert rows[0]["iteration_time_s"] >= 0.097 * 0.999  # DDP adds its copies, never less


def test_whatif_leaves_stragglers_out_of_worlds_too_small_for_them(cap):
    rows = whatif("mlp", world_size=[2, 8], rank_speed={5: 0.5}, network="100gbe")
    assert [r["rank_speed"] for r in rows] == [None, {"5": 0.5}]
    assert rows[1]["slowest_rank"] == 5


def test_load_workload_names_what_it_accepts():
    assert load_workload("resnet50", batch_size=4).name == "resnet50"
    with pytest.raises(ValueError, match="no depth parameter.*batch_size"):
        load_workload("resnet50", depth=3)


# -- SweepResult and executors ---------------------------------------------------------------------


def test_sweep_result_is_a_list_of_rows_with_table_csv_json_pandas(cap, tmp_path):
    res = sweep(cap, world_size=[8, 64], bucket_cap_mb=[1, 25], comm_hook=[None, "fp16"])
    assert isinstance(res, list) and len(res) == 8 and isinstance(res, simddp.SweepResult)
    assert res.varying() == ["bucket_cap_mb", "comm_hook"]
    table = res.table(width=80)
    assert all(len(line) <= 80 for line in table.splitlines())
    assert len(res.to_csv(tmp_path / "r.csv").splitlines()) == 9
    assert [r["world_size"] for r in json.loads(res.to_json())] == [8] * 4 + [64] * 4
    df = res.to_pandas()
    assert df.shape[0] == 8 and KEYS <= set(df.columns)
    assert res.replay(5).iteration_time == res[5]["iteration_time_s"]


def test_sweep_on_a_process_pool_gives_the_rows_of_a_local_sweep(cap):
    grid = dict(world_size=[8, 64, 256], bucket_cap_mb=[1, 25], rank_speed={3: 0.5})
    local = sweep(cap, **grid)
    seen = []
    with concurrent.futures.ProcessPoolExecutor(2) as ex:
        pooled = sweep(cap, executor=ex, progress=lambda d, t, row: seen.append((d, t)), **grid)
    assert pooled.to_json() == local.to_json()
    assert sorted(seen) == [(i, 6) for i in range(1, 7)]


@pytest.mark.slow
def test_sweep_and_the_command_on_a_dask_local_cluster(cap, tmp_path):
    distributed = pytest.importorskip("distributed")
    grid = dict(world_size=[8, 64], comm_hook=[None, "fp16"])
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        on_dask = sweep(cap, executor=client.get_executor(), **grid)
        assert on_dask.to_json() == sweep(cap, **grid).to_json()
        proc = run_cli("whatif", "mlp", "--world-size", "8,64", "--comm-hook", "none,fp16",
                       "--dask", cluster.scheduler_address, "--json", str(tmp_path / "d.json"),
                       "--no-progress")
        assert proc.returncode == 0, proc.stderr
    local = run_cli("whatif", "mlp", "--world-size", "8,64", "--comm-hook", "none,fp16",
                    "--json", str(tmp_path / "l.json"), "--no-progress")
    assert local.returncode == 0, local.stderr
    assert (tmp_path / "d.json").read_text() == (tmp_path / "l.json").read_text()


# -- plots, presets, summaries (the bugs of issue 11) ------------------------------------------------


def test_a_timeline_over_16_ranks_shows_its_straggler_and_says_which_ranks_it_shows(cap, tmp_path):
    res = replay(cap, 1024, network=Network.preset("ib-ndr", gpus_per_node=8),
                 rank_speed={17: 0.5}, iterations=2)
    why = res.timeline.notable_ranks()
    assert len(why) == 16 and 17 in why and "straggler" in why[17] and 0 in why
    from simddp.analysis.plot import _ranges

    assert _ranges([0, 1, 2, 17, 40, 41]) == "0-2, 17, 40-41"
    w, h = png_size(Path(res.timeline.plot(tmp_path / "t.png")))
    assert h < 3000  # 16 lanes, not 1024
    # the default title of a subset names it (text is drawn, so check the code path's output)
    import matplotlib

    matplotlib.use("Agg")
    from simddp.analysis import plot as plot_mod

    titles = []
    real = plot_mod.load_matplotlib

    def spy():
        canvas, figure, patch = real()

        class F(figure):
            def savefig(self, *a, **k):
                titles.append(self.axes[0].get_title())
                return super().savefig(*a, **k)
        return canvas, F, patch

    plot_mod.load_matplotlib = spy
    try:
        res.timeline.plot(tmp_path / "a.png", ranks=[0, 17])
        res.timeline.plot(tmp_path / "b.png")
        replay(cap, 4).timeline.plot(tmp_path / "c.png")
    finally:
        plot_mod.load_matplotlib = real
    assert titles == ["simddp timeline: ranks 0, 17 of 1024, 2 iterations",
                      "simddp timeline: ranks 0-14, 17 of 1024, 2 iterations",
                      "simddp timeline: 4 ranks, 1 iterations"]
    with pytest.raises(ValueError, match="rank 4096 is not in this timeline of 1024 ranks"):
        res.timeline.plot(tmp_path / "x.png", ranks=[4096])


def test_network_preset_takes_name_as_a_field_and_dgx1_v100_exists():
    assert Network.preset("nvlink", name="my-nvlink").name == "my-nvlink"
    assert Network.preset("ib-ndr", name="x", gpus_per_node=8).intra_bandwidth_GBps == 450.0
    dgx = Network.preset("dgx1-v100")
    assert dgx.gpus_per_node == 8 and dgx.name == "dgx1-v100"


def test_replay_summary_shows_rank_numbers_not_strings(cap):
    text = replay(cap, 8, rank_speed={3: 0.5}).summary()
    assert "rank_speed={3: 0.5}" in text


def test_exposed_comm_is_a_list_per_iteration_and_its_mean_a_float(cap):
    res = replay(cap, 8, iterations=3)
    assert isinstance(res.exposed_comm, list) and len(res.exposed_comm) == 3
    assert res.mean_exposed_comm == pytest.approx(sum(res.exposed_comm) / 3)


# -- the zoo's ResNets -----------------------------------------------------------------------------


def test_zoo_resnets_match_torchvision_parameter_counts_and_names():
    from fakepg.zoo import resnet

    r50, r101 = resnet.resnet50(), resnet.resnet101()
    assert sum(p.numel() for p in r50.parameters()) == 25_557_032
    assert sum(p.numel() for p in r101.parameters()) == 44_549_160
    keys = list(r50.state_dict())
    assert len(keys) == 320 and keys[:2] == ["conv1.weight", "bn1.weight"]
    assert "layer2.0.downsample.0.weight" in keys and keys[-2:] == ["fc.weight", "fc.bias"]
    assert r50.layer2[0].conv2.stride == (2, 2) and r50.layer2[0].conv1.stride == (1, 1)  # v1.5
    sc = zoo.get("resnet50", batch_size=2, image_size=64)
    assert "resnet50" not in zoo.SCENARIOS and "resnet50" in zoo.WORKLOADS
    model = sc.build_model()
    loss = sc.step(model, sc.inputs(0, 1)[0])
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_whatif_help_lists_the_workloads_presets_and_parallel_modes_the_registries_hold(
        monkeypatch, capsys):
    import re

    from simddp import cli, cli_args
    from simddp.program import registry
    from simddp.models.devices import DEVICES
    from simddp.models.presets import PRESETS

    # help reads light tables (the zoo and presets import torch); they equal the registries
    tables = list(cli_args.HELP_LISTINGS.values())
    assert [list(t) for t in tables] == [list(zoo.SCENARIOS), list(zoo.WORKLOADS),
                                         list(PRESETS), list(DEVICES)]
    # the parallelism registry is read live: an entry registered is listed
    monkeypatch.setitem(registry.REGISTRY, "my-mode", registry.Parallelism(
        "my-mode", "cp", "a mode a test registered", reserved="a test's"))
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["whatif", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    epilog = " ".join(out[out.index("workloads (WORKLOAD"):].split())
    names = [*zoo.SCENARIOS, *zoo.WORKLOADS, *PRESETS, *DEVICES, *registry.REGISTRY]
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", epilog)]
    assert not missing and "my-mode: a mode a test registered" in epilog
