"""Equivalence classes of ranks: the ranks replay can simulate once for all.

Ranks that nothing in the replay model tells apart follow identical trajectories; the simpy
engine (:class:`~simddp.replay.simpy_engine._Replay`) simulates one representative per class.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["classes"]


def classes(world: int, base: tuple[Any, int], speeds: Mapping[int, float],
            kinds: Mapping[int, Any], noisy: bool, enabled: bool
            ) -> tuple[Any, list[int] | range]:
    """Ranks grouped into equivalence classes: ``(rank_class, representatives)``.

    Two ranks behave identically in replay when nothing tells them apart: ``base`` (per rank
    an integer code and the number of codes: the profile they replay and the communicators
    that matter, from the program's mesh, :meth:`~simddp.program.mesh.Mesh.class_code`), their
    speed, and their kind of instructions (``kinds``: the program's ranks that run other
    instructions, e.g. fewer iterations with uneven inputs). Their issue times, waits and
    spans are then equal, and one representative (the class's lowest rank) stands for all: it
    arrives at a collective once for its whole class. Returns ``(None, range(world))`` — one
    lane per rank, the per-rank simulation — when classes are disabled, when per-rank noise
    (``jitter``) makes every rank distinct, or when no two ranks are alike. ``rank_class``: a
    numpy integer array, the class of each rank; classes are numbered in order of their
    lowest rank.
    """
    if not enabled or noisy or world <= 1:
        return None, range(world)
    import numpy as np

    code = base[0].copy()
    special = sorted(set(speeds) | set(kinds))
    if special:  # a few listed ranks: their (speed, kind) as one more digit
        seen: dict[tuple, int] = {}
        idx = np.array(special, dtype=np.int64)
        ks = [seen.setdefault((float(speeds.get(r, 1.0)), kinds.get(r)), len(seen) + 1)
              for r in special]
        digit = np.zeros(world, dtype=np.int64)
        digit[idx] = ks
        code = code * (len(seen) + 1) + digit
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    if len(first) == world:
        return None, range(world)
    order = np.argsort(first, kind="stable")  # classes in order of their lowest rank
    renumber = np.empty_like(order)
    renumber[order] = np.arange(len(order))
    dtype = np.int32 if len(first) < 2**31 else np.int64
    rank_class = renumber[inverse.reshape(-1)].astype(dtype)
    return rank_class, first[order].tolist()
