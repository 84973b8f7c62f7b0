"""NCCL's fixed latency per collective, by algorithm and protocol, chosen by message size.

NCCL's tuning model (``src/graph/tuning.cc``) costs a collective as ``baseLat[algorithm]
[protocol] + steps · hwLat + bytes / bandwidth(algorithm, protocol)``. simddp's α–β network
models the steps' latency (α) and the bandwidth; :class:`ProtocolLatency` adds the fixed
``baseLat`` NCCL charges once per collective, for the protocol NCCL would pick:

* LL moves 8 bytes of data per 16-byte line (a flag in the other half): half the bandwidth;
* LL128 moves 120 of every 128 bytes: 15/16 of it;
* Simple, the full bandwidth, at a higher fixed latency.

So per collective it adds ``min over protocols of baseLat_p + (1/efficiency_p − 1) · β``,
where ``β`` is the bandwidth part of the inner network's time (its time at these bytes minus
its time at zero bytes): small messages pay LL's 6.6 µs, large ones Simple's 8.4 µs. One
rank's collective costs nothing (NCCL: nRanks == 1). Table: NCCL 2.19–2.2x tuning.cc
("Latencies in us"): Tree {LL 6.8, LL128 14.0, Simple 8.4}, Ring {LL 6.6, LL128 14.0,
Simple 8.4}, NVLS {Simple 23.0}.

>>> from simddp.models import Network
>>> net = ProtocolLatency(Network(bandwidth_GBps=10.0, latency_us=0.0, algorithm="ring"))
>>> round((net.collective_time("all_reduce", 8, 2) - net.inner.collective_time("all_reduce", 8, 2)) * 1e6, 1)
6.6
"""

from __future__ import annotations

from typing import Any

from .protocols import collective_time, placed

__all__ = ["BASE_LATENCY_US", "PROTOCOL_EFFICIENCY", "ProtocolLatency", "base_latency_s"]

BASE_LATENCY_US: dict[str, dict[str, float]] = {
    "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4},
    "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
    "nvls": {"Simple": 23.0},
}
PROTOCOL_EFFICIENCY = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}


def base_latency_s(algorithm: str, beta_s: float) -> float:
    """NCCL's fixed cost (s) plus the protocol's bandwidth penalty, for the cheapest protocol
    of ``algorithm`` on a collective whose bandwidth term at full efficiency is ``beta_s``."""
    table = BASE_LATENCY_US.get(algorithm, BASE_LATENCY_US["ring"])
    return min(us * 1e-6 + (1.0 / PROTOCOL_EFFICIENCY[p] - 1.0) * beta_s
               for p, us in table.items())


class ProtocolLatency:
    """``inner`` (a :class:`~simddp.models.NetworkModel`) plus NCCL's per-collective base
    latency (see the module docstring); every other attribute is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def gpus_per_node(self) -> int | None:
        return self.inner.gpus_per_node

    def placed(self, per_node: int) -> ProtocolLatency:
        """``inner`` placed (:meth:`simddp.Network.placed`), with the same base latency."""
        inner = placed(self.inner, per_node)
        if inner is self.inner:
            return self
        cache = self.__dict__.setdefault("_placed", {})
        net = cache.get(per_node)
        if net is None:
            net = cache[per_node] = ProtocolLatency(inner)
        return net

    def collective_time(self, op: str, nbytes: int, nranks: int) -> float:
        t = collective_time(self.inner, op, nbytes, nranks)
        if nranks <= 1:
            return t
        beta = max(0.0, t - collective_time(self.inner, op, 0, nranks))
        chosen = getattr(self.inner, "chosen_algorithm", None)
        algo = chosen(op, nbytes, nranks) if chosen is not None else "ring"
        return t + base_latency_s(str(algo), beta)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "protocol_latency": True}
