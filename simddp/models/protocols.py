"""What the engines require of a network or compute model.

Co-simulation (:func:`simddp.simulate`) and replay (:func:`simddp.replay.replay`) accept any
object that satisfies these protocols, checked with ``isinstance`` (runtime-checkable): a
network model written for one engine works in the other.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from fakepg import ops

__all__ = ["NetworkModel", "ComputeModel", "collective_time"]


@runtime_checkable
class NetworkModel(Protocol):
    """How long collectives take on a fabric.

    ``name``: a short label for tables. ``gpus_per_node``: ranks per node, or None for one
    flat fabric (replay uses it for node-local subgroups and shared NICs).
    ``collective_time(op, nbytes, nranks)``: seconds, ``op`` a name of fakepg's op registry
    (:mod:`fakepg.ops`), ``nbytes`` as :class:`simddp.Network` documents. ``describe()``: the
    model's parameters as a flat dict of JSON values (columns of sweep tables). Optional: a
    ``contention`` attribute (a :class:`~simddp.models.Contention` or None), which replay
    applies; a model without one has none. Optional: ``placed(per_node)``, the model as a
    communicator with ``per_node`` of its ranks on each node sees the fabric
    (:meth:`simddp.Network.placed`); a model without it is asked as if every communicator
    filled nodes contiguously (``gpus_per_node`` ranks a node), which is right for DDP and
    1-D FSDP and overestimates strided ones (an FSDP group across TP ranks, HSDP's replicas).
    """

    name: str
    gpus_per_node: int | None

    def collective_time(self, op: str, nbytes: int, nranks: int) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@runtime_checkable
class ComputeModel(Protocol):
    """How long one aten op takes: ``op_time(func, args, kwargs, out)`` in seconds."""

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float: ...


def collective_time(network: NetworkModel, op: str, nbytes: int, nranks: int,
                    per_node: Any = None) -> float:
    """``network.collective_time``; an op fakepg's registry does not know (a name a layer
    above invented) is costed as an all_reduce of its bytes. ``per_node``: where the
    communicator's ranks sit — a :class:`~simddp.models.placement.Placement` (its members per
    node and the fabric tiers they span) or a bare count of members per node; None =
    contiguous. A communicator with fewer than ``nranks`` members per node asks the network's
    ``placed(...)`` where it has one (see :class:`NetworkModel`), as does one that crosses an
    oversubscribed tier."""
    try:
        ops.cost_kind(op)
    except ValueError:
        op = "all_reduce"
    if per_node is not None:
        g = per_node if isinstance(per_node, int) else per_node.per_node
        if g < nranks:
            network = placed(network, per_node)
    return network.collective_time(op, nbytes, nranks)


def placed(network: NetworkModel, placement: Any) -> NetworkModel:
    """``network.placed(placement)``, or ``network`` itself for a model that does not know
    placement (the documented contiguous fallback)."""
    place = getattr(network, "placed", None)
    return network if place is None else place(placement)
