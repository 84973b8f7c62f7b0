"""What a run produced: the :class:`Timeline` (per-rank lanes; the one place iteration time,
exposed communication and breakdowns are computed), its exports, and the results of both
engines (:class:`SimResult`, :class:`ReplayResult`), which share one shape."""

from .export import write_csv
from .perrank import PerRank
from .results import ReplayResult, RunResult, SimResult
from .sweeps import SweepResult
from .timeline import COMPUTE_KINDS, CommSpan, IterationStats, Lane, Span, Timeline

__all__ = ["Timeline", "Lane", "Span", "CommSpan", "PerRank", "IterationStats", "COMPUTE_KINDS",
           "RunResult", "SimResult", "ReplayResult", "SweepResult", "write_csv"]
