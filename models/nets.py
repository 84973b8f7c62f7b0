"""Small ``nn.Module`` classes used by the scenario zoo.

All are cheap (one 4-rank iteration costs milliseconds on CPU) and build deterministically from
torch's global seed.  Rank-dependent behaviour is passed as a forward argument that the zoo puts in
each rank's batch, never read from ``torch.distributed``: the modules work without a process group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MLP",
    "ManySmallFewLarge",
    "PermutedChain",
    "RoutedNet",
    "TiedLM",
    "BufferNet",
    "RunningCenter",
    "SparseBagNet",
    "MixedDtypeNet",
    "TransformerNet",
]


class MLP(nn.Module):
    """``depth`` Linear layers with ReLU between them: in -> width -> ... -> width -> out.

    ``order="reversed"`` registers the same layers (same values: they are *built* in forward
    order either way, so the RNG is consumed identically) in reversed registration order.  Only
    ``parameters()`` order changes, which is what DDP's initial bucket assignment follows.

    >>> _ = torch.manual_seed(0); a = MLP(3, 8, order="forward")
    >>> _ = torch.manual_seed(0); b = MLP(3, 8, order="reversed")
    >>> [n for n, _ in b.named_parameters()][:2]
    ['l2.weight', 'l2.bias']
    >>> all(a.state_dict()[k].equal(v) for k, v in b.state_dict().items())
    True
    """

    def __init__(
        self,
        depth: int = 6,
        width: int = 64,
        in_features: int | None = None,
        out_features: int = 8,
        order: str = "forward",
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if order not in ("forward", "reversed"):
            raise ValueError(f"order must be 'forward' or 'reversed', got {order!r}")
        dims = [in_features or width] + [width] * (depth - 1) + [out_features]
        layers = [nn.Linear(dims[i], dims[i + 1]) for i in range(depth)]
        self.depth = depth
        for i in range(depth) if order == "forward" else reversed(range(depth)):
            self.add_module(f"l{i}", layers[i])

    def forward(self, x: Tensor) -> Tensor:
        for i in range(self.depth):
            x = getattr(self, f"l{i}")(x)
            if i < self.depth - 1:
                x = F.relu(x)
        return x


class Affine(nn.Module):
    """Per-feature scale and shift: two tiny parameters (the "many small" ones)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        # Not ones/zeros: distinct values make wrong bucket copies visible in the results.
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.shift = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift


class ManySmallFewLarge(nn.Module):
    """``n_large`` wide Linear layers, each followed by ``n_small`` tiny Affine layers.

    With width 256 a Linear holds 65,792 floats (257 KiB) and an Affine two 1 KiB vectors, so a
    ``bucket_cap_mb`` of 0.02 (20 KiB) gives buckets of ~20 KiB (small parameters only) alternating
    with ~260 KiB ones (a large layer): six buckets of very different sizes for the defaults.
    """

    def __init__(self, width: int = 256, n_large: int = 3, n_small: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(n_large):
            self.blocks.append(nn.Linear(width, width))
            for _ in range(n_small):
                self.blocks.append(Affine(width))
        self.head = nn.Linear(width, 1)
        # Scale the head's input so that SGD(lr=0.1) stays stable at width 256 (otherwise the head
        # weights grow ~100x in 4 steps and reference comparisons lose relative precision).
        self.out_scale = width**-0.5

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
            if isinstance(block, nn.Linear):
                x = torch.tanh(x)
        return self.head(x * self.out_scale)


class PermutedChain(nn.Module):
    """Equal-width layers registered as l0..l{n-1} (then a head) but applied in ``order``.

    Gradients become ready in the reverse of the application order, so with an order that is a
    shuffle, ready order matches neither registration order nor its reverse (which is what DDP's
    initial bucketing assumes): DDP's rebuilt buckets differ from the initial ones.  ``order`` may
    be overridden per call, which is how a rank gets its own application (and grad-ready) order.
    """

    def __init__(self, width: int = 32, order: Sequence[int] = (2, 5, 0, 3, 1, 4)) -> None:
        super().__init__()
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"order must be a permutation of 0..n-1, got {order}")
        self.order = tuple(order)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in order)
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor, order: Sequence[int] | None = None) -> Tensor:
        for i in self.order if order is None else order:
            x = torch.tanh(self.layers[i](x))
        return self.head(x)


class RoutedNet(nn.Module):
    """Trunk, ``n_experts`` experts of which each call uses the one named by ``route``, a head,
    and a ``dead`` layer that no call ever uses (a globally unused parameter)."""

    def __init__(self, width: int = 32, in_features: int = 16, n_experts: int = 3) -> None:
        super().__init__()
        self.trunk = nn.Linear(in_features, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(n_experts))
        self.dead = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor, route: int) -> Tensor:
        h = torch.relu(self.trunk(x))
        return self.head(torch.relu(self.experts[route](h)))


class TiedLM(nn.Module):
    """Token embedding whose weight is also the output projection's weight (weight tying).

    ``parameters()`` yields the shared tensor once; its gradient sums both uses.
    """

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, vocab)
        self.proj.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens: Tensor) -> Tensor:
        return self.proj(torch.tanh(self.hidden(self.embed(tokens))))


class RunningCenter(nn.Module):
    """Subtracts a running mean of its input, kept in buffers updated during training forward.

    Unlike BatchNorm in training mode, the *output depends on the buffer*, so ranks whose buffers
    diverge (no buffer broadcast) compute different gradients.  ``steps`` counts training calls.
    """

    def __init__(self, width: int, momentum: float = 0.25) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        out = x - self.running_mean
        if self.training:
            with torch.no_grad():
                self.running_mean.lerp_(x.mean(0), self.momentum)
                self.steps += 1
        return out


class BufferNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> RunningCenter -> Linear."""

    def __init__(self, width: int = 32, in_features: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.bn = nn.BatchNorm1d(width)
        self.center = RunningCenter(width)
        self.out = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.center(torch.relu(self.bn(self.inp(x)))))


class SparseBagNet(nn.Module):
    """``nn.Embedding(sparse=True)`` averaged over a bag of ids, then a dense head."""

    def __init__(self, vocab: int = 100, dim: int = 16, out_features: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=True)
        self.head = nn.Linear(dim, out_features)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.embed(ids).mean(1))


class MixedDtypeNet(nn.Module):
    """float32 -> float64 -> float32 Linear layers: DDP puts each dtype in its own buckets."""

    def __init__(self, width: int = 32, in_features: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.mid = nn.Linear(width, width).double()
        self.out = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h.double())).float()
        return self.out(h)


class TransformerNet(nn.Module):
    """One ``nn.TransformerEncoderLayer`` (no dropout) and a linear head on the mean token."""

    def __init__(self, d_model: int = 32, nhead: int = 2, dim_feedforward: int = 64) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=dim_feedforward, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(d_model, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x).mean(1))
