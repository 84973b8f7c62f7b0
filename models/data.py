"""The zoo's batch generators: ``fn(seed, rank, world_size, **kwargs) -> list`` of batches.

Every batch comes from ``rank_generator(seed, rank, name)``: rank r's batches do not depend on
the world size, and batch i does not depend on how many batches are drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .scenario import rank_generator

__all__ = ["regression", "uneven", "routed", "permuted", "tokens", "token_sequences", "bags",
           "images", "masked_tokens", "causal_tokens"]


def regression(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int,
    in_shape: Sequence[int], out_features: int,
) -> list[tuple[Tensor, Tensor]]:
    g = rank_generator(seed, rank, "regression")
    return [
        (torch.randn(batch_size, *in_shape, generator=g), torch.randn(batch_size, out_features, generator=g))
        for _ in range(iterations)
    ]


def uneven(
    seed: int, rank: int, world_size: int, *, base: int, batch_size: int, in_features: int,
    out_features: int,
) -> list[tuple[Tensor, Tensor]]:
    return regression(seed, rank, world_size, iterations=base + rank, batch_size=batch_size,
                       in_shape=(in_features,), out_features=out_features)


def routed(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, in_features: int,
    n_experts: int,
) -> list[tuple[Tensor, Tensor, int]]:
    # Rank r uses expert (r + i) % n_experts in iteration i: the used set differs per rank and per
    # iteration, and with world_size < n_experts some experts are unused on *every* rank.
    data = regression(seed, rank, world_size, iterations=iterations, batch_size=batch_size,
                       in_shape=(in_features,), out_features=1)
    return [(x, y, (rank + i) % n_experts) for i, (x, y) in enumerate(data)]


def permuted(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, width: int,
    order: Sequence[int],
) -> list[tuple[Tensor, Tensor, tuple[int, ...]]]:
    # Rank r applies the layers in `order` rotated by r: rank 0 keeps the model's own order.
    k = rank % len(order)
    rotated = tuple(order[k:]) + tuple(order[:k])
    data = regression(seed, rank, world_size, iterations=iterations, batch_size=batch_size,
                       in_shape=(width,), out_features=1)
    return [(x, y, rotated) for x, y in data]


def tokens(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, vocab: int,
) -> list[tuple[Tensor, Tensor]]:
    g = rank_generator(seed, rank, "tokens")
    out = []
    for _ in range(iterations):
        tokens = torch.randint(vocab, (batch_size,), generator=g)
        out.append((tokens, (tokens * 7 + 3) % vocab))  # a learnable next-token map
    return out


def token_sequences(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, seq_len: int,
    vocab: int,
) -> list[tuple[Tensor, Tensor]]:
    """Language-model batches: ``(tokens, targets)`` of shape (batch_size, seq_len), the targets
    the tokens shifted by one."""
    g = rank_generator(seed, rank, "token_sequences")
    out = []
    for _ in range(iterations):
        seq = torch.randint(vocab, (batch_size, seq_len + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def bags(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, vocab: int,
    bag: int, out_features: int,
) -> list[tuple[Tensor, Tensor]]:
    g = rank_generator(seed, rank, "bags")
    # Ids from a rank-dependent window: ranks touch overlapping but different embedding rows, so
    # the sparse allreduce merges distinct index sets.
    lo = (rank * vocab // 4) % vocab
    return [
        ((lo + torch.randint(vocab // 2, (batch_size, bag), generator=g)) % vocab,
         torch.randn(batch_size, out_features, generator=g))
        for _ in range(iterations)
    ]


def images(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, image_size: int,
    num_classes: int,
) -> list[tuple[Tensor, Tensor]]:
    g = rank_generator(seed, rank, "images")
    return [(torch.randn(batch_size, 3, image_size, image_size, generator=g),
             torch.randint(num_classes, (batch_size,), generator=g)) for _ in range(iterations)]


def masked_tokens(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, seq_len: int,
    vocab: int, mask_token: int, mask_prob: float = 0.15,
) -> list[tuple[Tensor, Tensor]]:
    """BERT's masked-LM batches: ``(input_ids, labels)``, both (batch, seq_len); a ``mask_prob``
    share of positions (at least one per batch) has its token replaced by ``mask_token`` in
    ``input_ids`` and kept in ``labels``; ``labels`` is -100 (cross entropy's ignore_index)
    elsewhere. Ids avoid 0..999 (the special and unused tokens of BERT's vocabularies)."""
    g = rank_generator(seed, rank, "masked_tokens")
    out = []
    for _ in range(iterations):
        ids = torch.randint(1000, vocab, (batch_size, seq_len), generator=g)
        masked = torch.rand(batch_size, seq_len, generator=g) < mask_prob
        masked[0, 0] = True  # a batch with nothing to predict has no loss
        out.append((ids.masked_fill(masked, mask_token), ids.masked_fill(~masked, -100)))
    return out


def causal_tokens(
    seed: int, rank: int, world_size: int, *, iterations: int, batch_size: int, seq_len: int,
    vocab: int,
) -> list[tuple[Tensor, Tensor]]:
    """Language-model batches ``(input_ids, input_ids)``, (batch, seq_len): the loss predicts
    each next token of the second from the first (GPT-2's training objective)."""
    g = rank_generator(seed, rank, "causal_tokens")
    out = []
    for _ in range(iterations):
        ids = torch.randint(vocab, (batch_size, seq_len), generator=g)
        out.append((ids, ids))
    return out
