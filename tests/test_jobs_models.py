"""Models from the user's world (simddp.jobs.models.resolve_model): zoo names in either
spelling, Hugging Face config.json files built by transformers on the meta device (their
parameters against each family's closed form and the published count), torchtitan's llama3
flavors and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fakepg.zoo import llama
from simddp.jobs.models import (HF_TO_TORCHTITAN_TP, ModelRecipe, ModelScenario,
                                canonical_name, llama_args_from_hf, resolve_model,
                                tp_refusal, zoo_key)

HF = Path(__file__).resolve().parent / "data" / "hf"


def _params(sc) -> int:
    with torch.device("meta"):
        model = sc.build_model()
    return sum(p.numel() for p in model.parameters())


def _llama_family(c: dict, qkv_bias: bool = False) -> int:
    d, L, V, f = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (d // c["num_attention_heads"])
    block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d + ((d + 2 * kv) if qkv_bias else 0)
    return L * block + d + V * d * (1 if c.get("tie_word_embeddings") else 2)


def _gpt2(c: dict) -> int:
    d, L, V, P = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
    f = c.get("n_inner") or 4 * d
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    return V * d + P * d + L * block + 2 * d  # the head is tied to the token embedding


def _gpt_neox(c: dict) -> int:
    d, L, V, f = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return 2 * V * d + L * block + 2 * d


# file, closed form, published parameter count (the model cards)
FAMILIES = [("llama3.1-8b.json", _llama_family, 8_030_261_248),
            ("mistral-7b.json", _llama_family, 7_241_732_096),
            ("qwen2-7b.json", lambda c: _llama_family(c, qkv_bias=True), 7_615_616_512),
            ("gpt2.json", _gpt2, 124_439_808),
            ("pythia-160m.json", _gpt_neox, 162_322_944)]


@pytest.mark.parametrize("name,formula,published", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_hf_config_builds_the_published_model_on_meta(name, formula, published):
    cfg = json.loads((HF / name).read_text())
    sc = resolve_model(str(HF / name), seq_len=128, local_batch=2)
    assert isinstance(sc, ModelScenario) and sc.recipe.kind == "hf"
    assert sc.name == name.removesuffix(".json")
    assert (sc.seq_len, sc.local_batch) == (128, 2)
    tokens, targets = sc.inputs(0, 1)[0]
    assert tokens.shape == targets.shape == (2, 128)
    assert _params(sc) == formula(cfg) == published


def test_hf_model_trains_on_meta_with_causal_fused_attention():
    """A step on the meta device (where transformers' mask builders, which read tensor
    values, cannot run): logits of the right shape, gradients for every parameter."""
    cfg = dict(json.loads((HF / "qwen2-7b.json").read_text()), num_hidden_layers=2,
               hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300)
    recipe = ModelRecipe("hf", "qwen2-tiny", spec=json.dumps(cfg, sort_keys=True))
    sc = recipe.build(seq_len=16, local_batch=3)
    with torch.device("meta"):
        model = sc.build_model()
    batch = sc.inputs(0, 1, device="meta")[0]
    loss = sc.step(model, batch)
    loss.backward()
    assert sc.forward(model, batch).shape == (3, 16, 300)
    assert all(p.grad is not None for p in model.parameters())


def test_hf_config_in_a_folder_is_named_after_the_folder(tmp_path):
    folder = tmp_path / "My_Model"
    folder.mkdir()
    (folder / "config.json").write_text((HF / "gpt2.json").read_text())
    assert resolve_model(str(folder)).name == "my-model"


def test_hf_config_errors_say_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="model_type"):
        resolve_model(str(bad))
    vit = tmp_path / "vit.json"
    vit.write_text('{"model_type": "vit"}')
    with pytest.raises(ValueError, match="AutoModelForCausalLM"):
        resolve_model(str(vit))
    minimal = tmp_path / "llama.json"
    minimal.write_text('{"model_type": "llama", "num_hidden_layers": 1}')
    assert resolve_model(str(minimal)).inputs(0, 1)[0][0].max() < 32000  # Llama's default
    with pytest.raises(ValueError, match="learned positions"):
        resolve_model(str(HF / "gpt2.json"), seq_len=2048)


@pytest.mark.parametrize("text,key", [("llama3-8b", "llama3-8b"), ("llama3_8b", "llama3-8b"),
                                      ("LLaMA3_70B", "llama3-70b"), ("bert-base", "bert_base"),
                                      ("bert_base", "bert_base"), ("inception-v3", "inception_v3"),
                                      ("resnext101-32x4d", "resnext101_32x4d"), ("nope", None)])
def test_zoo_names_are_found_in_either_spelling(text, key):
    assert zoo_key(text) == key


def test_canonical_names_are_hyphenated_lowercase():
    assert canonical_name("Llama3_8B") == "llama3-8b"
    assert canonical_name("gpt2_medium") == "gpt2-medium"


@pytest.mark.parametrize("flavor,zoo_args", [("8B", llama.LLAMA3_8B), ("70B", llama.LLAMA3_70B),
                                             ("405B", llama.LLAMA3_405B)])
def test_torchtitan_flavors_are_the_zoo_llamas(flavor, zoo_args):
    sc = resolve_model(f"llama3:{flavor}", seq_len=4096, local_batch=2)
    assert sc.name == f"llama3-{flavor.lower()}"
    assert sc.recipe.args == zoo_args
    assert sc.num_params == zoo_args.num_params()
    assert sc.description.startswith("llama3-")


def test_torchtitan_debugmodel_has_torchtitans_shape():
    sc = resolve_model("debugmodel")
    assert sc.recipe.args.vocab_size == 2048 and sc.recipe.args.ffn_hidden_dim == 768
    assert _params(sc) == sc.num_params == 6_163_712
    assert resolve_model("llama3:debugmodel").recipe == sc.recipe
    with pytest.raises(ValueError, match="flavor"):
        resolve_model("llama3:9B")


def test_zoo_llama_resized_past_its_rotary_tables():
    """The zoo's llama3-8b has rotary tables for 8192 positions; 131k tokens rebuild them."""
    sc = resolve_model("llama3_8b", seq_len=131072)
    assert sc.recipe.args.max_seq_len == 8192
    assert sc.seq_len == 131072 and sc.num_params == llama.LLAMA3_8B.num_params()


