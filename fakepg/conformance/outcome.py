"""What a run of a scenario leaves behind, in a backend-independent form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

__all__ = ["RecordedCollective", "ScenarioOutcome"]


class RecordedCollective(NamedTuple):
    """One collective as both sides can observe it: ``(op, group_ranks, shapes, dtypes)``."""

    op: str
    group_ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def describe(self, world_size: int | None = None) -> str:
        """``all_reduce([(90,)], float32)``; the group is named when it is not the whole world."""
        dt = ", ".join(dict.fromkeys(self.dtypes)) or "-"
        text = f"{self.op}({list(self.shapes)}, {dt})"
        if world_size is None or tuple(self.group_ranks) != tuple(range(world_size)):
            text += f" on ranks {list(self.group_ranks)}"
        return text


@dataclass
class ScenarioOutcome:
    """What one run of a scenario left behind, per rank, in a backend-independent form.

    ``collectives``, ``ddp_logging`` and ``states`` may be ``None`` (e.g. an outcome built from
    a single-process reference has only ``states``); :func:`~fakepg.conformance.compare` skips
    what either side lacks.
    """

    scenario: str
    backend: str
    world_size: int
    collectives: list[list[RecordedCollective]] | None
    ddp_logging: list[dict[str, Any]] | None
    states: list[dict[str, torch.Tensor]] | None
    param_names: frozenset[str] = frozenset()
    wall_time: float = 0.0
    launch_time: float = 0.0
    device: str = "cpu"
    seed: int = 0

    @classmethod
    def from_states(cls, states: Sequence[dict[str, torch.Tensor]], *, backend: str = "reference",
                    scenario: str = "", param_names: Sequence[str] = ()) -> "ScenarioOutcome":
        """An outcome holding final states only (e.g. from ``fakepg.zoo.reference_train``)."""
        return cls(scenario=scenario, backend=backend, world_size=len(states), collectives=None,
                   ddp_logging=None, states=[{k: v.detach().cpu() for k, v in s.items()} for s in states],
                   param_names=frozenset(param_names))

    def summary(self) -> str:
        """One line: scenario, backend, world, device, collectives per rank, times."""
        n = [len(c) for c in self.collectives] if self.collectives is not None else None
        return (f"{self.scenario} on {self.backend} x{self.world_size} ({self.device}): "
                f"collectives per rank {n}, {self.wall_time:.2f} s"
                + (f" (+{self.launch_time:.2f} s launch)" if self.launch_time else ""))
