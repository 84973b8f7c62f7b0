"""torchtitan's own job TOMLs (tests/data/torchtitan, unmodified; SOURCES.md gives the
commits) read into Jobs: layout, batch, knobs, and every key accounted for."""

from __future__ import annotations

from pathlib import Path

import pytest

from simddp.jobs import Job, read_torchtitan

DATA = Path(__file__).resolve().parent / "data" / "torchtitan"
BOTH_FORMS = ["", "_2025-04"]


def _read(name: str, world: int | None = None) -> Job:
    return read_torchtitan(DATA / f"{name}.toml", world)


@pytest.mark.parametrize("form", BOTH_FORMS)
def test_llama3_8b_is_fsdp_over_the_world_with_selective_op_ac(form):
    job = _read("llama3_8b" + form, 64)
    assert (job.model_name, job.seq_len, job.local_batch, job.global_batch) == \
        ("llama3-8b", 8192, 1, 64)
    assert job.parallel == "fsdp:64" and job.world_size == 64
    assert job.knobs["activation_checkpointing"] == "selective-op"
    assert (job.knobs["param_dtype"], job.knobs["reduce_dtype"]) == ("bf16", "fp32")
    assert job.knobs["grad_accum"] == 1 and job.knobs["compile"] is False
    assert job.model.num_params == 8_030_261_248


@pytest.mark.parametrize("form", BOTH_FORMS)
def test_llama3_70b_is_fsdp_by_tp8_with_full_ac(form):
    job = _read("llama3_70b" + form, 64)
    assert job.parallel == "fsdp:8,tp:8" and job.local_batch == 8 and job.global_batch == 64
    assert job.knobs["activation_checkpointing"] == "full"
    assert job.knobs["sequence_parallel"] is True and job.knobs["async_tp"] is False
    assert any("loss parallel" in line for line in job.not_modelled)


@pytest.mark.parametrize("form", BOTH_FORMS)
def test_llama3_405b_asks_for_compile_float8_and_async_tp(form):
    job = _read("llama3_405b" + form, 128)
    assert job.parallel == "fsdp:16,tp:8" and job.local_batch == 2 and job.global_batch == 32
    assert job.knobs["compile"] and job.knobs["float8"] and job.knobs["async_tp"]
    float8 = [line for line in job.not_modelled if "float8" in line and "Float8" in line]
    assert len(float8) == 3  # enable_fsdp_float8_all_gather, precompute..., filter_fqns
    assert job.whatif_args().endswith("--compile --float8 --async-tp")


@pytest.mark.parametrize("form", BOTH_FORMS)
def test_debug_model_leaves_the_shard_degree_to_the_world_size(form):
    job = _read("debug_model" + form)
    assert job.parallel == "fsdp" and job.world_size is None and job.global_batch is None
    assert job.knobs["activation_checkpointing"] == "selective-layer:2"
    assert job.model_name == "llama3-debugmodel"
    assert _read("debug_model" + form, 8).parallel == "fsdp:8"


def test_older_and_newer_forms_read_alike():
    for name in ("llama3_8b", "llama3_70b", "llama3_405b", "debug_model"):
        new, old = _read(name, 128), _read(name + "_2025-04", 128)
        assert (new.parallel, new.local_batch, new.global_batch, dict(new.knobs)) == \
            (old.parallel, old.local_batch, old.global_batch, dict(old.knobs)), name


def test_every_key_is_read_or_listed():
    """Nothing is dropped in silence: each key of the file is read into the job or named in
    not_modelled (the 'no effect' line included)."""
    import tomllib

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    read_into_job = {"model.name", "model.flavor", "model.converters", "training.seq_len",
                     "training.local_batch_size", "training.batch_size", "training.compile",
                     "compile.enable", "parallelism.data_parallel_replicate_degree",
                     "parallelism.data_parallel_shard_degree",
                     "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                     "parallelism.context_parallel_degree", "parallelism.pipeline_parallel_schedule",
                     "parallelism.enable_async_tensor_parallel",
                     "parallelism.fsdp_reshard_after_forward", "activation_checkpoint.mode",
                     "activation_checkpoint.selective_ac_option", "checkpoint.enable",
                     "checkpoint.enable_checkpoint", "validation.enable",
                     "profiling.enable_profiling", "profiling.enable_memory_snapshot",
                     "optimizer.name"}
    for path in sorted(DATA.glob("*.toml")):
        job = read_torchtitan(path, 128)
        text = "\n".join(job.not_modelled)
        for key in flat(tomllib.loads(path.read_text())):
            assert key in read_into_job or key in text or key.startswith(
                ("float8.", "quantize.")), f"{path.name}: {key} neither read nor listed"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_pipeline_job_has_microbatches_stages_and_accumulation(tmp_path):
    p = _write(tmp_path, """
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 16
global_batch_size = 256
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 2
[activation_checkpoint]
mode = "none"
""")
    job = read_torchtitan(p, 128)
    assert job.parallel == "pp:4,fsdp:4,tp:8"
    assert job.local_batch == 2 and job.knobs["microbatches"] == 8
    assert job.knobs["pp_schedule"] == "Interleaved1F1B" and job.knobs["stages_per_rank"] == 2
    assert job.knobs["grad_accum"] == 4  # 256 / (16 × 4 data-parallel ranks)
    assert job.knobs["reshard_after_forward"] is False  # torchtitan's "default" under PP
    assert "--microbatches 8" in job.whatif_args() and "--global-batch 256" in job.whatif_args()


def test_hsdp_cp_and_unknown_keys(tmp_path):
    p = _write(tmp_path, """
[model]
name = "llama3"
flavor = "8B"
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 4
context_parallel_degree = 2
[experimental]
custom_args_module = "mine"
""")
    job = read_torchtitan(p)
    assert job.parallel == "hsdp:4,cp:2" and job.world_size == 16
    assert any(line.startswith("experimental.custom_args_module=mine: unknown")
               for line in job.not_modelled)
    with pytest.raises(ValueError, match="not world size 8"):
        read_torchtitan(p, 8)


def test_bad_configs_get_errors_that_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="needs the world size"):
        read_torchtitan(_write(tmp_path, "[parallelism]\ndata_parallel_replicate_degree = 2\n"))
    with pytest.raises(ValueError, match="not a multiple"):
        read_torchtitan(_write(tmp_path, "[parallelism]\ntensor_parallel_degree = 8\n"), 12)
    with pytest.raises(ValueError, match="llama3"):
        read_torchtitan(_write(tmp_path, '[model]\nname = "deepseek_v3"\n'))
    with pytest.raises(ValueError, match="not TOML"):
        read_torchtitan(_write(tmp_path, "[model\n"))
    with pytest.raises(FileNotFoundError):
        read_torchtitan(tmp_path / "none.toml")