def test_shape_is_the_zoo_llama_of_that_shape():
    sc = resolve_model("llama:dim=8192,layers=80,heads=64,kv-heads=8,ffn=28672,vocab=128256,"
                       "rope-theta=500000")
    assert sc.num_params == llama.LLAMA3_70B.num_params()
    args = resolve_model("llama:dim=4096,layers=32,heads=32,kv-heads=8,multiple-of=1024,"
                         "ffn-multiplier=1.3,norm-eps=1e-6,tie=true").recipe.args
    assert args.ffn_hidden_dim == 14336 and args.norm_eps == 1e-6 and args.tie_embeddings
    for bad, what in [("llama:dim=64,layers=2", "lacks heads"), ("llama:dim=64,depth=2",
                      "depth"), ("llama:dim=x,layers=2,heads=2", "not a int"),
                      ("mamba:dim=64", "unknown model|family")]:
        with pytest.raises(ValueError, match=what):
            resolve_model(bad)


def test_gpt2_shape_is_transformers_gpt2():
    sc = resolve_model("gpt2:dim=768,layers=12,heads=12,vocab=50257,positions=1024")
    assert _params(sc) == 124_439_808


def test_resolved_model_resizes_itself():
    sc = resolve_model(str(HF / "mistral-7b.json"), seq_len=256, local_batch=1)
    big = sc.with_(batch_size=6, seq_len=512)
    assert isinstance(big, ModelScenario)
    assert (big.local_batch, big.seq_len) == (6, 512)
    assert big.inputs(0, 1)[0][0].shape == (6, 512)
    assert sc.with_(seed=3).seed == 3 and sc.with_(seed=3).local_batch == 1


def test_zoo_workloads_keep_their_defaults_and_refuse_a_seq_len_they_lack():
    sc = resolve_model("resnet50", local_batch=4)
    assert sc.local_batch == 4 and sc.seq_len is None and sc.iterations == 3
    assert resolve_model("mlp").iterations == 5  # the factory's own default
    with pytest.raises(ValueError, match="not a language model"):
        resolve_model("resnet50", seq_len=128)
    with pytest.raises(ValueError, match="positive int"):
        resolve_model("llama3-8b", seq_len=0)


def test_tensor_parallelism_on_hf_models_is_refused_or_rebuilt_as_the_zoo_llama():
    hf = resolve_model(str(HF / "llama3.1-8b.json"))
    assert "attention.wq" in tp_refusal(hf) and "build='zoo'" in tp_refusal(hf)
    zoo = resolve_model(str(HF / "llama3.1-8b.json"), build="zoo")
    assert tp_refusal(zoo) is None and zoo.num_params == 8_030_261_248
    qwen = resolve_model(str(HF / "qwen2-7b.json"))
    assert "model_type 'qwen2'" in tp_refusal(qwen)
    assert isinstance(llama_args_from_hf(json.loads((HF / "gpt2.json").read_text())), str)
    assert HF_TO_TORCHTITAN_TP["layers.*.mlp.gate_proj"] == "layers.*.feed_forward.w1"

