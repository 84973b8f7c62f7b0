"""The communicators of the simpy replay engine (:mod:`~simddp.replay.simpy_engine`).

:class:`Communicators`, a mixin of :class:`~simddp.replay.simpy_engine._Replay`: each communicator
of the program's mesh (DDP's groups and node subgroups, FSDP's shard and replicate groups…),
the collectives enqueued on them in program order with their sequence numbers and durations
(the network's time for the communicator's size and placement: how many of its members share
a node and which fabric tiers it spans, :meth:`~simddp.program.mesh.Mesh.placement`), and a lane's arrivals at them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import collective_time
from ..core import CollectiveProcess

__all__ = ["Communicators"]


class Communicators:
    """Collectives on communicators; the host provides ``net``, ``mesh`` (the program's
    :class:`~simddp.program.mesh.Mesh`), ``rep``, ``fabric``, ``env``, ``net_noise`` and
    ``comms`` (per lane: its collectives and their issue times)."""

    def _init_communicators(self, reps: Sequence[int]) -> None:
        """Per communicator: how many lanes arrive at each of its collectives; no collective
        yet."""
        mesh = self.mesh
        self.lanes_in: dict[Any, int] = {}
        for r in reps:
            for scope in mesh.scopes:
                key = mesh.key(r, scope)
                self.lanes_in[key] = self.lanes_in.get(key, 0) + 1
        self.colls: dict[tuple, CollectiveProcess] = {}
        self.placements: dict[Any, Any] = {}  # per communicator: its Placement (or None)
        self.order: list[CollectiveProcess] = []
        self.seq: dict[Any, int] = {}

    def _net_factor(self) -> float:
        return 1.0 if self.net_noise is None else self.net_noise.next()

    def enqueue(self, r: int, tag: tuple, scope: str, op: str, nbytes: int,
                in_backward: bool = False) -> CollectiveProcess:
        """The collective ``tag`` on rank r's communicator, created (taking the communicator's
        next sequence number, queued behind everything enqueued before it) by its first
        member to enqueue it; no member has arrived at it yet (see :meth:`arrive`)."""
        mesh, rank = self.mesh, self.rep[r]
        key = mesh.key(rank, scope)
        name = (key, *tag)
        c = self.colls.get(name)
        if c is None:
            members = mesh.members(rank, scope)
            n = len(members)
            place = self.placements.get(key, self)  # nodes and tiers it spans, once per key
            if place is self:
                place = self.placements[key] = mesh.placement(rank, scope, self.net)
            dur = collective_time(self.net, op, nbytes, n, place) * self._net_factor() \
                if n > 1 else 0.0
            seq = self.seq.get(key, 0)
            self.seq[key] = seq + 1
            group = mesh.label(key)
            info = {"name": "/".join(str(x) for x in (group, *tag)), "op": op, "group": group,
                    "members": members, "seq": seq, "bytes": int(nbytes),
                    "in_backward": in_backward, "scope": mesh.dimension(scope)}
            # the collective waits for one arrival per lane (a class's representative
            # arrives for all of its ranks), and lasts as long as its real group size says
            c = self.colls[name] = self.fabric.collective(
                key, self.lanes_in[key], dur, links=mesh.links(rank, scope), info=info)
            self.order.append(c)
        return c

    def arrive(self, r: int, c: CollectiveProcess) -> CollectiveProcess:
        """Rank r issues ``c`` now: its data is ready, the collective may start."""
        c.arrive()
        self.comms[r].append((c, self.env.now))
        return c
