"""The scenario zoo: one factory per DDP feature, plus the registry ``SCENARIOS`` and ``get``.

Each factory returns a :class:`~fakepg.zoo.scenario.Scenario`; keyword arguments size the model and
data.  All data come from ``rank_generator(seed, rank)``: rank r's batches do not depend on the
world size, and batch i does not depend on how many batches are drawn.

>>> from fakepg import zoo
>>> sorted(zoo.SCENARIOS)[:3]
['buffers', 'grad_order_differs', 'grad_order_differs_per_rank']
>>> zoo.get("mlp", width=16, bucket_cap_mb=None).name
'mlp'
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from . import data, nets
from .scenario import Scenario, SeededBatches, cross_entropy_loss, ddp_options
from .workloads import WORKLOADS, resnet101, resnet50

__all__ = [
    "SCENARIOS",
    "WORKLOADS",
    "get",
    "mlp",
    "many_small_few_large",
    "grad_order_differs",
    "grad_order_differs_per_rank",
    "rank_dependent_unused",
    "tied_weights",
    "buffers",
    "sparse_embedding",
    "mixed_dtypes",
    "transformer_block",
    "param_order",
    "uneven_inputs",
    "resnet50",
    "resnet101",
]

SCENARIOS: dict[str, Callable[..., Scenario]] = {}


def _register(factory: Callable[..., Scenario]) -> Callable[..., Scenario]:
    SCENARIOS[factory.__name__] = factory
    return factory


def get(name: str, **overrides: Any) -> Scenario:
    """Build scenario ``name``; each override goes to the factory if it takes that keyword
    (``depth``, ``seed``, ``bucket_cap_mb``, ...), else to :meth:`Scenario.with_` (``ddp_kwargs``,
    ``optimizer``, ...).

    >>> get("mlp", depth=3, ddp_kwargs={"static_graph": True}).ddp_kwargs
    {'static_graph': True}
    """
    factory = SCENARIOS.get(name) or WORKLOADS.get(name)
    if factory is None:
        raise KeyError(f"unknown scenario {name!r}; known: "
                       f"{', '.join(sorted(SCENARIOS) + sorted(WORKLOADS))}")
    accepted = inspect.signature(factory).parameters
    scenario = factory(**{k: v for k, v in overrides.items() if k in accepted})
    rest = {k: v for k, v in overrides.items() if k not in accepted}
    return scenario.with_(**rest) if rest else scenario


def forward_with_extra(model: nn.Module, batch: tuple) -> Tensor:
    """``model(x, extra)`` for batches ``(x, y, extra)``: the rank-dependent forward argument."""
    return model(batch[0], batch[2])


# -- scenarios -----------------------------------------------------------------------------------


@_register
def mlp(
    depth: int = 6, width: int = 64, batch_size: int = 32, iterations: int = 5, seed: int = 0,
    bucket_cap_mb: float | None = None,
) -> Scenario:
    """Plain ``depth``-layer ReLU MLP, ``width`` wide, MSE regression (benchmarks, the demo)."""
    return Scenario(
        name="mlp",
        model=functools.partial(nets.MLP, depth, width, None, 8),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(width,), out_features=8)),
        ddp_kwargs=ddp_options(bucket_cap_mb),
        iterations=iterations,
        seed=seed,
        description=f"{depth}-layer MLP, width {width}, batch {batch_size}",
        features=("bucketing", "rebuild"),
    )


@_register
def many_small_few_large(
    width: int = 256, n_large: int = 3, n_small: int = 12, batch_size: int = 16,
    iterations: int = 4, seed: int = 0, bucket_cap_mb: float | None = 0.02,
) -> Scenario:
    """A few 257 KiB Linear layers among many 1 KiB vectors; a 20 KiB cap -> six buckets of
    ~20 and ~260 KiB once rebuilt (one bucket in iteration 1, as DDP always starts)."""
    return Scenario(
        name="many_small_few_large",
        model=functools.partial(nets.ManySmallFewLarge, width, n_large, n_small),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(width,), out_features=1)),
        ddp_kwargs=ddp_options(bucket_cap_mb),
        iterations=iterations,
        seed=seed,
        description=f"{n_large} large + {n_large * n_small} small layers, bucket_cap_mb={bucket_cap_mb}",
        features=("bucketing", "rebuild"),
    )


_CHAIN_ORDER = (2, 5, 0, 3, 1, 4)


@_register
def grad_order_differs(
    width: int = 32, order: Sequence[int] = _CHAIN_ORDER, batch_size: int = 16, iterations: int = 4,
    seed: int = 0, bucket_cap_mb: float | None = 0.005,
) -> Scenario:
    """Layers applied in a shuffled order: grads become ready neither in registration order nor
    in its reverse, so DDP's rebuilt buckets (after iteration 1) differ from its initial ones."""
    return Scenario(
        name="grad_order_differs",
        model=functools.partial(nets.PermutedChain, width, tuple(order)),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(width,), out_features=1)),
        ddp_kwargs=ddp_options(bucket_cap_mb),
        iterations=iterations,
        seed=seed,
        description=f"chain applied in order {tuple(order)}; buckets rebuilt after iteration 1",
        features=("bucketing", "rebuild", "grad-order"),
    )


