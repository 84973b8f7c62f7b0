"""``simddp plan``: find the fastest layout that fits, from the real program.

::

    from simddp.plan import plan
    result = plan("llama3-70b", gpus=256, gpu="h100", network="dgx-h100", seq_len=8192,
                  global_batch=1024)
    print(result.table())                 # the top layouts: tokens/s, MFU, memory, bubble
    result.to_json("plan.json")           # every layout evaluated or pruned, with its reason

The layouts are those torch can run (:mod:`~simddp.plan.space`), pruned by rules and memory
first, then replayed from captures of torch's real FSDP2, tensor-parallel plan and pipelining
schedules (:mod:`~simddp.plan.evaluate`, :mod:`~simddp.plan.search`); the report
(:mod:`~simddp.plan.report`) gives each winner's ``simddp whatif`` line and torchtitan TOML.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from . import report
from .search import OBJECTIVES, Candidate, plan as _search
from .space import AC_MODES, SCHEDULES, Layout, Shape

__all__ = ["plan", "PlanResult", "Candidate", "Layout", "Shape", "OBJECTIVES", "SCHEDULES",
           "AC_MODES"]


@dataclass
class PlanResult:
    """Every candidate layout (``candidates``), the best feasible ones (``top``), what the
    search did (``facts``: layouts, captures, replays, seconds) and what was asked
    (``question``)."""

    candidates: list[Candidate]
    top: list[Candidate]
    facts: dict[str, Any]
    question: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        return report.table(self.top)

    def whatif_line(self, c: Candidate) -> str:
        q = self.question
        return report.whatif_line(c, model=q["model"], gpu=q["gpu"], network=q["network"],
                                  seq_len=q["seq_len"], global_batch=q["global_batch"])

    def torchtitan_toml(self, c: Candidate) -> str:
        return report.torchtitan_toml(c, seq_len=self.question["seq_len"],
                                      global_batch=self.question["global_batch"])

    def pruned(self) -> str:
        return report.pruned_summary(self.candidates)

    def to_json(self, path: str | os.PathLike) -> str:
        return report.write_json(path, self.candidates, self.top,
                                 {**self.facts, "question": self.question})

    def plot(self, path: str | os.PathLike) -> str:
        q = self.question
        return report.plot_pareto(path, self.candidates, memory_limit_gib=q["gpu_memory_gib"],
                                  title=f"simddp plan: {q['model']} on {q['gpus']} {q['gpu']}, "
                                        f"seq {q['seq_len']}, batch {q['global_batch']}")


@dataclass(frozen=True)
class LlamaWorkload:
    """A zoo Llama at ``seq_len`` as the search builds it: ``batch_size`` sequences, the model
    cut to ``n_layers`` blocks for a shallow pipeline (picklable: captures may run in other
    processes)."""

    model: str
    seq_len: int

    def args(self) -> Any:
        from fakepg import zoo

        args = zoo.get(self.model, seq_len=self.seq_len).model.args[0]
        if type(args).__name__ != "LlamaArgs":
            raise ValueError(f"simddp plan searches decoder layouts; {self.model!r} is not a "
                             f"Llama-style decoder")
        return args

    def __call__(self, batch_size: int, n_layers: int | None = None) -> Any:
        from fakepg import zoo
        from fakepg.zoo.llama import Llama

        s = zoo.get(self.model, seq_len=self.seq_len, batch_size=batch_size)
        if n_layers is not None:
            s = s.with_(model=functools.partial(Llama, dataclasses.replace(self.args(),
                                                                           n_layers=n_layers)))
        return s


def plan(model: str, *, gpus: int, gpu: str = "h100", network: str = "dgx-h100",
         gpus_per_node: int | None = None, seq_len: int = 8192, global_batch: int,
         objective: str = "tokens-per-s", top: int = 5, gpu_memory_gib: float | None = None,
         executor: concurrent.futures.Executor | None = None,
         status: Callable[[str], None] | None = None, **space: Any) -> PlanResult:
    """Search the layouts of ``model`` (a zoo Llama, e.g. "llama3-70b") on ``gpus`` GPUs of
    kind ``gpu`` on ``network`` for ``global_batch`` sequences of ``seq_len`` tokens per step;
    see the module docstring. ``space``: options of :func:`simddp.plan.space.layouts` (e.g.
    ``ac_modes=("full",)``, ``microbatch_sizes=(1,)``, ``max_pp=8``)."""
    from ..models import Compute, Network
    from ..timing import Timing
    from ..models.compute import gpu_spec

    dev = gpu_spec(gpu)  # a preset, or PRESET,field=value...
    net = Network.preset(network) if isinstance(network, str) else network
    per_node = gpus_per_node or net.gpus_per_node or 8
    mem = gpu_memory_gib if gpu_memory_gib is not None else dev.memory_GB * 1e9 / (1 << 30)  # as cards are sold (GiB)
    scenario = LlamaWorkload(model, seq_len)
    shape = Shape.of_llama(model, scenario.args())
    timing = Timing(network=net, compute=Compute.kernels(gpu))  # whatif's default model
    cands, best, facts = _search(shape, scenario, gpus=gpus, gpus_per_node=per_node,
                                 seq_len=seq_len, global_batch=global_batch, timing=timing,
                                 network=net, memory_bytes=int(mem * (1 << 30)),
                                 peak_flops=dev.fp16_tflops * 1e12, objective=objective,
                                 top=top, executor=executor, status=status, **space)
    question = dict(model=model, gpus=gpus, gpu=gpu, network=network if isinstance(network, str)
                    else net.name, seq_len=seq_len, global_batch=global_batch,
                    objective=objective, gpu_memory_gib=mem)
    return PlanResult(cands, best, facts, question)
