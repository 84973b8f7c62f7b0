"""Models from the user's world: one resolver, :func:`resolve_model`, from what a user has to a
workload the capture trains (a :class:`ModelScenario`, a ``fakepg.zoo.Scenario``).

What it accepts (see docs/configurations.md):

* a zoo name, hyphenated or with underscores (``llama3-8b``, ``llama3_8b``, ``bert-base``,
  ``bert_base``, ``resnet50``);
* a Hugging Face ``config.json`` (a path to the file, or to a folder holding one): the model
  ``transformers`` builds from it (``AutoModelForCausalLM.from_config``), on the meta device
  for a capture; Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX families are tested;
* a torchtitan flavor: ``llama3:8B``, ``llama3:70B``, ``llama3:405B``, ``llama3:debugmodel``
  (or ``debugmodel``) — torchtitan's ``llama3`` ``TransformerModelArgs``
  (:data:`TORCHTITAN_LLAMA3`), built as the zoo's Llama, which has the same modules;
* a shape: ``llama:dim=8192,layers=80,heads=64,kv-heads=8,ffn=28672,vocab=128256`` (and
  ``norm-eps``, ``rope-theta``, ``multiple-of``, ``ffn-multiplier``, ``tie``; the fields of
  torchtitan's ``ModelArgs``), the zoo's Llama of that shape.

``seq_len`` and ``local_batch`` (sequences per rank per microbatch) apply to every source, and
the result resizes itself: ``sc.with_(batch_size=8, seq_len=4096)`` rebuilds it (what the
what-if engine does for a pipeline's microbatches).

A Hugging Face model trains through the same capture as the zoo's Llama: FSDP2 wraps each
element of its first ``nn.ModuleList`` (``model.model.layers``, GPT-2's ``transformer.h``).
Tensor parallelism is applied by :mod:`simddp.cosim.tensor_parallel`, whose plan names the
zoo's (torchtitan's) modules (``attention.wq`` …), not transformers' (``self_attn.q_proj`` …);
so ``build="zoo"`` builds a Llama- or Mistral-family config as the zoo's Llama of the same
shape (same parameters, same matmuls; :func:`llama_args_from_hf`), and other families are
refused with TP (:func:`tp_refusal`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from fakepg import zoo
from fakepg.zoo import data as zoo_data
from fakepg.zoo import llama as zoo_llama
from fakepg.zoo.scenario import Scenario, SeededBatches
from fakepg.zoo.workloads import llama_workload

__all__ = ["ModelScenario", "ModelRecipe", "resolve_model", "canonical_name", "zoo_key",
           "parse_shape", "llama_args_from_hf", "tp_refusal", "TORCHTITAN_LLAMA3",
           "SHAPE_FIELDS", "GPT2_SHAPE_FIELDS", "parse_gpt2_shape", "HF_TO_TORCHTITAN_TP"]

# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py at 238fa9953e4a, the
# TransformerModelArgs fields; defaults: n_kv_heads = n_heads, vocab_size 128256,
# multiple_of 256, norm_eps 1e-5)
TORCHTITAN_LLAMA3: dict[str, dict[str, Any]] = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000.0),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
               multiple_of=1024, rope_theta=500000.0),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                multiple_of=4096, rope_theta=500000.0),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                 multiple_of=4096, rope_theta=500000.0),
}
# the zoo's names for the flavors it has (the same arguments: the same model)
_ZOO_FLAVOR = {"8B": "llama3-8b", "70B": "llama3-70b", "405B": "llama3-405b"}

# shape field → (LlamaArgs field, type)
SHAPE_FIELDS: dict[str, tuple[str, type]] = {
    "dim": ("dim", int), "layers": ("n_layers", int), "heads": ("n_heads", int),
    "kv-heads": ("n_kv_heads", int), "ffn": ("ffn_dim", int), "vocab": ("vocab_size", int),
    "norm-eps": ("norm_eps", float), "rope-theta": ("rope_theta", float),
    "multiple-of": ("multiple_of", int), "ffn-multiplier": ("ffn_dim_multiplier", float),
    "tie": ("tie_embeddings", bool),
}

# where torchtitan's Llama TP plan (simddp.cosim.tensor_parallel) finds its modules in a
# transformers Llama/Mistral/Qwen2 (``model.model``): the plan is written for the left names
HF_TO_TORCHTITAN_TP: dict[str, str] = {
    "embed_tokens": "tok_embeddings", "norm": "norm", "lm_head": "output",
    "layers.*.self_attn.q_proj": "layers.*.attention.wq",
    "layers.*.self_attn.k_proj": "layers.*.attention.wk",
    "layers.*.self_attn.v_proj": "layers.*.attention.wv",
    "layers.*.self_attn.o_proj": "layers.*.attention.wo",
    "layers.*.mlp.gate_proj": "layers.*.feed_forward.w1",
    "layers.*.mlp.down_proj": "layers.*.feed_forward.w2",
    "layers.*.mlp.up_proj": "layers.*.feed_forward.w3",
    "layers.*.input_layernorm": "layers.*.attention_norm",
    "layers.*.post_attention_layernorm": "layers.*.ffn_norm",
}
_LLAMA_LIKE = ("llama", "mistral")


def canonical_name(text: str) -> str:
    """The one spelling of a workload name: lowercase, hyphenated (``llama3_8b`` →
    ``llama3-8b``, ``bert_base`` → ``bert-base``)."""
    return text.strip().lower().replace("_", "-")


def zoo_key(text: str) -> str | None:
    """The zoo's key for ``text`` in either spelling (``bert-base`` → ``bert_base``), or None."""
    names = {**zoo.SCENARIOS, **zoo.WORKLOADS}
    if text in names:
        return text
    by_canonical = {canonical_name(k): k for k in names}
    return by_canonical.get(canonical_name(text))


