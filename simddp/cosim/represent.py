"""Representative capture: one rank per distinct role runs, its group's collectives answered
as the whole world would answer them.

The ranks of a tensor-parallel group do the same work on their shards, and so do FSDP2's
shard and replica ranks: on the meta device (shapes, no data) their programs are the same
ops on the same shapes, issuing the same collectives at the same virtual times. So a capture
needs one of them. In a representative world every rank exists — the process groups, the
device mesh, every collective's group and size are the real ones — but only the
representatives run the program; the others (absent ranks) return at once, and fakepg's
cluster fills an absent member's part of a collective with a copy of its representative's
call (``Cluster.stand_ins``). The collective then matches, executes (meta kernels: nothing
moves) and is timed by the co-simulation exactly as with every member present: it starts at
the latest member's issue time (every member issues at its representative's time) and lasts
what the network model says for the real group and placement. Each absent rank's record is
its representative's (:func:`fill`), which is what the full world records when the ranks
are symmetric.

Symmetric means: the same program on the same shapes (FSDP2 pads its shards to equal
sizes; torchtitan's TP plan shards heads, which :func:`~simddp.cosim.tensor_parallel.
apply_tensor_parallel` checks divide), no per-rank timing (``Timing`` without jitter, rank
speeds or faults: :func:`symmetric_timing`), and a placement under which every group of a
mesh dimension spans nodes alike (:func:`symmetric_placement`). Where one of these fails the
capture runs every rank, as before. Pipeline stages are distinct roles (the first holds the
embedding, the last the head, each sends to its neighbours), so along ``"pp"`` every rank
runs; stages beyond first, middle and last are copies (:mod:`simddp.cosim.deepen`).

What a representative world costs: the work of ``len(live)`` ranks, whatever the sizes of
the dimensions they represent (:func:`executed` counts it).
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..program.mesh import ranks_per_node
from ..timing import Timing

__all__ = ["stand_ins", "symmetric_timing", "symmetric_placement", "represented", "fill",
           "executed", "SYMMETRIC_DIMS"]

# mesh dimensions whose ranks do the same work on their shards
SYMMETRIC_DIMS = ("replicate", "shard", "tp")

# per process: how many rank programs the captures ran (a cost measure for tests and
# benchmarks: it must not grow with the represented dimensions' sizes)
_EXECUTED = [0]


def executed() -> int:
    """How many rank programs the captures of this process have run so far (every world a
    capture runs goes through :func:`represented`, with or without stand-ins)."""
    return _EXECUTED[0]


def stand_ins(mesh: Mapping[str, int], symmetric: Iterable[str] = SYMMETRIC_DIMS
              ) -> dict[int, int]:
    """Absent rank → its representative, for a row-major mesh ``mesh`` (dimension → size,
    outermost first, as ``init_device_mesh`` lays it out): the representative of a rank has
    its coordinates on the other dimensions and 0 on each of ``symmetric``."""
    names, sizes = list(mesh), [int(v) for v in mesh.values()]
    sym = [i for i, d in enumerate(names) if d in set(symmetric)]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    out: dict[int, int] = {}
    for coord in itertools.product(*(range(s) for s in sizes)):
        rank = sum(c * st for c, st in zip(coord, strides))
        rep = rank - sum(coord[i] * strides[i] for i in sym)
        if rep != rank:
            out[rank] = rep
    return out


def symmetric_timing(timing: Timing) -> str | None:
    """None when ``timing`` charges every rank alike; else why not (a rank's own speed, jitter,
    a fault), so that ranks must each be run."""
    if timing.rank_speed:
        return "Timing.rank_speed slows some ranks"
    if timing.jitter or timing.net_jitter:
        return "jitter draws each rank's noise apart"
    if timing.faults:
        return "faults single out ranks or links"
    return None


def symmetric_placement(mesh: Mapping[str, int], gpus_per_node: int | None) -> str | None:
    """None when, for every dimension of ``mesh``, all its groups span the nodes alike (the
    same count of members on their busiest node, which is what a collective's cost reads), so that a representative's
    collectives cost what every group's cost; else which dimension differs."""
    if gpus_per_node is None:
        return None
    names, sizes = list(mesh), [int(v) for v in mesh.values()]
    world = math.prod(sizes)
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    for i, d in enumerate(names):
        seen = set()
        for base in range(world):
            if (base // strides[i]) % sizes[i]:
                continue  # not the first member of its group along d
            members = [base + k * strides[i] for k in range(sizes[i])]
            seen.add(ranks_per_node(members, gpus_per_node))
            if len(seen) > 1:
                return (f"the {d} groups span nodes of {gpus_per_node} GPUs differently")
    return None


def represented(fn: Callable[[int], Any], stand: Mapping[int, int]) -> Callable[[int], Any]:
    """``fn`` for a representative world: each rank tells the cluster which ranks stand for
    which (before any collective of its own), absent ranks return None at once, the others
    run ``fn`` (counted by :func:`executed`). With an empty ``stand``, every rank runs."""
    table = dict(stand)

    def run(rank: int) -> Any:
        from fakepg.world.binding import current_cluster

        cluster = current_cluster()[0]
        if cluster.stand_ins is not table:
            cluster.stand_ins = table
        if rank in table:
            return None
        _EXECUTED[0] += 1
        return fn(rank)
    return run


def fill(values: Sequence[Any], stand: Mapping[int, int]) -> list[Any]:
    """Per rank, its own value, or (a copy of) its representative's where it was absent."""
    return [copy.deepcopy(values[stand[r]]) if r in stand else values[r]
            for r in range(len(values))]


def choose(mesh: Mapping[str, int], timing: Timing, device: str, asked: bool | None,
           what: str) -> dict[int, int]:
    """The stand-in table a capture over ``mesh`` runs with: empty (every rank runs) when
    ``asked`` is False, off the meta device, or where the ranks are not symmetric (``asked``
    True then raises, saying why); else :func:`stand_ins`."""
    if asked is False:
        return {}
    why = None
    if device != "meta":
        why = "it needs the meta device (absent ranks' data would be missing)"
    else:
        net = timing.network
        why = symmetric_timing(timing) or symmetric_placement(
            mesh, getattr(net, "gpus_per_node", None))
    if why is not None:
        if asked:
            raise ValueError(f"{what}: representatives=True, but the ranks cannot stand for "
                             f"each other: {why}; capture with representatives=False")
        return {}
    return stand_ins(mesh)
