"""A Llama-3-style decoder (torch only): Meta's reference ``llama3`` ``model.py`` architecture.

RMSNorm → grouped-query attention with rotary embeddings → RMSNorm → SwiGLU feed-forward, per
block; token embedding in, RMSNorm and a linear head out. Parameter names, shapes and the
SwiGLU hidden size follow the reference (and torchtitan's ``llama3`` model), so the published
configurations have their published parameter counts:

>>> LLAMA3_8B.num_params(), LLAMA3_70B.num_params()
(8030261248, 70553706496)

Attention is written out (``matmul``, causal mask, ``softmax``, ``matmul``) as in the
reference, not ``F.scaled_dot_product_attention``: SDPA picks a different kernel on the meta
device (its math decomposition) than on CPU (a fused one), so the ops a step runs — and what a
compute model charges for them — would depend on the device. Written out, a step runs the same
ops on the meta device as on real tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LlamaArgs", "Llama", "LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B", "LLAMA3_TINY",
           "LLAMA3_CONFIGS", "lm_loss", "LlamaStage", "stage_layers"]


@dataclass(frozen=True)
class LlamaArgs:
    """A Llama-3-style decoder's shape (the fields of Meta's ``ModelArgs``)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    vocab_size: int = 128256
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    # the SwiGLU hidden size given outright (a Hugging Face ``intermediate_size``, Megatron's
    # ``--ffn-hidden-size``); None: computed from multiple_of and ffn_dim_multiplier
    ffn_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192  # rotary tables are built for this many positions
    tie_embeddings: bool = False  # output head shares the token embedding's weight
    # "reference": attention written out (matmul, causal mask, fp32 softmax, matmul), as Meta's
    # reference model; "sdpa": F.scaled_dot_product_attention, one fused kernel (flash
    # attention on a GPU and on CPU), as torchtitan trains
    attention: str = "reference"

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaArgs.{name} must be a positive int, got {v!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaArgs: dim {self.dim} is not divisible by n_heads "
                             f"{self.n_heads}")
        if self.ffn_dim is not None and (not isinstance(self.ffn_dim, int)
                                         or isinstance(self.ffn_dim, bool) or self.ffn_dim < 1):
            raise ValueError(f"LlamaArgs.ffn_dim must be a positive int or None, got "
                             f"{self.ffn_dim!r}")
        if self.attention not in ("reference", "sdpa"):
            raise ValueError(f"LlamaArgs.attention must be 'reference' or 'sdpa', got "
                             f"{self.attention!r}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaArgs: head_dim {self.head_dim} must be even for rotary "
                             f"embeddings")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"LlamaArgs: n_heads {self.n_heads} must be a multiple of "
                             f"n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The SwiGLU hidden size as the reference ``FeedForward`` computes it (``ffn_dim``
        when given)."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_params(self) -> int:
        """Parameters of :class:`Llama` with these arguments, in closed form."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        attention = 2 * d * d + 2 * d * kv
        block = attention + 3 * d * self.ffn_hidden_dim + 2 * d
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + d + embeddings


# Meta's published Llama 3 configurations (params.json of Meta-Llama-3-8B / -70B; also
# torchtitan's torchtitan/models/llama3 "8B" and "70B", which give 70B multiple_of=4096 —
# 1024 yields the same hidden size, 28672).
LLAMA3_8B = LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0)
LLAMA3_70B = LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0)
# Llama 3.1 405B (Meta's params.json; the Llama 3 paper, Table 3: 126 layers, dim 16,384, FFN
# 53,248, 128 heads, 8 key/value heads).
LLAMA3_405B = LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0)
# A test-sized one with the same structure (grouped-query attention, SwiGLU rounding).
LLAMA3_TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                        multiple_of=32, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                        max_seq_len=64)
LLAMA3_CONFIGS = {"8b": LLAMA3_8B, "70b": LLAMA3_70B, "405b": LLAMA3_405B, "tiny": LLAMA3_TINY}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) \
            * self.weight


def rope_tables(args: LlamaArgs, device: torch.device | str | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, ``(max_seq_len, head_dim // 2)`` each (the real and
    imaginary parts of the reference's ``freqs_cis``)."""
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device).float() / half))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x`` (batch, seq, heads, head_dim) as the reference's
    complex multiplication by ``freqs_cis`` does."""
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.fused = args.attention == "sdpa"
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        # -1 heads, as torchtitan's llama3: under tensor parallelism wq/wk/wv are column-wise
        # sharded and each rank holds n_heads / tp (n_kv_heads / tp) of the heads
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        rep = self.n_heads // self.n_kv_heads  # grouped-query attention: share k/v heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.fused:  # one kernel: the s × s scores never reach memory
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = out.transpose(1, 2).reshape(b, s, -1)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
            probs = F.softmax(scores.float(), dim=-1).type_as(q)
            out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder: ``forward(tokens)`` (batch, seq) int64 → logits (batch, seq, vocab).

    Its blocks are ``self.layers`` (a ``ModuleList``), the unit FSDP2 shards one by one.
    The rotary tables are plain attributes, not buffers (as in the reference), so DDP has no
    buffers to broadcast; they follow the tokens' device.
    """

    def __init__(self, args: LlamaArgs = LLAMA3_TINY) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope = rope_tables(args, self.tok_embeddings.weight.device)

    def forward(self, tokens: Tensor) -> Tensor:
        cos, sin, mask = _positions(self, tokens.shape[1], tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))


