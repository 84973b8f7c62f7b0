"""Single-process reference: what DDP computes, by the mathematics of data parallelism alone.

Per iteration, each rank's loss is evaluated on its own batch with the same parameters; the
gradient applied is the rank-ordered sum of ``grad_r * (1 / world_size)`` (DDP scales each local
gradient, then allreduce-sums; fakepg sums in rank order), followed by one optimizer step.  So the
reference equals DDP up to floating-point reduction order, and bit for bit where the backend also
reduces in rank order. It runs with the intra-op thread count a rank of ``fakepg.spawn`` (and a
torchrun worker) starts with: ``OMP_NUM_THREADS``, or one thread when ``world_size`` > 1
(thread-count-sensitive kernels, such as BatchNorm's statistics, differ in the last bits).

Buffers are modelled per rank, as DDP keeps them: with ``broadcast_buffers``/
``forward_sync_buffers`` (default on) every rank's buffers are overwritten by the authoritative
rank's (rank 0; under Join the highest still-active rank) before each forward, so gradients of
models that *read* buffers match too.  Unequal batch counts follow ``Join``'s default semantics.

>>> from fakepg import zoo
>>> state = zoo.reference_train(zoo.get("mlp", depth=2, iterations=2), world_size=2)
>>> sorted(state)[:2]
['l0.bias', 'l0.weight']
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import Tensor

from .scenario import Scenario
from .training import run_iterations

__all__ = ["reference_train"]

# DDP arguments that change scheduling or bucketing but not the mathematics the reference models.
_NEUTRAL_DDP_KWARGS = frozenset({
    "bucket_cap_mb", "bucket_cap_mb_list", "find_unused_parameters", "static_graph",
    "gradient_as_bucket_view", "broadcast_buffers", "forward_sync_buffers", "init_sync",
    "device_ids", "output_device", "dim", "process_group", "check_reduction",
    "delay_all_reduce_named_params", "param_to_hook_all_reduce", "batched_grad_copy",
})


@contextlib.contextmanager
def _as_a_rank_threads(world_size: int) -> Iterator[None]:
    """The intra-op threads a rank starts with (fakepg.world.isolation.rank_threads: the zoo
    imports only torch), the caller's back after."""
    callers = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    want = int(omp) if omp.isdigit() and int(omp) > 0 else (1 if world_size > 1 else callers)
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(callers)


def _forward_sync_buffers(ddp_kwargs: dict[str, Any]) -> bool:
    # forward_sync_buffers (2.13) wins over the deprecated broadcast_buffers; both default on.
    if ddp_kwargs.get("forward_sync_buffers") is not None:
        return bool(ddp_kwargs["forward_sync_buffers"])
    if ddp_kwargs.get("broadcast_buffers") is not None:
        return bool(ddp_kwargs["broadcast_buffers"])
    return True


def _average(grads: list[Tensor | None], div: int) -> Tensor | None:
    present = [g for g in grads if g is not None]
    if not present:
        return None  # unused on every rank: DDP leaves .grad untouched (None after zero_grad)
    total = None
    for g in present:  # rank order, as fakepg reduces
        # Dense: the Reducer multiplies by 1/div while copying into the bucket; sparse: div_.
        part = g / div if g.is_sparse else g * (1.0 / div)
        total = part if total is None else total + part
    return total


@torch.no_grad()
def _copy_into(tensors: list[Tensor], values: list[Tensor]) -> None:
    for t, v in zip(tensors, values):
        t.copy_(v)


