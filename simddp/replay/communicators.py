"""The communicators of the simpy replay engine (:mod:`~simddp.replay.simpy_engine`).

:class:`_Communicators`, a mixin of :class:`~simddp.replay.simpy_engine._Replay`: each DDP group's
communicator (and, with a model averager's period, each node subgroup's), the collectives
enqueued on them in program order with their sequence numbers and durations, and a lane's
arrivals at them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import collective_time
from ..core import CollectiveProcess

__all__ = ["_Communicators"]


class _Communicators:
    """Collectives on communicators; the host provides ``net``, ``world``, ``groups``,
    ``gpn``, ``rep``, ``fabric``, ``env``, ``net_noise`` and ``comms`` (per lane: its
    collectives and their issue times)."""

    def _init_communicators(self, reps: Sequence[int], shared_nic: bool) -> None:
        """Per communicator: how many lanes arrive at each of its collectives; no collective
        yet."""
        groups, gpn = self.groups, self.gpn
        self.lanes_in: dict[Any, int] = {}
        for r in reps:
            g = r % groups
            for key in (("dp", g), ("node", g, r // gpn)):
                self.lanes_in[key] = self.lanes_in.get(key, 0) + 1
        self.shared_nic = shared_nic
        self._group_links: dict[int, list[tuple[str, int]]] = {}
        self.colls: dict[tuple, CollectiveProcess] = {}
        self.order: list[CollectiveProcess] = []
        self.seq: dict[Any, int] = {}

    def _net_factor(self) -> float:
        return 1.0 if self.net_noise is None else self.net_noise.next()

    def node_members(self, g: int, node: int) -> range:
        """The ranks of DDP group g on ``node`` (a node subgroup)."""
        lo, hi = node * self.gpn, min((node + 1) * self.gpn, self.world)
        return range(lo + (g - lo) % self.groups, hi, self.groups)

    def group_links(self, g: int) -> list[tuple[str, int]]:
        """The shared NICs group g's collectives hold (``shared_nic``; none otherwise)."""
        links = self._group_links.get(g)
        if links is None:
            links = []
            if self.shared_nic:
                nodes = sorted({r // self.gpn for r in range(g, self.world, self.groups)})
                if len(nodes) > 1:
                    links = [("nic", n) for n in nodes]
            self._group_links[g] = links
        return links

    def comm_of(self, r: int, scope: str) -> tuple[Any, range, list]:
        """(communicator key, members, shared links) of lane r's DDP group or node subgroup."""
        rank = self.rep[r]
        g = rank % self.groups
        if scope == "node":
            node = rank // self.gpn
            return ("node", g, node), self.node_members(g, node), []
        return ("dp", g), range(g, self.world, self.groups), self.group_links(g)

    def enqueue(self, r: int, tag: tuple, scope: str, op: str, nbytes: int,
                in_backward: bool = False) -> CollectiveProcess:
        """The collective ``tag`` on rank r's communicator, created (taking the communicator's
        next sequence number, queued behind everything enqueued before it) by its first
        member to enqueue it; no member has arrived at it yet (see :meth:`arrive`)."""
        key, members, links = self.comm_of(r, scope)
        name = (key, *tag)
        c = self.colls.get(name)
        if c is None:
            n = len(members)
            dur = collective_time(self.net, op, nbytes, n) * self._net_factor() if n > 1 else 0.0
            seq = self.seq.get(key, 0)
            self.seq[key] = seq + 1
            group = f"dp{key[1]}" if key[0] == "dp" else f"dp{key[1]}/node{key[2]}"
            info = {"name": "/".join(str(x) for x in (group, *tag)), "op": op, "group": group,
                    "members": members, "seq": seq, "bytes": int(nbytes),
                    "in_backward": in_backward}
            # the collective waits for one arrival per lane (a class's representative
            # arrives for all of its ranks), and lasts as long as its real group size says
            c = self.colls[name] = self.fabric.collective(key, self.lanes_in[key], dur,
                                                          links=links, info=info)
            self.order.append(c)
        return c

    def arrive(self, r: int, c: CollectiveProcess) -> CollectiveProcess:
        """Rank r issues ``c`` now: its data is ready, the collective may start."""
        c.arrive()
        self.comms[r].append((c, self.env.now))
        return c

    def issue(self, r: int, tag: tuple, scope: str, op: str, nbytes: int,
              in_backward: bool = False) -> CollectiveProcess:
        return self.arrive(r, self.enqueue(r, tag, scope, op, nbytes, in_backward))
