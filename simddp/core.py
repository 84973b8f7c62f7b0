"""The simpy core of simddp (:mod:`simddp.core`): communicators, shared links and collectives as simpy processes.

Both ways simddp keeps time run on this module:

* **co-simulation** (:mod:`simddp.cosim.simulate`): a live fake cluster, whose collectives' times are
  decided here through :class:`Channel`;
* **trace-driven replay** (:mod:`simddp.replay.simpy_engine`): a captured DDP iteration replayed at any world
  size, each rank a simpy process on one :class:`Fabric`.

The model (simddp's promised semantics 2)
-----------------------------------------

A **communicator** is a ``simpy.Resource(capacity=1)``: NCCL runs one communicator's
collectives one after another, in issue order. A **collective** is a simpy process
(:meth:`Fabric.collective`):

1. it requests its communicator when its first member issues it (so requests, and therefore
   grants, come in sequence-number order: whoever issues collective *k* first has issued
   *k − 1* before);
2. holding the communicator, it waits until every member has arrived (:meth:`CollectiveProcess.arrive`:
   at an issue event in replay, or at a known issue time in co-simulation);
3. it requests the shared **links** it crosses (each a ``simpy.Resource(capacity=1)``, e.g.
   a node's NIC used by several groups), always in one global order, so two collectives that
   need the same links can never deadlock;
4. it holds them for ``duration`` (the network model's ``collective_time(...)`` times its noise
   factor), then releases links and communicator and succeeds its ``done`` event, recording
   ``start`` and ``end``.

So a collective starts at ``max(latest issue, end of the communicator's previous collective,
when its links are free)`` and lasts ``duration``. A link held by one collective is unavailable
to others: contention between groups *serialises* their transfers (store-and-forward), which is
what a capacity-1 simpy resource models. Both transfers finish by the same time as under fair
bandwidth sharing; the first finishes earlier than it would under sharing. Without shared
links each communicator is an independent channel (the network model's time assumes an
uncontended fabric).

Times are exact: :meth:`Fabric.at` schedules an event at an absolute time (not ``now + delay``,
which would drift by an ulp), so a collective starts exactly at the latest issue time or the
previous end, and ends exactly at ``start + duration`` — the closed form of semantics 2.

Why co-simulation uses one environment per channel, and replay one global environment
---------------------------------------------------------------------------------------

A simpy ``Environment`` only moves forward: it cannot schedule an event before ``now``.

In **replay** every rank is a simpy process, so the engine itself decides which rank runs next,
in virtual-time order; one global ``Environment`` (one :class:`Fabric`) holds every rank,
communicator and link, and contention between groups on shared links is modelled.

In **co-simulation** the ranks are threads of the live fake cluster, run one at a time in
*program* order (fakepg's baton), not in virtual-time order: rank 0 may issue its collective on
group A at t = 5 ms before rank 1 issues an earlier collective (t = 2 ms) on group B. A single
environment advanced to 5 ms by group A could no longer start group B's collective at 2 ms.
Within ONE communicator, though, order is monotonic: the k-th collective is matched after the
(k−1)-th, its latest issue time is non-decreasing in k (each member issues in program order), and
its start is ``max(latest issue, previous end)`` ≥ the previous start. So co-simulation gives
each communicator (and each point-to-point channel ``(group, src, dst)``) a :class:`Channel`: its
own ``Environment`` plus its communicator resource. :meth:`Channel.submit` runs that
environment until the collective's process ends, which never needs to go back in time. The
price: links shared *between* channels cannot be modelled in co-simulation (each channel's
clock is its own); replay models them.

Cost: a channel's collective is a handful of simpy events (process start, request, arrival,
hold, release): about 10 µs per collective on this project's machines, against
several milliseconds of the ranks' own compute per collective in ``ci/bench_simddp.py``.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Iterable, Sequence

import simpy
from simpy.events import Event, Timeout

__all__ = ["Fabric", "Channel", "CollectiveProcess", "at"]

_inf = math.inf
_nextafter = math.nextafter


def at(env: simpy.Environment, t: float, value: Any = None) -> Event:
    """An event processed at absolute virtual time ``t`` (≥ ``env.now``), exactly.

    simpy's public API schedules by delay, and ``now + (t - now)`` can differ from ``t`` in
    the last bit. So the delay is nudged by ulps until ``now + delay == t``; when no delay lands
    on ``t`` (``now``'s low bits make the rounded sums skip it), the event comes from two hops
    (:func:`_two_hops`).
    """
    now = env.now
    if t < now:
        raise ValueError(f"cannot schedule at t={t!r}: the environment is already at {now!r}")
    delay = t - now
    if now + delay != t:
        step = _inf if now + delay < t else -_inf
        for _ in range(4):  # one ulp away in practice, or never
            delay = _nextafter(delay, step)
            if now + delay == t:
                break
        else:
            return env.process(_two_hops(env, t, value))
    return Timeout(env, delay, value)


def _two_hops(env: simpy.Environment, t: float, value: Any) -> Any:
    """Reach ``t`` via ``m``: the largest time ≤ ``t`` a delay reaches from now, within a few
    ulps of ``t``; from ``m``, ``t - m`` is exact (Sterbenz: t/2 ≤ m ≤ t), so ``m + (t - m)``
    is ``t``. (Its final event is scheduled at ``m``, so among events due at exactly ``t`` it
    runs after those scheduled before ``m``: deterministic, and rare.)"""
    now = env.now
    delay = t - now
    while now + delay > t:
        delay = _nextafter(delay, -_inf)
    yield Timeout(env, delay)
    yield Timeout(env, t - env.now)
    return value


class CollectiveProcess:
    """One collective on one communicator: a simpy process plus what it records.

    ``members``: how many arrivals it waits for; ``duration``: seconds it holds its
    communicator and links; ``start``/``end``: virtual times once it ran (None before);
    ``last_issue``: the latest arrival time; ``done``: the simpy event (the process) that
    succeeds, with value ``(start, end)``, when it ends. ``info``: anything the caller attaches.
    """

    __slots__ = ("fabric", "comm", "members", "arrived", "last_issue", "duration", "links",
                 "start", "end", "done", "info", "_all_in")

    def __init__(self, fabric: "Fabric", comm: simpy.Resource, members: int, duration: float,
                 links: Sequence[simpy.Resource], info: Any) -> None:
        if members < 1:
            raise ValueError(f"a collective needs at least one member, got {members}")
        if not duration >= 0:
            raise ValueError(f"a collective's duration must be >= 0 seconds, got {duration!r}")
        self.fabric = fabric
        self.comm = comm
        self.members = members
        self.arrived = 0
        self.last_issue = float("-inf")
        self.duration = float(duration)
        self.links = links
        self.start: float | None = None
        self.end: float | None = None
        self.info = info
        self._all_in: Event | None = None
        self.done: simpy.Process = fabric.env.process(self._run())

    def arrive(self, t: float | None = None) -> None:
        """One member issues the collective, at ``t`` (default: the environment's now).

        In replay ranks arrive at ``now``; in co-simulation the issue times are known up front
        and may lie ahead of the channel's clock (the process then waits until the latest)."""
        env = self.fabric.env
        t = env.now if t is None else float(t)
        if self.arrived >= self.members:
            raise RuntimeError(f"collective {self.info!r}: more than {self.members} members "
                               f"arrived")
        self.arrived += 1
        if t > self.last_issue:
            self.last_issue = t
        if self.arrived == self.members and self._all_in is not None:
            self._all_in.succeed()

    def _run(self):  # the simpy process
        env = self.fabric.env
        req = self.comm.request()
        yield req
        try:
            if self.arrived < self.members:
                self._all_in = env.event()
                yield self._all_in
            if self.last_issue > env.now:
                yield at(env, self.last_issue)
            held = []
            try:
                for link in self.links:
                    lreq = link.request()
                    held.append((link, lreq))
                    yield lreq
                self.start = start = env.now
                end = start + self.duration
                if end > start:
                    yield env.timeout(self.duration)  # lands on now + duration: end, exactly
                self.end = end
            finally:
                for link, lreq in held:
                    link.release(lreq)
        finally:
            self.comm.release(req)
        return self.start, self.end


class Fabric:
    """Communicators and shared links on one simpy ``Environment``.

    ``communicator(key)`` and ``link(key)`` are created on first use (capacity-1 resources);
    :meth:`collective` starts a collective's process on a communicator. Replay uses one
    Fabric for the whole world; co-simulation a :class:`Channel` per communicator.

    >>> fab = Fabric()
    >>> a = fab.collective("world", members=2, duration=1.0)
    >>> b = fab.collective("world", members=2, duration=1.0)
    >>> for c, t in ((a, 0.5), (a, 2.0), (b, 0.0), (b, 0.1)):
    ...     c.arrive(t)
    >>> fab.env.run()
    >>> (a.start, a.end), (b.start, b.end)   # b waits for a: one communicator, in order
    ((2.0, 3.0), (3.0, 4.0))
    """

    def __init__(self, env: simpy.Environment | None = None) -> None:
        self.env = simpy.Environment() if env is None else env
        self.communicators: dict[Hashable, simpy.Resource] = {}
        self.links: dict[Hashable, simpy.Resource] = {}
        self._link_order: dict[int, tuple[int, str]] = {}

    def communicator(self, key: Hashable) -> simpy.Resource:
        res = self.communicators.get(key)
        if res is None:
            res = self.communicators[key] = simpy.Resource(self.env, capacity=1)
        return res

    def link(self, key: Hashable) -> simpy.Resource:
        res = self.links.get(key)
        if res is None:
            res = self.links[key] = simpy.Resource(self.env, capacity=1)
            self._link_order[id(res)] = (len(self._link_order), repr(key))
        return res

    def at(self, t: float, value: Any = None) -> Event:
        """An event at absolute time ``t`` (see :func:`at`)."""
        return at(self.env, t, value)

    def collective(self, comm: Hashable, members: int, duration: float, *,
                   links: Iterable[Hashable] = (), info: Any = None) -> CollectiveProcess:
        """Start a collective's process on communicator ``comm`` (created on first use).

        Call it when the collective's first member issues it (so that collectives request
        their communicator in sequence order), then :meth:`CollectiveProcess.arrive` once per member.
        ``links``: keys of shared links it crosses (acquired in one global order, by key of
        creation)."""
        resources = [self.link(k) for k in links]
        if len(resources) > 1:
            resources = sorted(set(resources), key=lambda r: self._link_order[id(r)])
        return CollectiveProcess(self, self.communicator(comm), members, duration, resources, info)

    def run(self, until: Any = None) -> Any:
        return self.env.run(until)


class Channel:
    """One communicator (or point-to-point channel) with an environment of its own, for
    co-simulation: collectives are submitted in sequence order with their members' issue
    times already known. See the module docstring for why channels are separate.

    >>> ch = Channel()
    >>> ch.submit([0.0, 2.0], 1.0), ch.submit([0.5, 1.0], 1.0), ch.submit([9.0], 0.5)
    ((2.0, 3.0), (3.0, 4.0), (9.0, 9.5))
    """

    __slots__ = ("fabric", "env", "comm", "count")

    def __init__(self) -> None:
        self.fabric = Fabric()
        self.env = self.fabric.env
        self.comm = self.fabric.communicator("channel")
        self.count = 0

    def submit(self, issues: Sequence[float], duration: float) -> tuple[float, float]:
        """Run one collective whose members issued it at ``issues``; returns ``(start, end)``.

        Its process requests the channel's communicator, waits for the latest issue time,
        holds for ``duration`` and releases; the channel's environment runs until it ends."""
        c = CollectiveProcess(self.fabric, self.comm, len(issues), duration, (), self.count)
        c.arrived = len(issues)  # every member has issued it: co-simulation matches it now
        c.last_issue = max(issues)
        self.count += 1
        self.env.run(until=c.done)
        return c.start, c.end  # type: ignore[return-value]