class _DataParallelGradients:
    """The gradient rule of :func:`run_iterations` for the reference: one iteration's
    ``(rank, batch)`` pairs in, the averaged gradient of every rank's loss in ``.grad``."""

    def __init__(self, scenario: Scenario, model: torch.nn.Module, world_size: int, join: bool,
                 divide_by_initial_world_size: bool):
        self.scenario, self.model, self.world_size, self.join = scenario, model, world_size, join
        self.divide_by_initial = divide_by_initial_world_size
        # DDP reduces only parameters that require grad; parameters() already drops tied duplicates.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sync = _forward_sync_buffers(scenario.ddp_kwargs) and any(True for _ in model.buffers())
        # Each rank's own copy of the buffers; model construction is identical on all ranks.
        self.rank_buffers = [[b.detach().clone() for b in model.buffers()] for _ in range(world_size)]

    def __call__(self, step: list[tuple[int, Any]]) -> None:
        model, active = self.model, [r for r, _ in step]
        if self.sync:
            # DDP broadcasts buffers from the authoritative rank before forward: rank 0, or under
            # Join the highest rank not yet joined (_find_common_rank takes a MAX).
            src = max(active) if self.join else 0
            self.rank_buffers = [[b.clone() for b in self.rank_buffers[src]]
                                 for _ in range(self.world_size)]
        per_rank: list[tuple[Tensor | None, ...]] = []
        for r, batch in step:
            _copy_into(list(model.buffers()), self.rank_buffers[r])
            loss = self.scenario.step(model, batch)
            per_rank.append(torch.autograd.grad(loss, self.params, allow_unused=True))
            # Re-read: a forward may rebind a buffer attribute instead of updating it in place.
            self.rank_buffers[r] = [b.detach().clone() for b in model.buffers()]
        div = self.world_size if (not self.join or self.divide_by_initial) else len(active)
        for j, p in enumerate(self.params):
            p.grad = _average([g[j] for g in per_rank], div)


def reference_train(
    scenario: Scenario,
    world_size: int,
    *,
    rank: int = 0,
    join: bool | None = None,
    divide_by_initial_world_size: bool = True,
) -> dict[str, Tensor]:
    """Train ``scenario`` as DDP would on ``world_size`` ranks; return rank ``rank``'s final
    ``state_dict`` (parameters are equal on all ranks; buffers may not be).

    Args:
        join: model ``Join`` (uneven inputs).  ``None``: only when batch counts differ.
        divide_by_initial_world_size: Join's option: divide by the initial world size (default)
            or by the number of ranks still active.

    Raises:
        ValueError: the scenario is not ``reference_ok``, its ``ddp_kwargs`` change the
            mathematics (comm hooks, mixed precision, ...), or counts differ with ``join=False``.

    >>> import torch
    >>> from fakepg import zoo
    >>> sc = zoo.get("mlp", depth=2, iterations=1)
    >>> one = zoo.reference_train(sc, 1)
    >>> torch.equal(one["l0.weight"], zoo.reference_train(sc, 1)["l0.weight"])
    True
    """
    if not scenario.reference_ok:
        raise ValueError(f"scenario {scenario.name!r} is not reference_ok")
    unmodelled = sorted(set(scenario.ddp_kwargs) - _NEUTRAL_DDP_KWARGS)
    if unmodelled:
        raise ValueError(f"reference_train does not model ddp_kwargs {unmodelled}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")

    inputs = [scenario.inputs(r, world_size) for r in range(world_size)]
    counts = [len(b) for b in inputs]
    uneven = len(set(counts)) > 1
    join = uneven if join is None else join
    if uneven and not join:
        raise ValueError(f"batch counts {counts} differ: DDP needs Join (pass join=True)")

    with _as_a_rank_threads(world_size):
        model = scenario.build_model()
        model.train()
        rule = _DataParallelGradients(scenario, model, world_size, join, divide_by_initial_world_size)
        # Iteration i: the (rank, batch) pairs of the ranks that still have a batch i.
        iterations = [[(r, inputs[r][i]) for r in range(world_size) if i < counts[r]]
                      for i in range(max(counts, default=0))]
        run_iterations(scenario.optimizer(model.parameters()), iterations, gradients=rule)

    final = rank
    if join and rule.sync:
        # Join's _sync_final_model broadcasts from the highest rank among the last to finish.
        final = max(r for r in range(world_size) if counts[r] == max(counts))
    _copy_into(list(model.buffers()), rule.rank_buffers[final])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