@_register
def grad_order_differs_per_rank(
    width: int = 32, order: Sequence[int] = _CHAIN_ORDER, batch_size: int = 16, iterations: int = 4,
    seed: int = 0, bucket_cap_mb: float | None = 0.005,
) -> Scenario:
    """Like ``grad_order_differs`` but rank r applies the layers in ``order`` rotated by r, so
    each rank sees its own grad-ready order; DDP must adopt rank 0's rebuilt bucket layout."""
    return grad_order_differs(width, order, batch_size, iterations, seed, bucket_cap_mb).with_(
        name="grad_order_differs_per_rank",
        batches=SeededBatches(data.permuted, seed, dict(
            iterations=iterations, batch_size=batch_size, width=width, order=tuple(order))),
        forward=forward_with_extra,
        description=f"rank r applies order {tuple(order)} rotated by r; rank 0's rebuild wins",
        features=("bucketing", "rebuild", "grad-order", "rank-dependent"),
    )


@_register
def rank_dependent_unused(
    width: int = 32, in_features: int = 16, n_experts: int = 3, batch_size: int = 16,
    iterations: int = 4, seed: int = 0,
) -> Scenario:
    """Rank r uses expert (r + i) % n_experts in iteration i; a ``dead`` layer is never used.
    Needs ``find_unused_parameters=True`` (without it DDP raises on iteration 2)."""
    return Scenario(
        name="rank_dependent_unused",
        model=functools.partial(nets.RoutedNet, width, in_features, n_experts),
        batches=SeededBatches(data.routed, seed, dict(
            iterations=iterations, batch_size=batch_size, in_features=in_features,
            n_experts=n_experts)),
        forward=forward_with_extra,
        ddp_kwargs={"find_unused_parameters": True},
        iterations=iterations,
        seed=seed,
        description="rank- and iteration-dependent expert choice plus a never-used layer",
        features=("unused", "rank-dependent"),
    )


@_register
def tied_weights(
    vocab: int = 50, dim: int = 16, batch_size: int = 32, iterations: int = 4, seed: int = 0,
) -> Scenario:
    """Embedding and output projection share one weight (two uses, one gradient, one hook)."""
    return Scenario(
        name="tied_weights",
        model=functools.partial(nets.TiedLM, vocab, dim),
        batches=SeededBatches(data.tokens, seed, dict(
            iterations=iterations, batch_size=batch_size, vocab=vocab)),
        loss=cross_entropy_loss,
        iterations=iterations,
        seed=seed,
        description="embedding weight tied to the output projection",
        features=("tied",),
    )


@_register
def buffers(
    width: int = 32, in_features: int = 16, batch_size: int = 16, iterations: int = 4,
    seed: int = 0,
) -> Scenario:
    """BatchNorm running stats plus a running-mean buffer that the forward *reads* and a step
    counter.  With DDP's default buffer broadcast from rank 0 before each forward the reference
    (which models that) matches; with ``broadcast_buffers=False`` each rank keeps its own."""
    return Scenario(
        name="buffers",
        model=functools.partial(nets.BufferNet, width, in_features),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(in_features,),
            out_features=1)),
        iterations=iterations,
        seed=seed,
        description="BatchNorm1d + custom running-mean and step-count buffers",
        features=("buffers",),
    )


