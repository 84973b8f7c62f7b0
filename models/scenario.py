"""The :class:`Scenario` record: one DDP training scenario, independent of any backend.

A scenario says *what* is trained (model factory, per-rank data, loss, optimizer, DDP keyword
arguments); a harness (fakepg, gloo, NCCL, the single-process reference) says *how*.  Every
harness runs the same loop, :class:`fakepg.zoo.TrainLoop`::

    sc = zoo.get("mlp")
    model = DistributedDataParallel(sc.build_model(), **sc.ddp_kwargs)
    opt = sc.optimizer(model.parameters())
    for batch in sc.inputs(rank, world_size):   # this rank's batches, truncated to sc.iterations
        opt.zero_grad(set_to_none=True)
        sc.step(model, batch).backward()        # step = loss(forward(model, batch), batch)
        opt.step()

Everything stored in a zoo scenario is a module-level function, class or ``functools.partial`` of
one, so scenarios pickle (for ``torch.multiprocessing.spawn`` with a real backend).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Scenario",
    "SeededBatches",
    "rank_generator",
    "forward_first",
    "mse_loss",
    "cross_entropy_loss",
    "sgd",
]


def rank_generator(seed: int, rank: int, salt: str = "") -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``(seed, rank, salt)``, independent of the global RNG.

    The seed is a hash, not ``seed + rank``, so that (seed=1, rank=0) and (seed=0, rank=1) differ.

    >>> a = torch.randn(2, generator=rank_generator(0, 1))
    >>> bool((a == torch.randn(2, generator=rank_generator(0, 1))).all())
    True
    """
    digest = hashlib.sha256(f"{seed}/{rank}/{salt}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@dataclass(frozen=True)
class SeededBatches:
    """Picklable ``batches(rank, world_size)`` callable: ``fn(seed, rank, world_size, **kwargs)``.

    Keeping the seed (and the iteration count, when ``fn`` takes one) as data, rather than in a
    closure, lets :meth:`Scenario.with_` change them: ``sc.with_(seed=3)`` reseeds the data too.
    """

    fn: Callable[..., list]
    seed: int
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, rank: int, world_size: int) -> list:
        return self.fn(self.seed, rank, world_size, **self.kwargs)


def forward_first(model: nn.Module, batch: Any) -> Any:
    """Default forward: ``model(batch[0])`` (batches are ``(x, y)`` tuples)."""
    return model(batch[0])


def mse_loss(output: Tensor, batch: Any) -> Tensor:
    """Default loss: mean squared error against ``batch[1]``."""
    return F.mse_loss(output, batch[1])


def cross_entropy_loss(output: Tensor, batch: Any) -> Tensor:
    """Cross entropy of logits ``output`` against class indices ``batch[1]``."""
    return F.cross_entropy(output, batch[1])


# SGD works with dense, sparse and mixed-dtype gradients alike, and without momentum its step is a
# pure function of the gradient, which keeps the reference comparison exact-in-spirit.
sgd: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = functools.partial(
    torch.optim.SGD, lr=0.1
)


