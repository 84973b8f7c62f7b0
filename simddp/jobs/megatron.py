"""A Megatron-LM argument line as a :class:`~simddp.jobs.job.Job`: :func:`read_megatron`.

The model: with ``--swiglu``, ``--normalization RMSNorm``, rotary positions and
``--disable-bias-linear`` (Megatron's Llama recipe) the zoo's Llama of that shape
(``llama:dim=...``); otherwise Megatron's GPT (LayerNorm, GeLU MLP, biases, learned positions),
built as transformers' GPT-2 of that shape (``gpt2:dim=...``), the same architecture.
The vocabulary is padded as Megatron pads it (to a multiple of
``--make-vocab-size-divisible-by`` × TP). Defaults are Megatron's (``megatron/training/
arguments.py``): micro batch 1, global batch = micro batch × data-parallel size, no recompute,
fp32 unless ``--bf16``/``--fp16``.

The layout: ``pp:P,dp:D,cp:C,tp:T`` (D = world / (P·C·T)), ``distributed-optimizer:D`` with
``--use-distributed-optimizer`` (simddp's names for Megatron's data parallelism and its
sharded optimizer, both run as FSDP2 by torch). Every argument is read into the job, listed in
``Job.not_modelled`` with why, or named on its line of arguments that change nothing in a
step's time or memory.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from .job import Job
from .models import resolve_model, tp_refusal

__all__ = ["read_megatron"]

_NO_EFFECT = {
    "use-mcore-models", "train-iters", "train-samples", "lr", "min-lr", "decoupled-lr",
    "decoupled-min-lr", "lr-decay-style", "lr-decay-iters", "lr-decay-samples",
    "lr-warmup-fraction", "lr-warmup-iters", "lr-warmup-samples", "weight-decay", "adam-beta1",
    "adam-beta2", "adam-eps", "init-method-std", "log-interval", "log-throughput",
    "save-interval", "save", "load", "eval-iters", "eval-interval", "tensorboard-dir",
    "data-path", "vocab-file", "merge-file", "split", "tokenizer-type", "tokenizer-model",
    "tiktoken-pattern", "data-cache-path", "mock-data", "num-workers",
    "no-create-attention-mask-in-dataloader", "no-mmap-bin-files", "seed",
    "distributed-timeout-minutes", "exit-duration-in-mins", "ckpt-format", "manual-gc",
    "apply-layernorm-1p", "wandb-project", "wandb-exp-name", "log-timers-to-tensorboard",
    "log-validation-ppl-to-tensorboard", "log-memory-to-tensorboard", "distributed-backend",
}
# flags whose presence changes the step in ways simddp does not model → why
_NOT_MODELLED = {
    "cross-entropy-loss-fusion": "the fused cross-entropy's memory and time",
    "calculate-per-token-loss": "per-token loss normalisation (an extra all-reduce)",
    "empty-unused-memory-level": "emptying the allocator cache between steps",
    "profile": "profiler overhead", "profile-step-start": "profiler window",
    "profile-step-end": "profiler window",
    "fp8-amax-history-len": "FP8 scaling details", "fp8-amax-compute-algo": "FP8 scaling details",
    "fp8-param-gather": "all-gathering parameters in FP8",
    "fp8-recipe": "FP8 scaling recipe",
    "tp-comm-overlap": "Transformer Engine's TP communication overlap (modelled as async_tp)",
    "use-flash-attn": "a flash-attention kernel (attention is one fused SDPA kernel here)",
    "no-gradient-accumulation-fusion": "gradient accumulation without the fused wgrad kernel",
    "no-masked-softmax-fusion": "an unfused masked softmax",
    "no-bias-gelu-fusion": "an unfused bias-GeLU",
    "no-bias-dropout-fusion": "an unfused bias-dropout",
}


def _parse(argline: str) -> tuple[dict[str, Any], list[str]]:
    """``--name value`` / ``--name=value`` / ``--flag`` → {name: value or True}; and the
    tokens that are not arguments (a program name)."""
    tokens = shlex.split(argline, comments=True)
    args: dict[str, Any] = {}
    stray: list[str] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if not t.startswith("--"):
            stray.append(t)
            i += 1
            continue
        name, eq, value = t[2:].partition("=")
        if eq:
            args[name] = value
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            args[name] = tokens[i + 1]
            i += 1
        else:
            args[name] = True
        i += 1
    return args, stray


def read_megatron(argline: str, world_size: int | None = None) -> Job:
    """The job a Megatron-LM ``pretrain_gpt.py`` argument line describes on ``world_size``
    GPUs (None: the data-parallel size stays unsized). Shell comments are allowed."""
    args, stray = _parse(argline)
    used: set[str] = set()
    not_modelled: list[str] = []
    knobs: dict[str, Any] = {}

    def get(name: str, default: Any = None, kind: Any = None) -> Any:
        used.add(name)
        v = args.get(name, default)
        if kind is not None and v is not None and v is not True:
            try:
                return kind(v)
            except ValueError:
                raise ValueError(f"--{name} {v!r}: expected a {kind.__name__}") from None
        return v

    def flag(name: str) -> bool:
        used.add(name)
        return args.get(name) is True or str(args.get(name, "")).lower() == "true"

    for name in ("num-layers", "hidden-size", "num-attention-heads", "seq-length"):
        if name not in args:
            raise ValueError(f"Megatron arguments: --{name} is missing (a model needs "
                             f"--num-layers, --hidden-size, --num-attention-heads and "
                             f"--seq-length)")
    tp = get("tensor-model-parallel-size", 1, int)
    pp = get("pipeline-model-parallel-size", 1, int)
    cp = get("context-parallel-size", 1, int)
    layers = get("num-layers", kind=int)
    hidden = get("hidden-size", kind=int)
    heads = get("num-attention-heads", kind=int)
    seq_len = get("seq-length", kind=int)
    mbs = get("micro-batch-size", 1, int)
    gbs = get("global-batch-size", None, int)
    for name, v in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp),
                    ("context-parallel-size", cp), ("micro-batch-size", mbs)):
        if v < 1:
            raise ValueError(f"--{name} {v}: give a positive int")

    # the data-parallel size: what the world leaves over
    dp = None
    if world_size is not None:
        if world_size % (tp * pp * cp):
            raise ValueError(f"world size {world_size} is not a multiple of TP {tp} × PP {pp} "
                             f"× CP {cp} = {tp * pp * cp}")
        dp = world_size // (tp * pp * cp)

    # the model
    swiglu = flag("swiglu")
    ffn = get("ffn-hidden-size", None, int)
    if ffn is None:  # Megatron's defaults (arguments.py)
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    groups = get("num-query-groups", heads, int) if flag("group-query-attention") else heads
    if not flag("group-query-attention") and "num-query-groups" in args:
        not_modelled.append("num-query-groups without --group-query-attention: Megatron "
                            "ignores it, so does simddp")
    kv_channels = get("kv-channels", hidden // heads, int)
    if kv_channels != hidden // heads:
        not_modelled.append(f"kv-channels={kv_channels}: a head size other than hidden / "
                            f"heads ({hidden // heads}); modelled as {hidden // heads}")
    vocab = get("vocab-size", None, int)
    tokenizer = get("tokenizer-type")
    if vocab is None:
        if tokenizer in (None, "GPT2BPETokenizer") and ("vocab-file" in args or tokenizer):
            vocab = 50257  # GPT-2's BPE vocabulary
            if tokenizer is None:
                not_modelled.append("no --tokenizer-type: GPT2BPETokenizer assumed from "
                                    "--vocab-file/--merge-file (50,257 tokens)")
        else:
            raise ValueError(f"Megatron arguments: the vocabulary size is not known from "
                             f"--tokenizer-type {tokenizer}: give --vocab-size")
    elif tokenizer == "NullTokenizer":
        vocab += 1  # Megatron's NullTokenizer adds an end-of-document token
    multiple = get("make-vocab-size-divisible-by", 128, int) * tp
    padded = math.ceil(vocab / multiple) * multiple
    tied = not flag("untie-embeddings-and-output-weights")
    norm = get("normalization", "LayerNorm")
    position = get("position-embedding-type", "learned_absolute")
    no_bias = flag("disable-bias-linear")
    rotary_base = get("rotary-base", 10000, float)
    rotary_percent = get("rotary-percent", 1.0, float)
    eps = get("norm-epsilon", 1e-5, float)
    max_pos = get("max-position-embeddings", seq_len, int)
    dropouts = (get("attention-dropout", 0.1, float), get("hidden-dropout", 0.1, float))
    llama_like = swiglu and norm == "RMSNorm" and position == "rope"
    if llama_like:
        if not no_bias:
            not_modelled.append("linear biases (no --disable-bias-linear): the Llama-style "
                                "model here has none")
        if rotary_percent != 1.0:
            not_modelled.append(f"rotary-percent={rotary_percent}: rotary embeddings on all "
                                f"of each head here")
        if any(dropouts):
            not_modelled.append(f"attention-dropout/hidden-dropout={dropouts}: the "
                                f"Llama-style model has no dropout")
        model_spec = (f"llama:dim={hidden},layers={layers},heads={heads},kv-heads={groups},"
                      f"ffn={ffn},vocab={padded},norm-eps={eps:g},rope-theta={rotary_base:g}"
                      + ("" if not tied else ",tie=true"))
    else:
        if swiglu or norm != "LayerNorm" or position != "learned_absolute" or no_bias:
            not_modelled.append(
                f"a GPT with swiglu={swiglu}, normalization={norm}, position-embedding-type="
                f"{position}, disable-bias-linear={no_bias}: modelled as Megatron's default GPT "
                f"(LayerNorm, GeLU, biases, learned positions; Llama-style needs --swiglu, "
                f"--normalization RMSNorm and --position-embedding-type rope together)")
        if groups != heads:
            not_modelled.append(f"num-query-groups={groups}: the GPT here has one key/value "
                                f"head per query head")
        model_spec = (f"gpt2:dim={hidden},layers={layers},heads={heads},ffn={ffn},"
                      f"vocab={padded},positions={max(max_pos, seq_len)},"
                      f"dropout={dropouts[1]:g},attention-dropout={dropouts[0]:g}"
                      + ("" if tied else ",tie=false"))

    # the layout
    vp_layers = get("num-layers-per-virtual-pipeline-stage", None, int)
    vp_stages = get("num-virtual-stages-per-pipeline-rank", None, int)
    data = "distributed-optimizer" if flag("use-distributed-optimizer") else "dp"
    parts = [f"pp:{pp}"] if pp > 1 else []
    parts.append(f"{data}:{dp}" if dp is not None else data)
    if cp > 1:
        parts.append(f"cp:{cp}")
    if tp > 1:
        parts.append(f"tp:{tp}")
    parallel = ",".join(parts)
    if gbs is None:
        gbs = mbs * dp if dp is not None else None
    steps = None
    if gbs is not None and dp is not None:
        if gbs % (mbs * dp):
            raise ValueError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size "
                             f"{mbs} × data-parallel size {dp}")
        steps = gbs // (mbs * dp)
    elif gbs is not None:
        not_modelled.append(f"global-batch-size={gbs}: its microbatches per step need the "
                            f"world size")
    if pp > 1:
        if vp_layers is not None or vp_stages is not None:
            v = vp_stages or layers // (pp * vp_layers)
            if vp_layers is not None and layers % (pp * vp_layers):
                raise ValueError(f"--num-layers {layers} is not a multiple of PP {pp} × "
                                 f"--num-layers-per-virtual-pipeline-stage {vp_layers}")
            knobs["pp_schedule"], knobs["stages_per_rank"] = "Interleaved1F1B", v
        else:
            knobs["pp_schedule"], knobs["stages_per_rank"] = "1F1B", 1
        if steps is not None:
            knobs["microbatches"] = steps
        knobs["grad_accum"] = 1
        not_modelled.append("pipeline split: Megatron gives each stage the same number of "
                            "blocks (embedding and head on top); simddp splits as torchtitan, "
                            "the embedding and the head weighing one block each")
    else:
        for name in ("num-layers-per-virtual-pipeline-stage",
                     "num-virtual-stages-per-pipeline-rank"):
            if name in args:
                not_modelled.append(f"{name}: no pipeline (PP 1), no virtual stages")
        if steps is not None:
            knobs["grad_accum"] = steps

    # activation recompute
    granularity = get("recompute-granularity")
    if flag("recompute-activations"):
        granularity = granularity or "selective"
    method = get("recompute-method")
    n = get("recompute-num-layers", None, int)
    if granularity == "selective":
        knobs["activation_checkpointing"] = "selective-op"
        not_modelled.append("recompute-granularity=selective: Megatron recomputes core "
                            "attention only; modelled as torchtitan's op-level selective "
                            "policy (matmul outputs saved, the rest recomputed)")
    elif granularity == "full":
        knobs["activation_checkpointing"] = "full"
        if method == "block" and n is not None:
            not_modelled.append(f"recompute-method=block, recompute-num-layers={n}: only the "
                                f"first {n} blocks of each stage recompute in Megatron; "
                                f"modelled as all blocks")
        elif n not in (None, 1):
            not_modelled.append(f"recompute-method={method}, recompute-num-layers={n}: "
                                f"groups of {n} blocks recompute together in Megatron; "
                                f"modelled block by block")
    elif granularity is None:
        knobs["activation_checkpointing"] = "none"
    else:
        raise ValueError(f"--recompute-granularity {granularity!r}: give full or selective")

    # precision and the rest
    bf16, fp16 = flag("bf16"), flag("fp16")
    knobs["param_dtype"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    knobs["reduce_dtype"] = "bf16" if flag("grad-reduce-in-bf16") else "fp32"
    if fp16:
        not_modelled.append("fp16: loss scaling (its checks of the gradients for inf) is not "
                            "modelled")
    fp8 = get("fp8-format")
    knobs["float8"] = fp8 is not None
    if fp8 is not None:
        not_modelled.append(f"fp8-format={fp8}: FP8 matmuls (Transformer Engine) are not "
                            f"modelled: costed at {knobs['param_dtype']}")
    knobs["sequence_parallel"] = flag("sequence-parallel") and tp > 1
    if flag("sequence-parallel") and tp == 1:
        not_modelled.append("sequence-parallel with TP 1: no effect (Megatron turns it off)")
    knobs["async_tp"] = "tp-comm-overlap" in args and tp > 1
    overlap = flag("overlap-grad-reduce")
    flag("overlap-param-gather")
    if not overlap and (dp is None or dp > 1):
        not_modelled.append("no --overlap-grad-reduce: Megatron reduces gradients after "
                            "backward; simddp's data-parallel layer overlaps them with it")
    attention = get("attention-backend", "auto")
    if attention not in ("auto", "fused", "flash"):
        not_modelled.append(f"attention-backend={attention}: attention is one fused SDPA "
                            f"kernel here")
    clip = get("clip-grad", 1.0, float)
    if clip:
        not_modelled.append(f"clip-grad={clip:g}: gradient-norm clipping (a norm and its "
                            f"all-reduce per step) is not modelled")
    used.add("make-vocab-size-divisible-by")
    for name, what in _NOT_MODELLED.items():
        if name in args:
            used.add(name)
            not_modelled.append(f"{name}: not modelled ({what})")
    no_effect = sorted(k for k in args if k not in used and k in _NO_EFFECT)
    used.update(no_effect)
    # read above: the model's shape arguments (their values are in the model)
    used.update({"group-query-attention", "untie-embeddings-and-output-weights",
                 "disable-bias-linear", "swiglu"})
    unknown = sorted(k for k in args if k not in used)
    not_modelled += [f"{k}={args[k]}: unknown to simddp's Megatron reader" for k in unknown]
    if stray:
        not_modelled.append(f"not arguments (ignored): {' '.join(stray)}")
    if no_effect:
        not_modelled.append("no effect on a step's time or memory: "
                            + ", ".join(f"--{k}" for k in no_effect))

    model = resolve_model(model_spec, seq_len=seq_len, local_batch=mbs)
    if tp > 1 and tp_refusal(model):
        not_modelled.append(f"tensor-model-parallel-size={tp}: {tp_refusal(model)}")
    return Job(model=model, model_name=model.name, seq_len=seq_len, local_batch=mbs,
               global_batch=gbs, parallel=parallel, world_size=world_size, knobs=knobs,
               not_modelled=tuple(not_modelled), source="Megatron-LM arguments",
               model_spec=model_spec)
