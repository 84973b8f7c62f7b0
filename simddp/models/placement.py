"""Where a communicator's members sit on a tiered fabric: its :class:`Placement`.

A fabric is a hierarchy of domains (:class:`Tier`): the node (its NVLink domain,
``gpus_per_node`` GPUs), then the tiers above it that a :class:`~simddp.Network` lists in
``tiers`` — a rail-optimised leaf group (a DGX SuperPOD scalable unit of 32 nodes), a pod, the
whole cluster — each with the oversubscription of the uplinks that leave one of its domains
(1 = full bisection). Ranks are numbered as torchrun numbers them: node k holds ranks
``k·G … k·G + G − 1``, and a tier's domain of ``gpus`` GPUs holds ``gpus`` consecutive ranks.

A communicator's :class:`Placement` is what the network costs it with
(:meth:`simddp.Network.placed`): how many of its members share its busiest node
(``per_node``), and per tier how many of that tier's domains its members span (``spans``).
It is computed in this one module, for one communicator (:func:`placement_of`, the simpy
replay and co-simulation) or for every communicator of a mesh dimension at once
(:func:`placements_of_codes`, the vectorised replay), so the engines agree by construction.

>>> from simddp import Network
>>> net = Network.preset("dgx-superpod")            # 8 GPUs a node, 32 nodes a leaf group
>>> placement_of(range(0, 256, 8), net)             # one member on each of 32 nodes, one SU
Placement(per_node=1, spans=(1,))
>>> placement_of(range(0, 512, 16), net)            # 32 nodes across two SUs
Placement(per_node=1, spans=(2,))
>>> placement_of(range(8), net)                     # a TP group inside one node
Placement(per_node=8, spans=(1,))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from fakepg.arguments import integer, number

__all__ = ["Tier", "Placement", "placement_of", "placements_of_codes", "ranks_per_node",
           "as_placement"]


@dataclass(frozen=True)
class Tier:
    """One tier of switches above the node: domains of ``gpus`` consecutive ranks (a leaf
    group, a pod), whose uplinks to the next tier carry ``1 / oversubscription`` of what the
    domain's NICs can inject (1 = full bisection; the Llama 3 cluster's aggregation layer: 7)."""

    name: str
    gpus: int
    oversubscription: float = 1.0

    def __post_init__(self) -> None:
        integer(f"Tier({self.name!r}).gpus", self.gpus, minimum=1,
                hint="GPUs in one domain of this tier, e.g. 256 for 32 DGX nodes")
        number(f"Tier({self.name!r}).oversubscription", self.oversubscription, minimum=1.0,
               hint="the ratio of injection to uplink bandwidth, 1.0 = full bisection")


@dataclass(frozen=True, order=True)
class Placement:
    """How one communicator sits on the fabric: ``per_node`` of its members share its busiest
    node; ``spans[k]`` is how many domains of the network's ``tiers[k]`` its members occupy
    (() on a fabric without tiers)."""

    per_node: int
    spans: tuple[int, ...] = ()

    def crossing(self, tiers: tuple[Tier, ...]) -> tuple[tuple[int, float], ...]:
        """(domains spanned, oversubscription) of every oversubscribed tier it crosses."""
        return tuple((d, t.oversubscription) for d, t in zip(self.spans, tiers)
                     if d > 1 and t.oversubscription > 1.0)


def as_placement(value: Placement | int) -> Placement:
    """A :class:`Placement` from itself or a bare per-node count (no tier information)."""
    if isinstance(value, Placement):
        return value
    return Placement(integer("per_node", value, minimum=1,
                             hint="how many of the communicator's ranks share one node"))


def ranks_per_node(ranks: Iterable[int], gpus_per_node: int) -> int:
    """How many of ``ranks`` share their busiest node, nodes being ``gpus_per_node``
    consecutive ranks (torchrun's layout)."""
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return max(nodes.values())


def _tiers(network: Any) -> tuple[Tier, ...]:
    return tuple(getattr(network, "tiers", ()) or ())


def placement_of(ranks: Iterable[int], network: Any) -> Placement | None:
    """The placement of the communicator of ``ranks`` on ``network`` (None on a flat fabric:
    nothing to place)."""
    G = getattr(network, "gpus_per_node", None)
    if G is None:
        return None
    ranks = list(ranks)
    spans = tuple(len({r // t.gpus for r in ranks}) for t in _tiers(network))
    return Placement(ranks_per_node(ranks, G), spans)


def placements_of_codes(code: np.ndarray, ncode: int, network: Any) -> np.ndarray | None:
    """:func:`placement_of` for every communicator of a mesh dimension at once: ``code[r]`` is
    rank r's communicator; per code its :class:`Placement` (an object array; a code no rank
    has gets the placement of an empty node count, never used), or None on a flat fabric."""
    G = getattr(network, "gpus_per_node", None)
    if G is None:
        return None
    world = len(code)
    ranks = np.arange(world, dtype=np.int64)
    code = np.asarray(code, dtype=np.int64)

    def busiest(per: int) -> np.ndarray:  # per code: members in its busiest domain of `per`
        ndom = -(-world // per)
        uniq, count = np.unique(code * ndom + ranks // per, return_counts=True)
        out = np.zeros(ncode, dtype=np.int64)
        np.maximum.at(out, uniq // ndom, count)
        return out

    def spanned(per: int) -> np.ndarray:  # per code: how many domains of `per` it occupies
        ndom = -(-world // per)
        uniq = np.unique(code * ndom + ranks // per)
        return np.bincount(uniq // ndom, minlength=ncode)

    columns = [busiest(G)] + [spanned(t.gpus) for t in _tiers(network)]
    table = np.stack(columns, axis=1).tolist()
    made: dict[tuple, Placement] = {}
    out = np.empty(ncode, dtype=object)
    for c, row in enumerate(table):
        key = tuple(row)
        p = made.get(key)
        if p is None:
            p = made[key] = Placement(max(1, row[0]), tuple(row[1:]))
        out[c] = p
    return out
