"""``torch.multiprocessing.spawn``/``start_processes`` called by a rank *process*
(``isolation="process"``).

Real ones would start real processes that rendezvous over real gloo (Lightning's
``ddp_spawn``, the DDP getting-started tutorial), bypassing the fake cluster at 20x the
cost. In a rank process they start a new fake world instead, of ``nprocs`` ranks running
``fn(rank, *args)`` as processes forked from the launching rank's; the launching rank waits
for it to end (as ``join=True`` does; with ``join=False`` the returned context is already
joined). A failure, hang or mismatch in the spawned world fails the launching rank with
fakepg's error and report.

Not in thread mode: there a rank's ``mp.spawn`` still starts real processes (a Lightning
``ddp_spawn`` run in a world nested in a rank *thread* was seen to hang; see docs/process-mode.md), with a
:class:`~fakepg.RealProcessesWarning` that says so (:func:`warn_in_threads`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Sequence
from unittest import mock

import torch.multiprocessing as _mp

_ORIGINAL_START = _mp.start_processes

# Runs a whole nested world to its end: fn, args, nprocs, *, seed, isolation, master_port (given
# by the launcher, fakepg.launch.spawn.spawn_nested, which sits above this room)
StartWorld = Callable[..., Any]


class FinishedContext:
    """What ``start_processes(join=False)`` returns: its world has already ended."""

    def __init__(self, nprocs: int):
        self.nprocs = nprocs
        self.processes: list[Any] = []

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        return True

    def pids(self) -> list[int]:
        return [os.getpid()] * self.nprocs


def _make(isolation: str, start_world: StartWorld) -> Callable[..., Any]:
    def start_processes(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1,
                        join: bool = True, daemon: bool = False, start_method: str = "spawn"):
        from .remote import rank as remote_rank
        from ..world.binding import current_cluster

        if current_cluster() is None and remote_rank.current() is None:  # not on a rank: real one
            return _ORIGINAL_START(fn, args, nprocs, join, daemon, start_method)
        binding = current_cluster()
        seed = binding[0].seed if binding is not None else _seed_in_rank_process()
        port = int(os.environ.get("MASTER_PORT", "29500") or 29500)
        start_world(fn, args, nprocs, seed=seed, isolation=isolation, master_port=port)
        return None if join else FinishedContext(nprocs)

    return start_processes


def _seed_in_rank_process() -> int:
    from .remote import rank as remote_rank
    return remote_rank.seed()


def _install(stack: contextlib.ExitStack, start: Callable[..., Any]) -> None:
    """``start`` as torch.multiprocessing's start_processes, and spawn on top of it."""
    def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        return start(fn, args, nprocs, join, daemon, start_method)

    module = sys.modules["torch.multiprocessing.spawn"]
    for target in (_mp, module):
        stack.enter_context(mock.patch.object(target, "start_processes", start))
        stack.enter_context(mock.patch.object(target, "spawn", spawn))


def patch(stack: contextlib.ExitStack, isolation: str, start_world: StartWorld) -> None:
    """Route the program's ``torch.multiprocessing`` launches to nested fake worlds, each run
    by ``start_world``."""
    _install(stack, _make(isolation, start_world))


def warn_in_threads(stack: contextlib.ExitStack) -> None:
    """In a thread-mode world, a rank's ``torch.multiprocessing`` launch starts real processes
    on the real backend: say so, once per launch, and what keeps them on the fake cluster."""
    import warnings

    from ..errors import RealProcessesWarning
    from ..sites import user_site
    from ..world.binding import current_cluster

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        binding = current_cluster()
        if binding is not None:
            warnings.warn(RealProcessesWarning(
                f"rank {binding[1]}: torch.multiprocessing starts {nprocs} real process(es) at "
                f"{user_site()}; they run on the real backend, outside the fake cluster "
                f"(unchecked, not deterministic, slower). Run the world with "
                f"isolation=\"process\" (fakerun --isolation process) to make them a fake "
                f"world."), stacklevel=2)
        return _ORIGINAL_START(fn, args, nprocs, join, daemon, start_method)

    _install(stack, start_processes)
