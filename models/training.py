"""The zoo's one training loop over a :class:`~fakepg.zoo.scenario.Scenario`.

Every harness trains a scenario the same way: :class:`TrainLoop` on a process group (fakepg's,
gloo, NCCL; the conformance runner's default), :func:`~fakepg.zoo.reference_train` with the
data-parallel gradient rule in place of DDP, and timing captures that watch the phases of each
iteration through ``on_event``::

    from fakepg import zoo
    sc = zoo.get("uneven_inputs")
    model = zoo.TrainLoop()(sc, rank, world_size)     # inside an initialised world; Join: counts differ

    loop = zoo.TrainLoop()                            # or step by step, e.g. to hook the model first
    model = loop.build(sc, bucket_cap_mb=1)
    loop.run(model, sc, sc.inputs(rank, world_size), join=loop.joins(sc, world_size),
             on_event=lambda event, i: print(event, i))   # start, forward, backward, step
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .scenario import _to

__all__ = ["TrainLoop", "TrainEvent", "run_iterations"]

TrainEvent = Literal["start", "forward", "backward", "step"]
OnEvent = Callable[[TrainEvent, int], None]


def _ignore(event: TrainEvent, iteration: int) -> None:
    pass


def run_iterations(optimizer: torch.optim.Optimizer, batches: Sequence[Any], *,
                   loss: Callable[[Any], Tensor] | None = None,
                   gradients: Callable[[Any], None] | None = None,
                   on_event: OnEvent | None = None) -> None:
    """One optimizer step per batch: the iteration every harness runs.

    Per batch ``i``: ``on_event("start", i)``, ``optimizer.zero_grad(set_to_none=True)``, then
    either ``loss(batch)`` (``on_event("forward", i)``) and its ``.backward()``, or
    ``gradients(batch)``, a rule that sets the parameters' ``.grad`` itself (forward included,
    so no ``"forward"`` event); then ``on_event("backward", i)``, ``optimizer.step()``,
    ``on_event("step", i)``. Exactly one of ``loss`` and ``gradients`` is given.
    """
    if (loss is None) == (gradients is None):
        raise ValueError("run_iterations: pass exactly one of loss= and gradients=")
    emit = on_event or _ignore
    for i, batch in enumerate(batches):
        emit("start", i)
        optimizer.zero_grad(set_to_none=True)
        if loss is not None:
            value = loss(batch)
            emit("forward", i)
            value.backward()
        else:
            gradients(batch)
        emit("backward", i)
        optimizer.step()
        emit("step", i)


def _build_model(scenario: Any) -> nn.Module:
    if hasattr(scenario, "build_model"):
        return scenario.build_model()
    with torch.random.fork_rng(devices=[]):  # duck-typed scenarios: model() plus seed
        torch.manual_seed(getattr(scenario, "seed", 0))
        return scenario.model()


@dataclass(frozen=True)
class TrainLoop:
    """DDP training of a scenario on one rank; picklable, with optional comm hook and Join.

    ``TrainLoop(...)(scenario, rank, world_size, device) -> DistributedDataParallel`` builds the
    model (:meth:`build`), moves this rank's batches to ``device`` and runs them (:meth:`run`).
    The scenario is a :class:`~fakepg.zoo.Scenario` or anything with its ``build_model()`` (or
    ``model()`` plus ``seed``), ``inputs(rank, world_size)``, ``step``, ``optimizer`` and
    ``ddp_kwargs``; optional ``comm_hook``, ``hook_state``, ``join`` and ``batch_counts``.

    Args:
        comm_hook: registered with ``model.register_comm_hook(state, comm_hook)``; default: the
            scenario's ``comm_hook`` attribute if it has one, else none.
        hook_state: ``hook_state(process_group) -> state`` (e.g.
            ``functools.partial(PowerSGDState, matrix_approximation_rank=1)``); ``None``: state
            ``None``.
        join: run under ``torch.distributed.algorithms.Join``. ``None``: the scenario's ``join``
            attribute if it has one, else exactly when the ranks' batch counts differ.
    """

    comm_hook: Callable[..., Any] | None = None
    hook_state: Callable[[Any], Any] | None = None
    join: bool | None = None

    def __call__(self, scenario: Any, rank: int, world_size: int,
                 device: torch.device | str | None = None, *,
                 on_event: OnEvent | None = None) -> nn.Module:
        device = torch.device("cpu" if device is None else device)
        model = self.build(scenario, device)
        batches = [_to(b, device) for b in scenario.inputs(rank, world_size)]
        self.run(model, scenario, batches, join=self.joins(scenario, world_size), on_event=on_event)
        return model

    def build(self, scenario: Any, device: torch.device | str | None = None,
              **ddp_kwargs: Any) -> nn.Module:
        """The scenario's model on ``device`` (CPU by default) in ``DistributedDataParallel``
        with the scenario's ``ddp_kwargs`` updated by ``ddp_kwargs``, comm hook registered."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        device = torch.device("cpu" if device is None else device)
        kwargs = {**dict(getattr(scenario, "ddp_kwargs", None) or {}), **ddp_kwargs}
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device.index])
        model = DDP(_build_model(scenario).to(device), **kwargs)
        hook = self.comm_hook or getattr(scenario, "comm_hook", None)
        if hook is not None:
            factory = self.hook_state or getattr(scenario, "hook_state", None)
            model.register_comm_hook(factory(model.process_group) if factory else None, hook)
        return model

    def joins(self, scenario: Any, world_size: int) -> bool:
        """Whether :meth:`__call__` runs under Join (see ``join``)."""
        join = self.join if self.join is not None else getattr(scenario, "join", None)
        if join is not None:
            return bool(join)
        if hasattr(scenario, "batch_counts"):
            counts = scenario.batch_counts(world_size)
        else:
            counts = [len(scenario.inputs(r, world_size)) for r in range(world_size)]
        return len(set(counts)) > 1

    def run(self, model: nn.Module, scenario: Any, batches: Sequence[Any], *, join: bool = False,
            on_event: OnEvent | None = None) -> None:
        """Train ``model`` on ``batches`` (already on the model's device) with the scenario's
        optimizer and step, under ``Join([model])`` when ``join``; see :func:`run_iterations`."""
        from torch.distributed.algorithms.join import Join

        optimizer = scenario.optimizer(model.parameters())
        with Join([model]) if join else contextlib.nullcontext():
            run_iterations(optimizer, batches, loss=functools.partial(scenario.step, model),
                           on_event=on_event)