# -- the workload -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelRecipe:
    """How to build a resolved model at any size: ``kind`` "zoo" (``spec``: the zoo key),
    "llama" (``args``: the zoo's Llama of that shape) or "hf" (``spec``: the config, JSON)."""

    kind: str
    name: str
    spec: str = ""
    args: Any = None
    source: str = ""

    def build(self, *, seq_len: int | None, local_batch: int | None,
              iterations: int | None = None, seed: int = 0) -> ModelScenario:
        """The workload at ``seq_len`` and ``local_batch`` (None: the source's default;
        ``iterations`` None: the zoo factory's default, else 3)."""
        if self.kind == "llama":
            seq = seq_len or 8192
            args = self.args
            if seq > args.max_seq_len:  # rotary tables for the sequence asked for
                args = dataclasses.replace(args, max_seq_len=seq)
            sc = llama_workload(args, self.name, batch_size=local_batch or 1, seq_len=seq,
                                iterations=iterations or 3, seed=seed,
                                what=f"{self.name}: Llama-3-style")
            return _wrap(sc, self, seq, local_batch or 1, args.num_params())
        if self.kind == "hf":
            return _hf_scenario(self, seq_len, local_batch, iterations or 3, seed)
        factory = zoo.SCENARIOS.get(self.spec) or zoo.WORKLOADS[self.spec]
        accepted = inspect.signature(factory).parameters
        kw: dict[str, Any] = {"seed": seed}
        if iterations is not None:
            kw["iterations"] = iterations
        if local_batch is not None:
            kw["batch_size"] = local_batch
        if seq_len is not None:
            if "seq_len" not in accepted:
                raise ValueError(f"workload {self.spec!r} takes no sequence length (it is not "
                                 f"a language model): leave seq_len out")
            kw["seq_len"] = seq_len
        sc = factory(**{k: v for k, v in kw.items() if k in accepted})
        kwargs = sc.batches.kwargs if isinstance(sc.batches, SeededBatches) else {}
        return _wrap(sc, self, kwargs.get("seq_len"), kwargs.get("batch_size"), None)


