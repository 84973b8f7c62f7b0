"""The vectorised replay's records: its collectives, communicators, what a pass records, and
the comm figures computed from them (see :mod:`simddp.replay.vector_engine`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..analysis import CommSpan, Lane

__all__ = ["Step", "Scope", "Record", "Busy", "comm_figures", "ResultRecords"]


class Step:
    """One collective of the plan (one per communicator of its scope): per communicator code
    its start, end, draw index and creation key."""

    __slots__ = ("tag", "scope", "op", "nbytes", "in_backward", "seq", "pos", "start", "end",
                 "draw", "ctime", "crank")

    def __init__(self, tag, scope, op, nbytes, in_backward, seq, pos):
        self.tag, self.scope, self.op, self.nbytes = tag, scope, op, int(nbytes)
        self.in_backward, self.seq, self.pos = in_backward, seq, pos
        self.start = self.end = self.draw = self.ctime = self.crank = None


class Scope:
    """One kind of communicator over the world: the DDP groups (``dp``) or the node subgroups
    (``node``), a mesh dimension. ``code[r]``: rank r's communicator; per code its size and
    (``per_node``, None on a flat fabric) where its members sit (a
    :class:`~simddp.models.placement.Placement`). ``shapes``: (size, placement, mask of
    codes) of the communicators of more than one rank, alike in both, which the network
    costs alike."""

    def __init__(self, name: str, code: np.ndarray, ncode: int,
                 per_node: np.ndarray | None = None) -> None:
        self.name, self.code, self.ncode = name, code, ncode
        self.size = np.bincount(code, minlength=ncode)
        self.present = np.flatnonzero(self.size)
        sizes = self.size[self.present]
        places = sizes if per_node is None else per_node[self.present]
        self.shapes: list[tuple[int, Any, np.ndarray]] = []
        for size, g in sorted(set(zip(sizes.tolist(), places.tolist()))):
            if size > 1:
                m = self.size == size
                if per_node is not None:
                    m &= np.fromiter((p == g for p in per_node), dtype=bool, count=ncode)
                self.shapes.append((size, None if per_node is None else g, m))
        self._first: np.ndarray | None = None
        self.single = ncode == 1
        if not self.single:
            self.perm = np.argsort(code, kind="stable")
            self.offsets = np.searchsorted(code[self.perm], self.present)

    @property
    def first(self) -> np.ndarray:
        """Per code, its lowest rank (-1 where no rank has it)."""
        if self._first is None:
            first = np.full(self.ncode, -1, dtype=np.int64)
            first[self.code[::-1]] = np.arange(len(self.code) - 1, -1, -1)
            self._first = first
        return self._first

    def reduce(self, ufunc: Any, v: np.ndarray, fill: float) -> np.ndarray:
        out = np.full(self.ncode, fill)
        if self.single:
            out[0] = ufunc.reduce(v)
        else:
            out[self.present] = ufunc.reduceat(v[self.perm], self.offsets)
        return out


class Record:
    """What a pass records: figures per rank and iteration (full pass), or spans and
    collectives of a few ranks (``rows``: a lane per rank)."""

    def __init__(self, n: int, iterations: int, rows: bool) -> None:
        self.rows = rows
        z = lambda: np.zeros((n, iterations))  # noqa: E731
        self.forward, self.backward, self.optimizer, self.wait = z(), z(), z(), z()
        self.host = z()  # data loading, host syncs (simddp.models.host, .syncs)
        self.bounds = np.zeros((n, iterations))
        self.waits: list[tuple[int, np.ndarray, np.ndarray]] = []  # (it, start, end)
        self.spans: list[list] = [[] for _ in range(n)] if rows else []
        self.comms: list[list] = [[] for _ in range(n)] if rows else []
        self.it = 0

    def compute(self, kind: str, s: np.ndarray, e: np.ndarray, label: str | None = None
                ) -> None:
        d = e - s
        getattr(self, kind)[:, self.it] += np.where(d > 0, d, 0.0)
        if self.rows:
            self._rows(kind, s, e, label or kind)

    def waited(self, s: np.ndarray, e: np.ndarray, label: str) -> None:
        d = e - s
        self.wait[:, self.it] += np.where(d > 0, d, 0.0)
        self.waits.append((self.it, s, e))
        if self.rows:
            self._rows("wait", s, e, label)

    def callback(self, s: np.ndarray, e: np.ndarray) -> None:
        if self.rows:
            self._rows("callback", s, e, "callback (side stream)")

    def _rows(self, kind: str, s: np.ndarray, e: np.ndarray, label: str) -> None:
        for i, (a, b) in enumerate(zip(s.tolist(), e.tolist())):
            if b > a:
                self.spans[i].append((kind, a, b, label))


def comm_figures(steps: list[Step], scopes: dict[str, Scope], rec: Record
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per rank and iteration: time a collective of the rank runs (comm), and the part of
    it the rank spends waiting (exposed: a rank's time is compute or wait, nothing else)."""
    world, iterations = rec.bounds.shape
    # a rank's collectives: those of its communicators in every scope; rows: one per
    # distinct set of communicators
    row_of = np.zeros(world, dtype=np.int64)
    for sc in scopes.values():
        row_of = row_of * sc.ncode + sc.code
    rows, first, row_idx = np.unique(row_of, return_index=True, return_inverse=True)
    row_idx = row_idx.reshape(-1)
    S = np.empty((len(rows), len(steps)))
    E = np.empty((len(rows), len(steps)))
    for j, st in enumerate(steps):
        code = scopes[st.scope].code[first]
        S[:, j], E[:, j] = st.start[code], st.end[code]
    o = np.argsort(S, axis=1, kind="stable")
    S, E = np.take_along_axis(S, o, 1), np.take_along_axis(E, o, 1)
    run = np.maximum.accumulate(E, axis=1)
    prev = np.concatenate([np.full((len(rows), 1), -np.inf), run[:, :-1]], axis=1)
    P = np.maximum(S, prev)
    Q = np.maximum(P, E)
    L = Q - P
    C = np.concatenate([np.zeros((len(rows), 1)), np.cumsum(L, axis=1)], axis=1)
    F = Busy(P, Q, C, row_idx)
    b = rec.bounds
    lo = np.concatenate([np.zeros((world, 1)), b[:, :-1]], axis=1)
    comm = np.empty_like(b)
    for i in range(iterations):
        comm[:, i] = F(b[:, i]) - F(lo[:, i])
    exposed = np.zeros_like(b)
    for i, ws, we in rec.waits:
        exposed[:, i] += np.where(we > ws, F(we) - F(ws), 0.0)
    return comm, np.maximum(exposed, 0.0)