@_register
def sparse_embedding(
    vocab: int = 100, dim: int = 16, bag: int = 4, batch_size: int = 16, iterations: int = 4,
    seed: int = 0,
) -> Scenario:
    """``nn.Embedding(sparse=True)``: sparse COO gradients, each in a bucket of its own."""
    return Scenario(
        name="sparse_embedding",
        model=functools.partial(nets.SparseBagNet, vocab, dim, 4),
        batches=SeededBatches(data.bags, seed, dict(
            iterations=iterations, batch_size=batch_size, vocab=vocab, bag=bag, out_features=4)),
        iterations=iterations,
        seed=seed,
        description="sparse embedding bag with a dense head",
        features=("sparse",),
    )


@_register
def mixed_dtypes(
    width: int = 32, in_features: int = 16, batch_size: int = 16, iterations: int = 4,
    seed: int = 0,
) -> Scenario:
    """A float64 layer between float32 ones: buckets never mix dtypes, so >= 2 buckets."""
    return Scenario(
        name="mixed_dtypes",
        model=functools.partial(nets.MixedDtypeNet, width, in_features),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(in_features,),
            out_features=1)),
        iterations=iterations,
        seed=seed,
        description="float32 / float64 / float32 layers",
        features=("mixed-dtype", "bucketing"),
    )


@_register
def transformer_block(
    d_model: int = 32, nhead: int = 2, seq: int = 8, batch_size: int = 8, iterations: int = 3,
    seed: int = 0, bucket_cap_mb: float | None = None,
) -> Scenario:
    """One ``nn.TransformerEncoderLayer`` (d_model 32, 2 heads, dropout 0) and a linear head."""
    return Scenario(
        name="transformer_block",
        model=functools.partial(nets.TransformerNet, d_model, nhead, 2 * d_model),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(seq, d_model),
            out_features=1)),
        ddp_kwargs=ddp_options(bucket_cap_mb),
        iterations=iterations,
        seed=seed,
        description=f"transformer encoder layer, d_model {d_model}, {nhead} heads, seq {seq}",
        features=("transformer",),
    )


@_register
def param_order(
    order: str = "forward", depth: int = 6, width: int = 32, batch_size: int = 16,
    iterations: int = 4, seed: int = 0, bucket_cap_mb: float | None = 0.005,
) -> Scenario:
    """The same MLP (same values) with parameters registered in ``order`` ("forward" or
    "reversed").  Final parameters must not depend on the order; initial buckets (and, without
    a rebuild, e.g. with find_unused_parameters=True, all buckets) do."""
    return Scenario(
        name="param_order",
        model=functools.partial(nets.MLP, depth, width, None, 1, order),
        batches=SeededBatches(data.regression, seed, dict(
            iterations=iterations, batch_size=batch_size, in_shape=(width,), out_features=1)),
        ddp_kwargs=ddp_options(bucket_cap_mb),
        iterations=iterations,
        seed=seed,
        description=f"{depth}-layer MLP registered in {order} order",
        features=("param-order", "bucketing"),
    )


@_register
def uneven_inputs(
    base: int = 3, depth: int = 4, width: int = 32, batch_size: int = 16, seed: int = 0,
) -> Scenario:
    """Rank r gets ``base + r`` batches: run under ``torch.distributed.algorithms.Join`` (without
    it DDP hangs once rank 0 runs out).  The reference models Join's default semantics."""
    return Scenario(
        name="uneven_inputs",
        model=functools.partial(nets.MLP, depth, width, None, 1),
        batches=SeededBatches(data.uneven, seed, dict(
            base=base, batch_size=batch_size, in_features=width, out_features=1)),
        iterations=None,
        seed=seed,
        description=f"rank r runs {base} + r iterations (Join)",
        features=("uneven",),
    )
