"""The Job interface and `simddp whatif` with the user's configuration: --torchtitan,
--megatron, --seq-len, --local-batch, --global-batch, models that are not zoo names."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from simddp.cli import _parser
from simddp.jobs import Job, read_torchtitan, resolve_model
from simddp.jobs.cli import accumulation, apply_job
from simddp.whatif import whatif

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


def _apply(*argv: str):
    args = _parser().parse_args(["whatif", *argv])
    err = io.StringIO()
    workload = apply_job(args, whatif, err)
    return args, workload, err.getvalue()


def test_job_refuses_unknown_knobs_and_ac_modes():
    sc = resolve_model("debugmodel")
    with pytest.raises(ValueError, match="unknown knob"):
        Job(sc, "x", 8, 1, None, "fsdp", None, knobs={"zero_bubble": True})
    with pytest.raises(ValueError, match="selective-layer:N"):
        Job(sc, "x", 8, 1, None, "fsdp", None, knobs={"activation_checkpointing": "some"})


def test_whatif_args_is_a_command_line_for_the_job():
    job = read_torchtitan(DATA / "torchtitan" / "llama3_70b.toml", 64)
    assert job.whatif_args() == (
        "simddp whatif llama3:70B --parallel fsdp:8,tp:8 --world-size 64 --seq-len 8192 "
        "--local-batch 8 --global-batch 64 --activation-checkpointing full --param-dtype bf16 "
        "--reduce-dtype fp32")


def test_torchtitan_flag_fills_the_layout_and_lists_what_is_not_modelled():
    args, workload, err = _apply("--torchtitan", str(DATA / "torchtitan" / "llama3_8b.toml"),
                                 "--world-size", "64")
    assert args.parallel == ["fsdp:64"] and args.world_size == [64]
    assert (args.param_dtype, args.reduce_dtype, args.batch_size) == ("bf16", "fp32", 1)
    assert workload.name == "llama3-8b" and workload.seq_len == 8192
    assert "not modelled: training.max_norm=1.0" in err
    assert args.activation_checkpointing == "selective-op"  # torchtitan's policy, captured as is
    assert "not modelled: activation_checkpointing" not in err


def test_ddp_jobs_pass_no_fsdp_knobs_and_say_what_of_mixed_precision_is_not_modelled(tmp_path):
    toml = tmp_path / "ddp.toml"
    toml.write_text("[model]\nflavor = 'debugmodel'\n[parallelism]\n"
                    "data_parallel_replicate_degree = 8\ndata_parallel_shard_degree = 1\n")
    job = read_torchtitan(toml)
    assert job.parallel == "ddp:8"
    kw, missing = job.whatif_kwargs(whatif)
    assert "reshard_after_forward" not in kw and "param_dtype" not in kw
    assert any(line.startswith("param_dtype=bf16 with DDP") for line in missing)


def test_flags_the_user_gives_win_over_the_job():
    args, workload, _ = _apply("--torchtitan", str(DATA / "torchtitan" / "llama3_70b.toml"),
                               "--world-size", "64", "--parallel", "fsdp:4,tp:16",
                               "--seq-len", "2048", "--param-dtype", "fp32")
    assert args.parallel == ["fsdp:4,tp:16"] and args.param_dtype == "fp32"
    assert workload.seq_len == 2048 and args.activation_checkpointing == "full"


def test_global_batch_beyond_the_layout_is_accumulation_and_said_so():
    _, _, err = _apply("llama3_8b", "--seq-len", "1024", "--local-batch", "2",
                       "--global-batch", "256", "--parallel", "fsdp", "--world-size", "32")
    assert "4 microsteps per optimizer step" in err
    assert accumulation(256, 2, "fsdp", 128) == 1
    with pytest.raises(ValueError, match="not a multiple"):
        accumulation(100, 2, "fsdp", 64)


def test_models_that_are_not_zoo_names_are_resolved():
    _, workload, _ = _apply(str(DATA / "hf" / "pythia-160m.json"), "--seq-len", "256",
                            "--world-size", "8", "--parallel", "fsdp")
    assert workload.name == "pythia-160m" and workload.seq_len == 256
    _, workload, err = _apply(str(DATA / "hf" / "mistral-7b.json"), "--world-size", "16",
                              "--parallel", "fsdp:2,tp:8")
    assert workload.recipe.kind == "llama" and "zoo's Llama of the same shape" in err
    with pytest.raises(ValueError, match="--parallel with tp"):
        _apply(str(DATA / "hf" / "gpt2.json"), "--world-size", "16", "--parallel", "fsdp:2,tp:8")
    args, workload, _ = _apply("bert-base", "--world-size", "8")
    assert workload == "bert_base"  # a zoo name takes the zoo's own path, either spelling


def test_load_workload_takes_every_model_form():
    from simddp.whatif import load_workload

    assert load_workload(str(DATA / "hf" / "gpt2.json"), batch_size=3).local_batch == 3
    assert load_workload("llama3:8B", seq_len=1024).seq_len == 1024
    assert load_workload("llama3_tiny").name == "llama3-tiny"
    with pytest.raises(ValueError, match="a .py script defining `scenario`"):
        load_workload("nope")


def test_job_configs_and_workloads_exclude_each_other():
    with pytest.raises(ValueError, match="drop the workload"):
        _apply("llama3-8b", "--torchtitan", str(DATA / "torchtitan" / "llama3_8b.toml"))
    with pytest.raises(ValueError, match="give a workload"):
        _apply("--world-size", "8")
    with pytest.raises(ValueError, match="Megatron-LM arguments: tensor parallelism on a "
                                         "transformers gpt2"):
        _apply("--megatron", (DATA / "megatron" / "gpt3_175b_distributed.args").read_text(),
               "--world-size", "8")
    with pytest.raises(ValueError, match="not both"):
        _apply("--torchtitan", "a.toml", "--megatron", "--num-layers 2")


@pytest.mark.slow
def test_simddp_whatif_runs_a_torchtitan_toml_unmodified():
    res = subprocess.run([sys.executable, "-m", "simddp", "whatif", "--torchtitan",
                          str(DATA / "torchtitan" / "debug_model.toml"), "--world-size", "8",
                          "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "llama3-debugmodel" in res.stdout and "\n    8 " in res.stdout
    assert "parallel fsdp:8 on 8 ranks" in res.stderr


@pytest.mark.slow
def test_a_resolved_model_is_resized_for_the_pipelines_microbatches():
    """whatif rebuilds a resolved model at a replica's batch per step (4 sequences = 2
    microbatches of 2), as it does for zoo names."""
    said: list[str] = []
    sc = resolve_model("llama3-tiny", seq_len=32, local_batch=2)
    res = whatif(sc, parallel="pp:2,fsdp", world_size=[4], microbatches=[2], batch_size=4,
                 status=said.append)
    assert "2 microbatches of 2" in said[0]
    assert [r["world_size"] for r in res] == [4]
