"""Megatron-LM argument lines read into Jobs: two lines from Megatron-LM's examples
(tests/data/megatron, the scripts' commits in each file) and the forms the issue names."""

from __future__ import annotations

from pathlib import Path

import pytest

from simddp.jobs import read_megatron

DATA = Path(__file__).resolve().parent / "data" / "megatron"
LLAMA = (DATA / "llama3_8b_h100_fp8.args").read_text()
GPT = (DATA / "gpt3_175b_distributed.args").read_text()


def test_llama3_8b_example_is_the_zoo_llama_with_megatrons_padded_vocabulary():
    job = read_megatron(LLAMA, world_size=8)
    # NullTokenizer adds an end-of-document token: 128,257 padded to a multiple of 128
    assert job.model.recipe.args.vocab_size == 128384
    assert job.model.num_params == 8_031_309_824
    assert (job.seq_len, job.local_batch, job.global_batch) == (8192, 1, 128)
    assert job.parallel == "distributed-optimizer:8"
    assert job.knobs["grad_accum"] == 16  # 128 / (1 × 8)
    assert (job.knobs["param_dtype"], job.knobs["reduce_dtype"]) == ("bf16", "bf16")
    assert job.knobs["float8"] and job.knobs["activation_checkpointing"] == "none"
    assert job.knobs["sequence_parallel"] is False  # TP 1
    text = "\n".join(job.not_modelled)
    for listed in ("fp8-format=hybrid", "clip-grad=1", "cross-entropy-loss-fusion",
                   "sequence-parallel with TP 1", "--lr,", "--save,"):
        assert listed in text, listed
    assert "unknown" not in text


def test_gpt3_example_is_megatrons_gpt_with_tp_refused_for_transformers_modules():
    job = read_megatron(GPT, world_size=8)
    assert job.model_name == "gpt2-custom" and job.model.recipe.kind == "hf"
    assert job.parallel == "pp:2,dp:2,tp:2"
    assert job.knobs["pp_schedule"] == "1F1B" and job.knobs["microbatches"] == 32
    assert job.knobs["param_dtype"] == "fp16"
    text = "\n".join(job.not_modelled)
    assert "GPT2BPETokenizer assumed" in text and "loss scaling" in text
    assert "tensor-model-parallel-size=2: tensor parallelism on a transformers gpt2" in text
    assert "vocab=50432" in job.model_spec  # 50,257 padded to a multiple of 128 × TP 2


def test_interleaved_pipeline_and_selective_recompute():
    line = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
            "--num-layers-per-virtual-pipeline-stage 3 --micro-batch-size 1 "
            "--global-batch-size 1536 --sequence-parallel --recompute-granularity selective "
            "--use-distributed-optimizer --num-layers 96 --hidden-size 12288 "
            "--num-attention-heads 96 --seq-length 2048 --swiglu --normalization RMSNorm "
            "--position-embedding-type rope --disable-bias-linear --vocab-size 32000 --bf16 "
            "--overlap-grad-reduce --attention-dropout 0 --hidden-dropout 0")
    job = read_megatron(line, world_size=1024)
    assert job.parallel == "pp:8,distributed-optimizer:16,tp:8"
    assert job.knobs["pp_schedule"] == "Interleaved1F1B" and job.knobs["stages_per_rank"] == 4
    assert job.knobs["microbatches"] == 96 and job.knobs["grad_accum"] == 1
    assert job.knobs["activation_checkpointing"] == "selective-op"
    assert job.knobs["sequence_parallel"] is True
    assert job.model.recipe.args.ffn_hidden_dim == 32768  # Megatron's SwiGLU default
    assert job.model.recipe.args.tie_embeddings  # Megatron ties unless told not to
    assert any("core attention only" in line for line in job.not_modelled)
    assert read_megatron(line).parallel == "pp:8,distributed-optimizer,tp:8"


def test_full_recompute_plain_dp_and_unknown_arguments():
    job = read_megatron("pretrain_gpt.py --num-layers 4 --hidden-size 64 "
                        "--num-attention-heads 4 --seq-length 128 --vocab-size 1000 "
                        "--recompute-granularity full --recompute-method block "
                        "--recompute-num-layers 2 --my-new-flag 3", world_size=4)
    assert job.parallel == "dp:4" and job.knobs["activation_checkpointing"] == "full"
    text = "\n".join(job.not_modelled)
    assert "my-new-flag=3: unknown" in text and "first 2 blocks" in text
    assert "not arguments (ignored): pretrain_gpt.py" in text


def test_bad_lines_get_errors_that_say_what_to_give():
    with pytest.raises(ValueError, match="--hidden-size is missing"):
        read_megatron("--num-layers 2")
    base = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    with pytest.raises(ValueError, match="give --vocab-size"):
        read_megatron(base + "--tokenizer-type HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="not a multiple of TP"):
        read_megatron(base + "--vocab-size 100 --tensor-model-parallel-size 8", world_size=12)
    with pytest.raises(ValueError, match="expected a int"):
        read_megatron(base + "--vocab-size many")