class Busy:
    """F(t) per rank: how long the rank's collectives ran (their union) before ``t``; pieces
    ``[P, Q]`` per row (a set of communicators), disjoint and sorted, ``C`` their cumulative
    lengths, ``row_idx`` each rank's row."""

    def __init__(self, P: np.ndarray, Q: np.ndarray, C: np.ndarray, row_idx: np.ndarray) -> None:
        self.P, self.Q, self.C, self.row_idx = P, Q, C, row_idx
        self.m = P.shape[1]
        self.base = row_idx * self.m  # flat index of each rank's row

    def __call__(self, t: np.ndarray) -> np.ndarray:
        P, Q, C, m = self.P, self.Q, self.C, self.m
        if len(P) == 1:
            k = np.searchsorted(P[0], t, side="right")  # pieces starting at or before t
        else:  # the same, per row: a binary search vectorised over ranks
            flat = P.reshape(-1)
            k = np.zeros(len(t), dtype=np.int64)
            step = 1 << max(0, m.bit_length() - 1)
            while step:
                cand = k + step
                ok = cand <= m
                probe = self.base + np.minimum(cand, m) - 1
                k = np.where(ok & (flat[probe] <= t), cand, k)
                step >>= 1
        km = np.maximum(k - 1, 0)
        at = self.base + km if len(P) > 1 else km
        part = np.minimum(t, Q.reshape(-1)[at]) - P.reshape(-1)[at]
        cum = C[:, :-1].reshape(-1)[at] if len(P) > 1 else C[0, :-1][km]
        return np.where(k > 0, cum + np.maximum(part, 0.0), 0.0)