@dataclass(frozen=True)
class ModelScenario(Scenario):
    """A ``fakepg.zoo.Scenario`` that knows how it was resolved and rebuilds itself at another
    size: ``with_(batch_size=...)`` (or ``local_batch``) and ``with_(seq_len=...)``.

    ``seq_len``: tokens per sequence (None: not a language model); ``local_batch``: sequences
    per rank per microbatch; ``source``: what it was resolved from; ``num_params``: its
    parameters (closed form where known, else None)."""

    recipe: ModelRecipe | None = None
    seq_len: int | None = None
    local_batch: int | None = None
    source: str = ""
    num_params: int | None = None

    def with_(self, **changes: Any) -> Scenario:
        size: dict[str, Any] = {}
        for k in ("batch_size", "local_batch"):
            if k in changes:
                size["local_batch"] = changes.pop(k)
        if "seq_len" in changes:
            size["seq_len"] = changes.pop("seq_len")
        out: Scenario = self
        if size and self.recipe is not None:
            out = self.recipe.build(seq_len=size.get("seq_len", self.seq_len),
                                    local_batch=size.get("local_batch", self.local_batch),
                                    iterations=changes.pop("iterations", self.iterations),
                                    seed=changes.pop("seed", self.seed))
        return Scenario.with_(out, **changes) if changes else out


def _wrap(sc: Scenario, recipe: ModelRecipe, seq_len: int | None, local_batch: int | None,
          num_params: int | None) -> ModelScenario:
    fields = {f.name: getattr(sc, f.name) for f in dataclasses.fields(Scenario)}
    return ModelScenario(**fields, recipe=recipe, seq_len=seq_len, local_batch=local_batch,
                         source=recipe.source, num_params=num_params)