def lm_loss(logits: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Next-token cross entropy: ``logits`` (batch, seq, vocab) against ``batch[1]`` (batch,
    seq), the targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())


# -- pipeline parallelism ------------------------------------------------------------------------

def stage_layers(n_layers: int, stage: int, num_stages: int, *, input_weight: int = 0,
                 output_weight: int = 0) -> range:
    """The blocks stage ``stage`` of ``num_stages`` holds. With no weights:
    ``[stage·L/S, (stage+1)·L/S)`` — torchtitan's manual split at equal blocks per stage, which
    needs ``S`` to divide ``L``. With ``input_weight`` / ``output_weight``: torchtitan's
    ``generate_llm_fqn_per_model_part`` — the token embedding counts as ``input_weight`` blocks
    on the first stage and the norm and head as ``output_weight`` on the last, ``L + weights``
    spread evenly (the first stages take the remainder). Llama 3's 405B run (the Llama 3 paper,
    §3.3.2) is weights 1 and 1 at one block per stage: the first stage holds only the embedding,
    the last only the head."""
    for name, v in (("n_layers", n_layers), ("num_stages", num_stages)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"stage_layers: {name} must be a positive int, got {v!r}")
    for name, v in (("input_weight", input_weight), ("output_weight", output_weight)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"stage_layers: {name} must be an int >= 0, got {v!r}")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < num_stages:
        raise ValueError(f"stage_layers: stage must be in 0..{num_stages - 1}, got {stage!r}")
    if not input_weight and not output_weight:
        if n_layers % num_stages:
            divisors = [d for d in range(1, n_layers + 1) if n_layers % d == 0]
            raise ValueError(f"stage_layers: {num_stages} pipeline stages do not divide the "
                             f"model's {n_layers} blocks; the number of stages (pp × stages per "
                             f"rank) must be one of {divisors}, or weigh the embedding and head "
                             f"(input_weight / output_weight, torchtitan's uneven split)")
        per = n_layers // num_stages
        return range(stage * per, (stage + 1) * per)
    if num_stages == 1:
        return range(n_layers)
    effective = n_layers + input_weight + output_weight
    per, extra = divmod(effective, num_stages)
    if per < max(input_weight, output_weight, 1):
        raise ValueError(f"stage_layers: {num_stages} stages over {n_layers} blocks (+ embedding "
                         f"weight {input_weight}, head weight {output_weight}) leave "
                         f"{per} per stage, fewer than a weight: use fewer stages")
    counts = [per + (i < extra) for i in range(num_stages)]
    counts[0] -= input_weight
    counts[-1] -= output_weight
    start = sum(counts[:stage])
    return range(min(start, n_layers), min(start + counts[stage], n_layers))


class LlamaStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a :class:`Llama`, cut as torchtitan cuts it by hand:
    the blocks :func:`stage_layers` names (``self.layers``, a ``ModuleList``, the unit FSDP2
    shards), the token embedding on the first stage, the final norm and output head on the
    last. ``forward`` takes tokens (first stage) or hidden states (batch, seq, dim) and returns
    hidden states, or logits on the last stage. Built from ``model``'s own modules (shared, not
    copied), so the stages of one model hold exactly its parameters."""

    def __init__(self, model: Llama, stage: int, num_stages: int, *, input_weight: int = 0,
                 output_weight: int = 0) -> None:
        super().__init__()
        if not isinstance(model, Llama):
            raise TypeError(f"LlamaStage cuts a models.llama.Llama, got {type(model).__name__}")
        self.args = model.args
        self.stage, self.num_stages = stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        if model.args.tie_embeddings and num_stages > 1:
            raise ValueError("LlamaStage: a model with tie_embeddings=True shares its embedding "
                             "with its output head, which would sit on different stages; use "
                             "tie_embeddings=False for pipeline parallelism")
        self.layer_ids = stage_layers(model.args.n_layers, stage, num_stages,
                                      input_weight=input_weight, output_weight=output_weight)
        self.tok_embeddings = model.tok_embeddings if self.first else None
        self.layers = nn.ModuleList(model.layers[i] for i in self.layer_ids)
        self.norm = model.norm if self.last else None
        self.output = model.output if self.last else None
        self.rope = model.rope
        # under sequence parallelism a stage receives (and passes on) 1/n of the sequence
        # (its blocks gather the rest); the rotary tables and the mask span all of it
        self.sequence_shards = 1

    def forward(self, x: Tensor) -> Tensor:
        s = x.shape[1] * (1 if self.tok_embeddings is not None else self.sequence_shards)
        cos, sin, mask = _positions(self, s, x.device)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h)) if self.output is not None else h


def _positions(module: Llama | LlamaStage, s: int, device: torch.device
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The rotary tables' first ``s`` rows and the causal mask for ``s`` positions, on
    ``device`` (``module.rope`` follows the inputs' device, moved once)."""
    if s > module.args.max_seq_len:
        raise ValueError(f"{type(module).__name__}: sequence of {s} tokens exceeds max_seq_len "
                         f"{module.args.max_seq_len}")
    if module.rope[0].device != device:
        module.rope = tuple(t.to(device) for t in module.rope)
    cos, sin = (t[:s] for t in module.rope)
    return cos, sin, torch.full((s, s), float("-inf"), device=device).triu(1)
