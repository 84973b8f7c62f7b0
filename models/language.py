"""BERT and GPT-2, equal to Hugging Face transformers' ``BertModel`` / ``BertForMaskedLM`` and
``GPT2Model`` / ``GPT2LMHeadModel`` (eager or SDPA attention; no KV cache, no padding masks
beyond BERT's ``attention_mask``).

The zoo imports only torch, so it carries its own: the same layers, the same module names
(``state_dict()`` keys load into transformers' models and back), the same parameter counts
(``sum(p.numel() for p in model.parameters())``, tied weights counted once) and the same
initialisation rules (normal(0, 0.02) weights, zero biases; GPT-2's residual projections scaled
by 1/√(2·layers)). Dropout as in the configurations (0.1).

>>> with torch.device("meta"):  # shapes only: counting needs no memory or init time
...     [sum(p.numel() for p in f().parameters()) for f in (bert_base, bert_large, gpt2)]
[109482240, 335141888, 124439808]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "bert_base", "bert_large",
           "GPT2Config", "GPT2Model", "GPT2LMHeadModel", "gpt2", "gpt2_medium"]


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float,
               causal: bool) -> Tensor:
    """Scaled dot-product attention over (batch, heads, seq, head_dim), as transformers' SDPA
    path runs it."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                          is_causal=causal and mask is None)


def _heads(x: Tensor, n: int) -> Tensor:
    b, s, h = x.shape
    return x.view(b, s, n, h // n).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, n * d)


# ---- BERT (Devlin et al. 2019) -------------------------------------------------------------------


@dataclass(frozen=True)
class BertConfig:
    """transformers' ``BertConfig`` defaults (bert-base-uncased)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0
    initializer_range: float = 0.02


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size,
                                            padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.dropout_p = c.attention_probs_dropout_prob

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        q, k, v = (_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        return _merge(_attention(q, k, v, mask, self.dropout_p if self.training else 0.0, False))


class BertSelfOutput(nn.Module):
    """dense, dropout, then LayerNorm of the residual sum (post-LN)."""

    def __init__(self, c: BertConfig, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c, c.hidden_size)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.dense(x))  # BERT's "gelu": the exact (erf) form


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertSelfOutput(c, c.intermediate_size)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertPooler(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x[:, 0]))


def _init_bert_like(module: nn.Module, std: float) -> None:
    """transformers' ``_init_weights`` for BERT and GPT-2: normal(0, std) weights of linear
    layers and embeddings (the padding row zeroed), zero biases, LayerNorm 1 and 0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, Conv1D)):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BertModel(nn.Module):
    """transformers' ``BertModel``: embeddings, ``num_hidden_layers`` post-LN encoder layers and
    (``add_pooling_layer``) the tanh pooler over the first token. ``forward`` returns the last
    hidden state (and the pooled output when pooling): transformers' ``last_hidden_state`` /
    ``pooler_output``."""

    def __init__(self, config: BertConfig | None = None, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = c = config or BertConfig()
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c) if add_pooling_layer else None
        _init_bert_like(self, c.initializer_range)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        mask = None
        if attention_mask is not None:  # 1 = attend, 0 = padding → an additive float mask
            dtype = self.embeddings.word_embeddings.weight.dtype
            mask = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        h = self.encoder(self.embeddings(input_ids, token_type_ids), mask)
        return h if self.pooler is None else (h, self.pooler(h))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """The transform, then the decoder whose weight is the word embedding (tied) and whose bias
    is ``bias`` (shared, as transformers shares ``decoder.bias`` with it)."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(c)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.transform(x))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(c)

    def forward(self, x: Tensor) -> Tensor:
        return self.predictions(x)


class BertForMaskedLM(nn.Module):
    """transformers' ``BertForMaskedLM``: ``BertModel`` without the pooler (masked-LM training
    leaves it unused) and the masked-LM head; ``forward`` returns the vocabulary logits."""

    def __init__(self, config: BertConfig | None = None) -> None:
        super().__init__()
        c = config or BertConfig()
        self.bert = BertModel(c, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(c)
        _init_bert_like(self.cls, c.initializer_range)
        # tied after the init, so the embedding keeps its zeroed padding row
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        h = self.bert(input_ids, attention_mask, token_type_ids)
        assert isinstance(h, Tensor)
        return self.cls(h)


_BERT_LARGE = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         intermediate_size=4096)


def bert_base(masked_lm: bool = False) -> nn.Module:
    """bert-base-uncased: ``BertModel`` (109,482,240 parameters, pooler included), or with
    ``masked_lm`` ``BertForMaskedLM`` (109,514,298: no pooler, the head's transform and bias)."""
    return BertForMaskedLM() if masked_lm else BertModel()


def bert_large(masked_lm: bool = False) -> nn.Module:
    """bert-large-uncased (24 layers, 1024 wide, 16 heads): ``BertModel`` (335,141,888
    parameters, pooler included), or ``BertForMaskedLM`` (335,174,458)."""
    return BertForMaskedLM(_BERT_LARGE) if masked_lm else BertModel(_BERT_LARGE)


# ---- GPT-2 (Radford et al. 2019) -----------------------------------------------------------------


@dataclass(frozen=True)
class GPT2Config:
    """transformers' ``GPT2Config`` defaults (gpt2, "small")."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.1  # resid_pdrop = embd_pdrop = attn_pdrop
    initializer_range: float = 0.02


class Conv1D(nn.Module):
    """transformers' ``Conv1D``: a linear layer whose weight is stored (in, out), as OpenAI's
    GPT-2 checkpoint stores it."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class GPT2Attention(nn.Module):
    def __init__(self, c: GPT2Config) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = Conv1D(3 * c.n_embd, c.n_embd)
        self.c_proj = Conv1D(c.n_embd, c.n_embd)
        self.attn_p = c.dropout
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_heads(t, self.n_head) for t in self.c_attn(x).split(x.shape[-1], dim=2))
        a = _attention(q, k, v, None, self.attn_p if self.training else 0.0, True)
        return self.resid_dropout(self.c_proj(_merge(a)))