def resolve_model(text: str, *, seq_len: int | None = None, local_batch: int | None = None,
                  iterations: int | None = None, seed: int = 0, build: str = "transformers"
                  ) -> ModelScenario:
    """The workload ``text`` names (see the module docstring), at ``seq_len`` tokens and
    ``local_batch`` sequences per rank per microbatch (None: the source's default — the zoo
    factory's; 8192 tokens, capped at a Hugging Face model's ``max_position_embeddings``,
    and 1 sequence otherwise). ``build``: "transformers" (a Hugging Face config as
    transformers builds it) or "zoo" (a Llama/Mistral config as the zoo's Llama, whose modules
    the TP plan names)."""
    for name, v in (("seq_len", seq_len), ("local_batch", local_batch)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if build not in ("transformers", "zoo"):
        raise ValueError(f"build must be 'transformers' or 'zoo', got {build!r}")
    text = os.fspath(text).strip()
    recipe = _recipe(text, build)
    return recipe.build(seq_len=seq_len, local_batch=local_batch, iterations=iterations,
                        seed=seed)


def _recipe(text: str, build: str) -> ModelRecipe:
    if text.endswith(".json") or os.path.isdir(text) or os.path.isfile(text):
        return _hf_recipe(text, build)
    family, colon, rest = text.partition(":")
    if colon and "=" in rest:
        if canonical_name(family) == "gpt2":
            return ModelRecipe("hf", "gpt2-custom", spec=json.dumps(parse_gpt2_shape(text),
                                                                    sort_keys=True),
                               source=f"shape {text} (transformers gpt2)")
        return ModelRecipe("llama", canonical_name(family) + "-custom",
                           args=parse_shape(text), source=f"shape {text}")
    if colon and canonical_name(family) in ("llama3", "torchtitan"):
        return _flavor_recipe(rest, text)
    if not colon and text in TORCHTITAN_LLAMA3 and zoo_key(text) is None:
        return _flavor_recipe(text, text)
    key = zoo_key(text)
    if key is not None:
        name = canonical_name(key)
        if name in ("llama3-8b", "llama3-70b", "llama3-405b", "llama3-tiny"):
            return ModelRecipe("llama", name, args=zoo_llama.LLAMA3_CONFIGS[name.split("-")[1]],
                               source=f"zoo {name}")
        return ModelRecipe("zoo", name, spec=key, source=f"zoo {name}")
    known = sorted(canonical_name(k) for k in {**zoo.SCENARIOS, **zoo.WORKLOADS})
    raise ValueError(
        f"unknown model {text!r}: give a zoo name ({', '.join(known)}), a Hugging Face "
        f"config.json path, a torchtitan flavor (llama3:{', llama3:'.join(TORCHTITAN_LLAMA3)}) "
        f"a shape (llama:dim=4096,layers=32,heads=32,kv-heads=8,ffn=14336,vocab=128256 or "
        f"gpt2:dim=768,layers=12,heads=12), or to simddp whatif a .py script defining "
        f"`scenario`")


def _flavor_recipe(flavor: str, text: str) -> ModelRecipe:
    match = {k.lower(): k for k in TORCHTITAN_LLAMA3}.get(flavor.strip().lower())
    if match is None:
        raise ValueError(f"unknown torchtitan llama3 flavor {flavor!r} in {text!r}: give one "
                         f"of {', '.join(TORCHTITAN_LLAMA3)}")
    args = zoo_llama.LlamaArgs(**TORCHTITAN_LLAMA3[match])
    name = _ZOO_FLAVOR.get(match, f"llama3-{match.lower()}")
    return ModelRecipe("llama", name, args=args, source=f"torchtitan llama3 flavor {match}")


def parse_shape(text: str) -> zoo_llama.LlamaArgs:
    """``llama:dim=...,layers=...,...`` → the zoo's ``LlamaArgs`` (fields: :data:`SHAPE_FIELDS`;
    ``dim``, ``layers``, ``heads`` needed, ``vocab`` defaults to 128256, ``kv-heads`` to
    ``heads``, ``ffn`` to Llama's rounding of 8·dim/3 by ``multiple-of`` and
    ``ffn-multiplier``)."""
    family = text.partition(":")[0]
    if canonical_name(family) != "llama":
        raise ValueError(f"shape {text!r}: the family must be 'llama' (a Llama-3-style decoder, "
                         f"torchtitan's ModelArgs), got {family!r}")
    kw = _fields(text, SHAPE_FIELDS)
    missing = [k for k, (f, _) in SHAPE_FIELDS.items() if k in ("dim", "layers", "heads")
               and f not in kw]
    if missing:
        raise ValueError(f"shape {text!r} lacks {', '.join(missing)} (e.g. llama:dim=4096,"
                         f"layers=32,heads=32,kv-heads=8,ffn=14336,vocab=128256)")
    return zoo_llama.LlamaArgs(**kw)


# shape field → (GPT-2 config field, type)
GPT2_SHAPE_FIELDS: dict[str, tuple[str, type]] = {
    "dim": ("n_embd", int), "layers": ("n_layer", int), "heads": ("n_head", int),
    "ffn": ("n_inner", int), "vocab": ("vocab_size", int), "positions": ("n_positions", int),
    "norm-eps": ("layer_norm_epsilon", float), "dropout": ("resid_pdrop", float),
    "attention-dropout": ("attn_pdrop", float), "tie": ("tie_word_embeddings", bool),
}


def _fields(text: str, table: Mapping[str, tuple[str, type]]) -> dict[str, Any]:
    _, _, rest = text.partition(":")
    kw: dict[str, Any] = {}
    for part in rest.split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        key = canonical_name(key)
        if not eq or key not in table:
            raise ValueError(f"shape {text!r}: {part.strip()!r} is not FIELD=VALUE with a field "
                             f"of {', '.join(table)}")
        field, kind = table[key]
        try:
            if kind is bool:
                v: Any = {"true": True, "1": True, "yes": True, "false": False, "0": False,
                          "no": False}[value.strip().lower()]
            elif kind is int:
                v = int(value)
            else:
                v = float(value)
        except (KeyError, ValueError):
            raise ValueError(f"shape {text!r}: {key}={value!r} is not a "
                             f"{kind.__name__}") from None
        kw[field] = v
    return kw


def parse_gpt2_shape(text: str) -> dict[str, Any]:
    """``gpt2:dim=...,layers=...,heads=...`` (fields: :data:`GPT2_SHAPE_FIELDS`) → a
    transformers GPT-2 config (a dict): Megatron's default GPT (LayerNorm, GeLU MLP of ``ffn``,
    default 4·dim, biases, learned positions, embeddings tied unless ``tie=false``)."""
    kw = _fields(text, GPT2_SHAPE_FIELDS)
    missing = [k for k in ("dim", "layers", "heads") if GPT2_SHAPE_FIELDS[k][0] not in kw]
    if missing:
        raise ValueError(f"shape {text!r} lacks {', '.join(missing)} (e.g. gpt2:dim=768,"
                         f"layers=12,heads=12,vocab=50257)")
    cfg: dict[str, Any] = {"model_type": "gpt2", "activation_function": "gelu",
                           "vocab_size": 50257, "n_positions": 1024, "resid_pdrop": 0.1,
                           "attn_pdrop": 0.1}
    cfg.update(kw)
    cfg["embd_pdrop"] = cfg["resid_pdrop"]
    return cfg


# -- Hugging Face configs -----------------------------------------------------------------------

def _hf_path(text: str) -> str:
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Hugging Face config {path!r} does not exist (give the path "
                                f"of a model's config.json, or of the folder holding it)")
    return path


def _hf_recipe(text: str, build: str) -> ModelRecipe:
    path = _hf_path(text)
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ValueError(f"{path}: a Hugging Face config.json has a 'model_type' (e.g. "
                         f"\"llama\"); this file has none")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = canonical_name(os.path.basename(os.path.dirname(os.path.abspath(path)))
                          if stem == "config" else stem)
    source = f"Hugging Face config {path} ({cfg['model_type']})"
    if build == "zoo":
        args = llama_args_from_hf(cfg)
        if isinstance(args, str):
            raise ValueError(f"{path}: cannot be built as the zoo's Llama: {args}")
        return ModelRecipe("llama", name, args=args, source=source + ", as the zoo's Llama")
    try:
        import transformers  # noqa: F401 - the model is built by transformers, later
    except ImportError as e:
        raise RuntimeError(f"{path}: a Hugging Face config is built by transformers ({e}): "
                           f"pip install 'fakepg-simddp[hf]'") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{path}: model_type {cfg['model_type']!r} is not a causal language "
                         f"model transformers' AutoModelForCausalLM builds (e.g. llama, "
                         f"mistral, qwen2, gpt2, gpt_neox)")
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(cfg["model_type"])
    for key in ("vocab_size", "max_position_embeddings", "n_positions"):
        if key not in cfg and getattr(defaults, key, None) is not None:
            cfg[key] = getattr(defaults, key)  # transformers' default for the family
    return ModelRecipe("hf", name, spec=json.dumps(cfg, sort_keys=True), source=source)


