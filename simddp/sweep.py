"""Sweeps: replay a capture over a grid of knobs, one table row per combination, here or on
any ``concurrent.futures.Executor`` (a process pool, a Dask cluster's ``client.get_executor()``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from typing import Any, Callable

from .analysis import write_csv
from .analysis.sweeps import SweepResult, row_figures
from .program.captured import CapturedIteration
from .program.knobs import Config
from .replay.replaying import replay

__all__ = ["sweep", "grid", "run_configs", "replay_row", "write_csv"]

Progress = Callable[[int, int, dict], None]


def grid(**axes: Any) -> list[dict[str, Any]]:
    """Every combination of the knob lists in ``axes`` (a non-list value is one point), in
    ``itertools.product`` order of the keywords as given.

    >>> grid(world_size=[8, 64], comm_hook=[None, "fp16"], jitter=0.0)[1]
    {'world_size': 8, 'comm_hook': 'fp16', 'jitter': 0.0}
    """
    keys = list(axes)
    values = [v if isinstance(v, (list, tuple, range)) else [v] for v in axes.values()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def replay_row(captured: CapturedIteration, config: Config,
               progress: Any = False, program: Any = None) -> dict[str, Any]:
    """One sweep row: :func:`replay` of ``config``, its :meth:`~simddp.ReplayResult.row`, the
    breakdown columns (:func:`~simddp.analysis.sweeps.row_figures`) and ``wall_time_s``.
    Module-level, so that executors in other processes can run it. ``progress``: replay's
    (no display of its own by default: the sweep reports rows); ``program``: replay's (the
    step program already planned for ``config``)."""
    res = replay(captured, config.world_size, network=config.network, knobs=config.knobs,
                 progress=progress, program=program)
    return {**res.row(), **row_figures(res.timeline), "wall_time_s": res.wall_time}


def sweep(captured: CapturedIteration, *,
          executor: concurrent.futures.Executor | None = None,
          progress: Progress | None = None, **grids: Any) -> SweepResult:
    """Replay every combination of the knob lists in ``grids`` (any keyword of :func:`replay`,
    ``world_size`` included; a non-list value is one point) and return a
    :class:`~simddp.analysis.sweeps.SweepResult`: one row per combination, in grid order.

    ``executor``: any ``concurrent.futures.Executor`` runs the replays (a
    ``ProcessPoolExecutor`` for the cores of this machine, ``dask.distributed``'s
    ``Client(address).get_executor()`` for a cluster); rows come back in grid order whatever
    order they finish in, so the result does not depend on the executor. ``progress(done,
    total, row)`` is called as each row finishes.

    >>> rows = sweep(cap, world_size=[64, 512], comm_hook=[None, "fp16"])  # doctest: +SKIP
    >>> print(rows.table()); rows.to_pandas()                             # doctest: +SKIP
    """
    configs = [Config.from_kwargs(kw) for kw in grid(**grids)]  # an unknown knob fails here
    return SweepResult(run_configs(captured, configs, executor=executor, progress=progress),
                       captured=captured, configs=[c.as_kwargs() for c in configs])


def run_configs(captured: CapturedIteration, configs: list[Config], *,
                executor: concurrent.futures.Executor | None = None,
                progress: Progress | None = None,
                replay_progress: Any = None) -> list[dict[str, Any]]:
    """:func:`replay_row` for each of ``configs``, here or on ``executor``;
    rows in the order of ``configs``. ``replay_progress(done, total, description)`` hears how
    far each replay got (here only, not on an executor)."""
    total = len(configs)
    rows: list[dict[str, Any] | None] = [None] * total
    if executor is None:
        for i, kw in enumerate(configs):
            rows[i] = replay_row(captured, kw, replay_progress or False)
            if progress is not None:
                progress(i + 1, total, rows[i])
    else:
        futures = {executor.submit(replay_row, captured, kw): i for i, kw in enumerate(configs)}
        try:
            for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                i = futures[fut]
                rows[i] = fut.result()
                if progress is not None:
                    progress(done, total, rows[i])
        finally:  # a failed row: do not leave the others running on the executor
            for fut in futures:
                fut.cancel()
    return rows  # type: ignore[return-value]