def _to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (nested tuples, named tuples, lists, dicts) on ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to(o, device) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class Scenario:
    """One DDP training scenario.

    Attributes:
        name: registry name, e.g. ``"mlp"``.
        model: builds the model; deterministic given torch's global seed (the caller seeds, or
            uses :meth:`build_model`).  Every rank builds the same model.
        batches: ``batches(rank, world_size)`` -> that rank's per-iteration inputs.  Counts may
            differ between ranks (``uneven_inputs``).  Drawn from a ``torch.Generator`` seeded by
            ``(seed, rank)``, never from the global RNG.
        loss: ``loss(output, batch)`` -> scalar tensor.
        forward: ``forward(model, batch)`` -> output; default ``model(batch[0])``.  Rank-dependent
            behaviour travels *in the batch* (e.g. a route index), so the model stays the same on
            every rank and the reference can replay each rank exactly.
        ddp_kwargs: keyword arguments for ``DistributedDataParallel`` (treat as read-only; derive
            variants with :meth:`with_ddp`).
        optimizer: ``optimizer(params)`` -> optimizer; default SGD(lr=0.1).
        iterations: steps to run, i.e. how many of each rank's batches :meth:`inputs` keeps;
            ``None``: all of them (uneven counts).
        seed: model-init and data seed.
        description: one line for reports.
        features: tags: "bucketing", "rebuild", "unused", "tied", "buffers", "sparse",
            "mixed-dtype", "transformer", "param-order", "grad-order", "uneven", "rank-dependent".
        reference_ok: whether :func:`fakepg.zoo.reference_train` reproduces DDP's result for this
            scenario as declared (ddp_kwargs included), up to floating-point reduction order.

    >>> from fakepg import zoo
    >>> sc = zoo.get("mlp", depth=2)
    >>> len(sc.inputs(rank=0, world_size=2)) == sc.iterations
    True
    >>> sc.with_ddp(bucket_cap_mb=0.01).ddp_kwargs
    {'bucket_cap_mb': 0.01}
    """

    name: str
    model: Callable[[], nn.Module]
    batches: Callable[[int, int], list]
    loss: Callable[[Any, Any], Tensor] = mse_loss
    forward: Callable[[nn.Module, Any], Any] = forward_first
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = sgd
    iterations: int | None = None
    seed: int = 0
    description: str = ""
    features: tuple[str, ...] = ()
    reference_ok: bool = True

    # -- deriving variants -------------------------------------------------------------------

    def with_(self, **changes: Any) -> Scenario:
        """A copy with fields changed (``dataclasses.replace``).

        Changing ``seed`` or ``iterations`` also reseeds/resizes the data when ``batches`` is a
        :class:`SeededBatches` (all zoo scenarios), unless ``batches`` itself is replaced.

        >>> from fakepg import zoo
        >>> sc = zoo.get("mlp")
        >>> sc.with_(seed=1).inputs(0, 1)[0][0].equal(sc.inputs(0, 1)[0][0])
        False
        """
        b = self.batches
        if "batches" not in changes and isinstance(b, SeededBatches):
            if "seed" in changes:
                b = dataclasses.replace(b, seed=changes["seed"])
            if "iterations" in changes and "iterations" in b.kwargs and changes["iterations"]:
                b = dataclasses.replace(b, kwargs={**b.kwargs, "iterations": changes["iterations"]})
            if b is not self.batches:
                changes["batches"] = b
        return dataclasses.replace(self, **changes)

    def with_ddp(self, **ddp_kwargs: Any) -> Scenario:
        """A copy whose ``ddp_kwargs`` are updated (merged) with ``ddp_kwargs``.

        >>> from fakepg import zoo
        >>> zoo.get("rank_dependent_unused").with_ddp(static_graph=False).ddp_kwargs
        {'find_unused_parameters': True, 'static_graph': False}
        """
        return dataclasses.replace(self, ddp_kwargs={**self.ddp_kwargs, **ddp_kwargs})

    # -- running -------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """``model()`` under ``torch.manual_seed(seed)``, restoring the caller's RNG state after.

        It uses torch's default CPU generator: threads that share that generator (ranks as plain
        threads, without fakepg's per-rank isolation) must not build concurrently.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self.model()

    def inputs(self, rank: int, world_size: int, device: torch.device | str | None = None) -> list:
        """This rank's batches, truncated to ``iterations`` when that is set, moved to ``device``
        (the data are always drawn on CPU, so they are identical whatever the device)."""
        data = self.batches(rank, world_size)
        data = data if self.iterations is None else data[: self.iterations]
        return data if device is None else [_to(batch, torch.device(device)) for batch in data]

    def batch_counts(self, world_size: int) -> list[int]:
        """Number of iterations each rank runs, e.g. ``[3, 4]`` for uneven inputs."""
        return [len(self.inputs(r, world_size)) for r in range(world_size)]

    def step(self, model: nn.Module, batch: Any) -> Tensor:
        """Forward and loss for one batch: ``loss(forward(model, batch), batch)``.

        The loss gets the whole batch, not the target: a loss written as ``(output, target)``
        (``F.mse_loss`` itself) fails on the batch's tuple, and that failure is re-raised as a
        TypeError saying so.

        >>> sc = Scenario("mine", model=lambda: nn.Linear(2, 1), loss=F.mse_loss,
        ...               batches=lambda rank, world: [(torch.ones(3, 2), torch.ones(3, 1))])
        >>> sc.step(sc.build_model(), sc.inputs(0, 1)[0])
        Traceback (most recent call last):
        TypeError: Scenario 'mine': loss(output, batch) raised AttributeError: 'tuple' object has no attribute 'size'. A Scenario's loss is called with the model's output and the whole batch (here a tuple of Tensor[3, 2], Tensor[3, 1]), not the target alone: write loss=lambda output, batch: F.mse_loss(output, batch[1]), or use fakepg.zoo.mse_loss / fakepg.zoo.cross_entropy_loss, which take (output, batch)
        """
        output = self.forward(model, batch)
        try:
            return self.loss(output, batch)
        except (AttributeError, TypeError) as e:
            if isinstance(batch, Tensor):  # nothing to mistake for a target: the loss's own bug
                raise
            raise TypeError(
                f"Scenario {self.name!r}: loss(output, batch) raised {type(e).__name__}: {e}. "
                f"A Scenario's loss is called with the model's output and the whole batch "
                f"(here {_shape_of(batch)}), not the target alone: write loss=lambda output, "
                f"batch: F.mse_loss(output, batch[1]), or use fakepg.zoo.mse_loss / "
                f"fakepg.zoo.cross_entropy_loss, which take (output, batch)") from e


def _shape_of(batch: Any) -> str:
    """A batch described for an error message: ``a tuple of Tensor[3, 2], int``."""
    def one(x: Any) -> str:
        return f"Tensor{list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {', '.join(one(x) for x in batch)}"
    if isinstance(batch, dict):
        return f"a dict of {', '.join(f'{k}: {one(v)}' for k, v in batch.items())}"
    return one(batch)


def ddp_options(bucket_cap_mb: float | None, **extra: Any) -> dict[str, Any]:
    """DDP keyword arguments for a scenario factory's ``bucket_cap_mb`` (None: DDP's default)."""
    # Leave bucket_cap_mb out when None: passing it explicitly changes DDP's first-bucket size
    # (dist._DEFAULT_FIRST_BUCKET_BYTES applies only when the cap is left at its default).
    return ({"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb is not None else {}) | extra