def llama_args_from_hf(cfg: Mapping[str, Any]) -> zoo_llama.LlamaArgs | str:
    """The zoo's ``LlamaArgs`` with the same modules and shapes as a Llama- or Mistral-family
    Hugging Face config, or why there are none (a string)."""
    mt = cfg.get("model_type")
    if mt not in _LLAMA_LIKE:
        return (f"model_type {mt!r} is not a Llama-family decoder ({', '.join(_LLAMA_LIKE)}: "
                f"RMSNorm, rotary attention without biases, SwiGLU)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        return "it has attention or MLP biases, the zoo's Llama none"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.get('hidden_act')!r} is not SwiGLU's silu"
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, d // h):
        return f"head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads"
    return zoo_llama.LlamaArgs(
        dim=d, n_layers=cfg["num_hidden_layers"], n_heads=h,
        n_kv_heads=cfg.get("num_key_value_heads"), vocab_size=cfg["vocab_size"],
        ffn_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def tp_refusal(model: Any) -> str | None:
    """Why tensor parallelism cannot be captured for ``model`` (a :class:`ModelScenario`),
    or None."""
    recipe = getattr(model, "recipe", None)
    if recipe is None or recipe.kind != "hf":
        return None
    cfg = json.loads(recipe.spec)
    why = llama_args_from_hf(cfg)
    hint = ("resolve it with build='zoo' (the CLI does so for tp layouts): the zoo's Llama of "
            "the same shape" if not isinstance(why, str) else f"it cannot be rebuilt as the "
            f"zoo's Llama ({why})")
    return (f"tensor parallelism on a transformers {cfg['model_type']} model: torchtitan's TP "
            f"plan (simddp.cosim.tensor_parallel) names the zoo's Llama modules "
            f"(attention.wq, feed_forward.w1, ...; HF_TO_TORCHTITAN_TP maps transformers' names "
            f"onto them) and calls attention with positional (x, cos, sin, mask), transformers' "
            f"layers with keywords; {hint}")


_ATTENTION = "simddp_causal_sdpa"


def _causal_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention as one ``F.scaled_dot_product_attention`` call with no mask, as
    torchtitan trains (and the zoo's Llama): grouped key/value heads repeated first, as the
    zoo's Llama does (SDPA's ``enable_gqa`` and a mask would both send the meta device's
    capture to the unfused decomposition, which keeps the s × s scores). Registered under a
    name transformers has no mask builder for, so it builds none: its mask and
    packed-sequence checks read tensor values, which the meta device does not have.
    ``query``/``key``/``value``: (batch, heads, seq, head_dim); returns transformers'
    (batch, seq, heads, head_dim) and no weights."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=query.shape[2] > 1)
    return out.transpose(1, 2).contiguous(), None


def _hf_model(config_json: str) -> torch.nn.Module:
    """The causal LM transformers builds from a config (float32 parameters, as the zoo's
    models: mixed precision is the data-parallel layer's policy)."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    AttentionInterface.register(_ATTENTION, _causal_sdpa)
    cfg = dict(json.loads(config_json))
    model_type = cfg.pop("model_type")
    for k in ("torch_dtype", "dtype", "transformers_version", "architectures"):
        cfg.pop(k, None)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # e.g. GPT-2's bos/eos ids checked against a vocabulary
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        return AutoModelForCausalLM.from_config(config, attn_implementation=_ATTENTION,
                                                dtype=torch.float32)
    finally:
        logging.set_verbosity(verbosity)


def hf_forward(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """A transformers causal LM's logits for the batch's tokens (no KV cache in training)."""
    return model(input_ids=batch[0], use_cache=False).logits


def _hf_scenario(recipe: ModelRecipe, seq_len: int | None, local_batch: int | None,
                 iterations: int, seed: int) -> ModelScenario:
    cfg = json.loads(recipe.spec)
    limit = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    seq = seq_len or min(limit or 8192, 8192)
    if limit and seq > limit and cfg["model_type"] in ("gpt2",):
        raise ValueError(f"{recipe.name}: seq_len {seq} exceeds the {limit} learned positions "
                         f"(n_positions) of a {cfg['model_type']} model")
    batch = local_batch or 1
    return ModelScenario(
        name=recipe.name,
        model=functools.partial(_hf_model, recipe.spec),
        batches=SeededBatches(zoo_data.token_sequences, seed, dict(
            iterations=iterations, batch_size=batch, seq_len=seq, vocab=cfg["vocab_size"])),
        loss=zoo_llama.lm_loss, forward=hf_forward,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1),
        iterations=iterations, seed=seed,
        description=f"{recipe.name} (transformers {cfg['model_type']}), {batch} x {seq} "
                    f"tokens per rank, AdamW",
        features=("benchmark", "transformer", "bucketing", "real-size", "transformers"),
        reference_ok=False, recipe=recipe, seq_len=seq, local_batch=batch,
        source=recipe.source)