class ResultRecords:
    """What a :class:`~simddp.replay.vector_engine.VectorReplay` hands to its result: the
    collectives' records, per-rank totals, and lanes materialised on demand (the engine's
    ``mesh``, ``steps``, ``scopes``, ``order`` and ``_pass``)."""

    # -- lanes on demand -----------------------------------------------------------------------
    def lanes(self, ranks: list[int]) -> list[Lane]:
        """Rank ``ranks``' lanes (spans and collectives), re-run from the recorded collectives."""
        got = {r: self._lane_cache[r] for r in ranks if r in self._lane_cache}
        todo = [r for r in dict.fromkeys(ranks) if r not in got]
        if todo:
            rec = Record(len(todo), self.iterations, rows=True)
            self._pass(np.array(todo, dtype=np.int64), rec, False, None)
            for i, r in enumerate(todo):
                comms = []
                for st, c, issue in rec.comms[i]:
                    sc = self.scopes[st.scope]
                    group = self.mesh.label(self.mesh.key(r, st.scope))
                    tag = "/".join(str(x) for x in (group, *st.tag))
                    size = int(sc.size[c])
                    members = self.mesh.members(r, st.scope)
                    comms.append(CommSpan(
                        rank=r, op=st.op, group=group,
                        group_ranks=tuple(members) if size <= 64 else (), seq=st.seq,
                        bytes=st.nbytes, issue=issue, start=float(st.start[c]),
                        end=float(st.end[c]), site=tag, in_backward=st.in_backward,
                        scope=st.scope))
                comms.sort(key=lambda x: x.issue)  # arrival order, as the simpy lanes keep
                spans = sorted(rec.spans[i], key=lambda x: (x[1], x[2]))
                bounds = rec.bounds[i].tolist()
                got[r] = Lane(spans, comms, bounds, bounds[-1] if bounds else 0.0)
            if len(todo) <= 64:  # a few ranks a plot or a query asks for again: kept
                if len(self._lane_cache) > 256:
                    self._lane_cache.clear()
                self._lane_cache.update((r, got[r]) for r in todo)
        return [got[r] for r in ranks]

    # -- the result's records ------------------------------------------------------------------
    def _group(self, scope: str, c: int) -> str:
        sc = self.scopes[scope]
        rank = int(sc.first[c])
        return self.mesh.label(self.mesh.key(rank, scope))

    def collectives(self) -> list[dict[str, Any]]:
        """Every collective, in creation order (the simpy engine's ``order``)."""
        steps = list(self.steps.values())
        tags = ["/".join(str(x) for x in st.tag) for st in steps]
        groups: dict[tuple[str, int], str] = {}
        starts = [st.start.tolist() for st in steps]
        ends = [st.end.tolist() for st in steps]
        sizes = {k: sc.size.tolist() for k, sc in self.scopes.items()}
        out = []
        for i, c in zip(*(a.tolist() for a in self.order)):
            st = steps[i]
            key = (st.scope, c)
            group = groups.get(key)
            if group is None:
                group = groups[key] = self._group(st.scope, c)
            out.append({"name": f"{group}/{tags[i]}", "op": st.op, "group": group,
                        "members": sizes[st.scope][c], "seq": st.seq, "bytes": st.nbytes,
                        "start": starts[i][c], "end": ends[i][c]})
        return out

    def rank_totals(self) -> tuple[int, int]:
        """(collectives, bytes) every rank takes part in (the same for all: SPMD)."""
        steps = list(self.steps.values())
        return len(steps), sum(st.nbytes for st in steps)
