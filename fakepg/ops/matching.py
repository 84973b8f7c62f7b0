"""What matching works on: one rank's :class:`Call`, the :class:`PendingCollective` the
members' calls form, and each group's :class:`GroupState`.

The k-th collective each member of a group issues forms one :class:`PendingCollective`.
When the last member issues it, the members' fingerprints are compared and, if they
agree, the op (:mod:`fakepg.ops`) computes the result from all inputs in rank order and
writes every member's output tensors. Each member's Work completes later, on that member's own
thread, so future callbacks always run in the owning rank's context.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import FakePGError
from .base import Op
from .base import tensors_of
from .trace import CollectiveRecord


@dataclass(eq=False)
class Call:
    """One rank's part of a collective."""

    rank: int  # global rank
    grank: int  # rank within the group
    op: str  # trace name (spec.name)
    spec: Op
    inputs: list[Any]
    outputs: list[Any]
    site: str
    record: CollectiveRecord
    root: int | None = None  # group rank
    reduce_op: Any = None
    in_splits: list[int] | None = None
    out_splits: list[int] | None = None
    peer: int | None = None  # group rank of the p2p peer (None: any source)
    tag: int = 0
    work: Any = None
    result: list[Any] | Callable[[], list[Any]] | None = None  # see value()
    source: int | None = None  # for recv from any source: the group rank that sent
    per_rank_outputs: bool = False  # allgather_coalesced: the caller's lists are output_lists[rank][i]
    in_backward: bool = False  # issued inside autograd's backward (by the Reducer or a comm hook)
    # Settled before the issuing call returns: its wait happens in C++ (the Reducer's end of
    # backward, Join's shadow pass), where the scheduler cannot see it.
    hidden_wait: bool = False
    collective: "PendingCollective | None" = None  # set when issued
    p2p_order: int = -1  # arrival order of an unmatched p2p call (recv from any source)
    ext: Any = None  # a slot for the layer above (a timing model's per-call state)
    personality: str = "fakepg"  # the group's backend personality (fakepg.fidelity.backends)
    root_tensor: int = 0  # broadcast: which of the root's tensors goes to every tensor (gloo)

    def describe(self) -> str:
        return f"{self.record.describe()} at {self.site}"

    def value(self) -> list[Any]:
        """What the work's future holds; an op may leave ``result`` as a function that makes
        it, so that a world of n ranks does not hold n views per rank nobody asks for."""
        if callable(self.result):
            self.result = self.result()
        return self.result if self.result is not None else []

    def written(self) -> list[torch.Tensor]:
        """Tensors this call's collective writes on this rank (for race detection)."""
        return self.spec.written(self)


@dataclass(eq=False)
class PendingCollective:
    """The k-th collective of a group (or one send/recv pair), as its members arrive."""

    group: "GroupState"
    seq: int
    op: str  # the trace name; "p2p" for a send/recv pair
    spec: Op  # what it computes (for a pair: the send op, which moves the data)
    calls: list[Call | None]
    p2p: bool = False
    arrived: int = 0
    matched: bool = False
    error: FakePGError | None = None

    @property
    def settled(self) -> bool:
        return self.matched or self.error is not None

    def members(self) -> list[Call]:
        return [c for c in self.calls if c is not None]

    def missing_ranks(self) -> list[int]:
        return [self.group.ranks[g] for g, c in enumerate(self.calls) if c is None]


class GroupState:
    """Cluster-wide state of one process group (shared by its members' PG objects)."""

    def __init__(self, name: str, ranks: Sequence[int], timeout: float = 1800.0):
        self.name = name
        self.timeout = timeout  # seconds, the group's timeout as c10d was given it
        self.ranks = tuple(ranks)
        self.size = len(ranks)
        self.next_seq = [0] * self.size
        self.next_p2p = [0] * self.size
        self.pending: dict[int, PendingCollective] = {}
        self.last_done = [-1] * self.size
        self.sends: dict[tuple[int, int, int], collections.deque[Call]] = collections.defaultdict(collections.deque)
        self.recvs: dict[tuple[int, int, int], collections.deque[Call]] = collections.defaultdict(collections.deque)
        self.p2p_order = itertools.count()
        self.aborted: set[int] = set()  # global ranks that aborted this group (pg.abort())

    @property
    def label(self) -> str:
        return f"'{self.name}' (ranks {rank_list(self.ranks)})"


def rank_list(ranks: Sequence[int], *, spell_out: int = 8) -> str:
    """``[0, 1, 2]``; past ``spell_out`` ranks, runs as ranges (``[0-6, 8-1023]``), so that a
    report on a big world stays a report."""
    ranks = list(ranks)
    if len(ranks) <= spell_out:
        return str(ranks)
    runs: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return f"[{', '.join(runs)}]"


SPELL_OUT = 16  # worlds up to this size list every rank on its own line


def rank_runs(ranks: Any, values: list[Any], collapse: bool) -> list[tuple[str, Any]]:
    """("rank r", value) per rank; with ``collapse``, consecutive ranks with equal values
    share one entry ("ranks 0-6", value): a 4,096-rank report stays a few lines."""
    ranks = list(ranks)
    if not collapse:
        return [(f"rank {r}", v) for r, v in zip(ranks, values)]
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and values[j + 1] == values[i]:
            j += 1
        who = f"rank {ranks[i]}" if i == j else f"ranks {rank_list(ranks[i:j + 1], spell_out=0)[1:-1]}"
        out.append((who, values[i]))
        i = j + 1
    return out


def check_match(coll: PendingCollective) -> str | None:
    """None when the members agree, else the differing properties (or how they misfit)."""
    calls = coll.members()
    fps = [c.spec.fingerprint(c) for c in calls]
    first = fps[0]
    if any(fp != first for fp in fps):
        dicts = [dict(fp) for fp in fps]
        keys = sorted({k for d in dicts for k in d}, key=lambda k: (k != "op", k))
        return ", ".join(k for k in keys if any(d.get(k) != dicts[0].get(k) for d in dicts))
    return calls[0].spec.check_members(calls)


def mismatch_message(coll: PendingCollective, differing: str) -> str:
    lines = [f"collective #{coll.seq} on group {coll.group.label} does not match across ranks "
             f"(differs in: {differing}):"]
    members = coll.members()
    texts = [c.describe() for c in members]
    if len(set(texts)) == 1:  # what differs is not in the short form: say the devices
        texts = [f"{t} on {', '.join(str(x.device) for x in tensors_of(c.inputs, c.outputs))}"
                 for t, c in zip(texts, members)]
    for who, text in rank_runs([c.rank for c in members], texts, len(members) > SPELL_OUT):
        lines.append(f"  {who}: {text}")
    lines.append("Every rank of a group must issue the same sequence of collectives with "
                 "matching op, shapes, dtypes, reduce op and root.")
    return "\n".join(lines)