class GPT2MLP(nn.Module):
    def __init__(self, c: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * c.n_embd, c.n_embd)
        self.c_proj = Conv1D(c.n_embd, 4 * c.n_embd)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        # GPT-2's "gelu_new" is the tanh approximation
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    """Pre-LN: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, c: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.attn = GPT2Attention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.mlp = GPT2MLP(c)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """transformers' ``GPT2Model``: token and position embeddings, ``n_layer`` pre-LN blocks of
    causal attention, and a final LayerNorm; ``forward`` returns the last hidden state."""

    def __init__(self, config: GPT2Config | None = None) -> None:
        super().__init__()
        self.config = c = config or GPT2Config()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(GPT2Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        _init_bert_like(self, c.initializer_range)
        for name, p in self.named_parameters():  # GPT-2 paper: residual layers scaled 1/√N
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, c.initializer_range / math.sqrt(2 * c.n_layer))

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """transformers' ``GPT2LMHeadModel``: ``GPT2Model`` and ``lm_head``, a bias-free linear
    layer tied to the token embedding; ``forward`` returns the vocabulary logits."""

    def __init__(self, config: GPT2Config | None = None) -> None:
        super().__init__()
        self.transformer = GPT2Model(config)
        c = self.transformer.config
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.lm_head(self.transformer(input_ids))


def gpt2(lm_head: bool = False) -> nn.Module:
    """gpt2 ("small", 12 layers, 768 wide): ``GPT2Model``, or with ``lm_head``
    ``GPT2LMHeadModel`` — 124,439,808 parameters either way (the head is tied)."""
    return GPT2LMHeadModel() if lm_head else GPT2Model()


def gpt2_medium(lm_head: bool = False) -> nn.Module:
    """gpt2-medium (24 layers, 1024 wide, 16 heads): 354,823,168 parameters."""
    c = GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    return GPT2LMHeadModel(c) if lm_head else GPT2Model(c)
