"""The world's communicators: which ranks share one, per scope of a step program.

A :class:`Mesh` answers, for a rank and a scope (a mesh dimension such as ``"dp"``,
``"shard"``, ``"replicate"``, or DDP's ``"node"`` subgroups), which communicator the rank uses
(its key, members and the links it holds) — the simpy engine asks per rank — and the same for
every rank at once as integer codes — the vectorised engine's view. Ranks are laid out as
torch's ``init_device_mesh`` lays them out: row-major, the last dimension innermost (the one
that stays inside a node when it fits).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Iterable, Sequence

import numpy as np

from ..models.placement import Placement, placement_of, placements_of_codes, ranks_per_node

__all__ = ["Mesh", "DDPMesh", "DeviceMesh", "PipelineMesh", "ranks_per_node"]

# a pipeline's directed p2p channels (PipelineMesh): to the next and the previous pipeline rank
_P2P = ("pp_send_next", "pp_recv_prev", "pp_send_prev", "pp_recv_next")


class Mesh:
    """The interface both engines use; see :class:`DDPMesh` and :class:`DeviceMesh`."""

    world: int
    scopes: tuple[str, ...]
    # scopes whose communicator tells ranks apart in replay's equivalence classes
    class_scopes: tuple[str, ...] = ()

    def key(self, rank: int, scope: str) -> tuple:
        raise NotImplementedError

    def members(self, rank: int, scope: str) -> Sequence[int]:
        raise NotImplementedError

    def dimension(self, scope: str) -> str:
        """The mesh dimension a scope's collectives count under in results (its own name,
        unless a mesh has several scopes per dimension: a pipeline's p2p channels are "pp")."""
        return scope

    def links(self, rank: int, scope: str) -> list[tuple[str, int]]:
        """Shared links (a node's NIC) the communicator holds while it runs (none by default)."""
        return []

    def per_node(self, rank: int, scope: str, gpus_per_node: int) -> int:
        """How many members of rank's communicator in ``scope`` share a node (its busiest
        one), nodes being ``gpus_per_node`` consecutive ranks: what the network costs it with
        (:meth:`simddp.Network.placed`). By default counted from :meth:`members`, so any mesh
        (a pipeline's p2p channel between two nodes: 1) has it."""
        return ranks_per_node(self.members(rank, scope), gpus_per_node)

    def placement(self, rank: int, scope: str, network: Any) -> Placement | None:
        """Where rank's communicator in ``scope`` sits on ``network``'s fabric (its members
        per node, the tiers it spans: :mod:`simddp.models.placement`); None on a flat fabric."""
        return placement_of(self.members(rank, scope), network)

    def placements(self, scope: str, network: Any) -> np.ndarray | None:
        """:meth:`placement` for every communicator of ``scope`` at once, by code."""
        return placements_of_codes(*self.codes(scope), network)

    def per_node_codes(self, scope: str, gpus_per_node: int) -> np.ndarray:
        """:meth:`per_node` for every communicator of ``scope`` at once, indexed by its code
        (:meth:`codes`; 0 for a code no rank has). By default counted from :meth:`codes`."""
        code, ncode = self.codes(scope)
        nnodes = -(-self.world // gpus_per_node)
        pairs = code * nnodes + np.arange(self.world, dtype=np.int64) // gpus_per_node
        uniq, count = np.unique(pairs, return_counts=True)
        out = np.zeros(ncode, dtype=np.int64)
        np.maximum.at(out, uniq // nnodes, count)
        return out

    def codes(self, scope: str) -> tuple[np.ndarray, int]:
        """Per rank its communicator's code in ``scope``, and the number of codes."""
        raise NotImplementedError

    def label(self, key: tuple) -> str:
        """The communicator's name in results (``dp0``, ``dp0/node1``, ``shard@8``)."""
        raise NotImplementedError

    def class_code(self, nprof: int) -> tuple[np.ndarray, int]:
        """Per rank an integer that replay's equivalence classes must respect, and how many
        there are: here the captured profile only — on a regular mesh every communicator of
        a dimension has the same size, so ranks in different ones behave alike (placement
        aside: :meth:`placement_code`)."""
        ranks = np.arange(self.world, dtype=np.int64)
        return ranks % nprof, nprof

    def placement_code(self, network: Any) -> tuple[np.ndarray, int]:
        """Per rank an integer that tells apart ranks whose communicators of some scope sit
        differently on the fabric (:meth:`placements` unequal: a dimension that straddles node
        or tier boundaries unevenly), so the network costs them differently; and how many
        there are. All zeros (1) where every scope's communicators are placed alike.
        ``network`` may be a bare ``gpus_per_node`` (nodes only, no tiers)."""
        code, width = np.zeros(self.world, dtype=np.int64), 1
        if network is None or isinstance(network, int):
            network = SimpleNamespace(gpus_per_node=network, tiers=())
        if getattr(network, "gpus_per_node", None) is None:
            return code, width
        for scope in self.scopes:
            per_code = self.placements(scope, network)
            kinds = sorted(set(per_code.tolist()))
            if len(kinds) > 1:
                index = {p: i for i, p in enumerate(kinds)}
                inv = np.array([index[p] for p in per_code.tolist()], dtype=np.int64)
                code += width * inv[self.codes(scope)[0]]
                width *= len(kinds)
        return code, width


class DDPMesh(Mesh):
    """DDP's communicators: ``groups`` independent DDP groups (rank r in group r % groups),
    and, for LocalSGD/SlowMo's averaging inside a node, each group's node subgroups
    (``gpus_per_node`` ranks a node). ``shared_nic``: a group's collectives hold the NICs of
    the nodes it spans (contended by the other groups)."""

    scopes = ("dp", "node")

    def __init__(self, world: int, groups: int = 1, gpus_per_node: int | None = None,
                 shared_nic: bool = False, node_classes: bool = False) -> None:
        self.world, self.groups, self.gpn = world, groups, gpus_per_node or 1
        self.shared_nic = shared_nic
        self.class_scopes = ("dp", "node") if node_classes else ("dp",)
        self._links: dict[int, list[tuple[str, int]]] = {}

    def key(self, rank: int, scope: str) -> tuple:
        g = rank % self.groups
        return ("node", g, rank // self.gpn) if scope == "node" else ("dp", g)

    def members(self, rank: int, scope: str) -> range:
        g = rank % self.groups
        if scope == "node":
            node = rank // self.gpn
            lo, hi = node * self.gpn, min((node + 1) * self.gpn, self.world)
            return range(lo + (g - lo) % self.groups, hi, self.groups)
        return range(g, self.world, self.groups)

    def links(self, rank: int, scope: str) -> list[tuple[str, int]]:
        if scope == "node" or not self.shared_nic:
            return []
        g = rank % self.groups
        links = self._links.get(g)
        if links is None:
            nodes = sorted({r // self.gpn for r in range(g, self.world, self.groups)})
            links = self._links[g] = [("nic", n) for n in nodes] if len(nodes) > 1 else []
        return links

    def codes(self, scope: str) -> tuple[np.ndarray, int]:
        ranks = np.arange(self.world, dtype=np.int64)
        g = ranks % self.groups
        if scope == "node":
            nnodes = -(-self.world // self.gpn)
            return g * nnodes + ranks // self.gpn, self.groups * nnodes
        return g, self.groups

    def label(self, key: tuple) -> str:
        return f"dp{key[1]}" if key[0] == "dp" else f"dp{key[1]}/node{key[2]}"

    def per_node(self, rank: int, scope: str, gpus_per_node: int) -> int:
        """Contiguous, as DDP has always been costed: a node subgroup is inside its node, and
        a DDP group is costed as if it filled nodes (several groups interleave their ranks;
        their sharing of a node's NICs is ``shared_nic``'s, not placement's)."""
        return gpus_per_node

    def per_node_codes(self, scope: str, gpus_per_node: int) -> np.ndarray:
        return np.full(self.codes(scope)[1], gpus_per_node, dtype=np.int64)

    def placement(self, rank: int, scope: str, network: Any) -> Placement | None:
        """Contiguous per node (as :meth:`per_node`), spanning the tiers its members span."""
        p = placement_of(self.members(rank, scope), network)
        return None if p is None else Placement(network.gpus_per_node, p.spans)

    def placements(self, scope: str, network: Any) -> np.ndarray | None:
        per_code = placements_of_codes(*self.codes(scope), network)
        if per_code is None:
            return None
        G = network.gpus_per_node
        out = np.empty(len(per_code), dtype=object)
        out[:] = [Placement(G, p.spans) for p in per_code.tolist()]
        return out

    def placement_code(self, network: Any) -> tuple[np.ndarray, int]:
        return np.zeros(self.world, dtype=np.int64), 1

    def class_code(self, nprof: int) -> tuple[np.ndarray, int]:
        """Per rank: (profile, group[, node]) as one integer — DDP's equivalence classes."""
        ranks = np.arange(self.world, dtype=np.int64)
        code, width = ranks % nprof, nprof
        if self.groups > 1:
            code += width * (ranks % self.groups)
            width *= self.groups
        if "node" in self.class_scopes:
            code += width * (ranks // self.gpn)
            width *= -(-self.world // self.gpn)
        return code, width


class DeviceMesh(Mesh):
    """A torch ``DeviceMesh``: named dimensions, row-major (the last innermost), e.g.
    ``DeviceMesh(64, {"replicate": 8, "shard": 8})`` — HSDP. A scope is one dimension: the
    ranks that differ only in that coordinate share a communicator."""

    def __init__(self, world: int, dims: dict[str, int]) -> None:
        if math.prod(dims.values()) != world:
            raise ValueError(f"the mesh {dims} has {math.prod(dims.values())} ranks, the world "
                             f"{world}")
        self.world, self.dims = world, dict(dims)
        self.scopes = tuple(dims)
        names = list(dims)
        sizes = [dims[n] for n in names]
        self._stride = {n: math.prod(sizes[i + 1:]) for i, n in enumerate(names)}

    def _coord(self, rank: int, scope: str) -> int:
        return (rank // self._stride[scope]) % self.dims[scope]

    def key(self, rank: int, scope: str) -> tuple:
        stride = self._stride[scope]
        base = rank - self._coord(rank, scope) * stride
        return (scope, base)

    def members(self, rank: int, scope: str) -> range:
        stride = self._stride[scope]
        base = rank - self._coord(rank, scope) * stride
        return range(base, base + stride * self.dims[scope], stride)

    def codes(self, scope: str) -> tuple[np.ndarray, int]:
        ranks = np.arange(self.world, dtype=np.int64)
        stride, size = self._stride[scope], self.dims[scope]
        base = ranks - ((ranks // stride) % size) * stride
        # dense codes: the communicators' lowest ranks, numbered in order
        uniq, code = np.unique(base, return_inverse=True)
        return code.reshape(-1).astype(np.int64), len(uniq)

    def label(self, key: tuple) -> str:
        return f"{key[0]}@{key[1]}"

    def _regular_per_node(self, scope: str, gpus_per_node: int) -> int | None:
        """Members per node of every communicator of ``scope``, from its stride s and size d,
        where the layout is regular: s a multiple of G — one per node; s dividing G with the
        G/s members a node can hold dividing d, or d dividing them — min(d, G/s). None: count
        (a dimension that straddles node boundaries unevenly)."""
        s, d, G = self._stride[scope], self.dims[scope], gpus_per_node
        if s % G == 0:
            return 1
        if G % s == 0 and (d % (G // s) == 0 or (G // s) % d == 0):
            return min(d, G // s)
        return None

    def per_node(self, rank: int, scope: str, gpus_per_node: int) -> int:
        g = self._regular_per_node(scope, gpus_per_node)
        return super().per_node(rank, scope, gpus_per_node) if g is None else g

    def per_node_codes(self, scope: str, gpus_per_node: int) -> np.ndarray:
        g = self._regular_per_node(scope, gpus_per_node)
        if g is None:
            return super().per_node_codes(scope, gpus_per_node)
        return np.full(self.codes(scope)[1], g, dtype=np.int64)

    def describe(self) -> dict[str, Any]:
        return dict(self.dims)


class PipelineMesh(Mesh):
    """A pp × (data) × tp :class:`DeviceMesh` with the pipeline's directed p2p channels.

    Inside a stage, the device mesh's scopes (``shard``, ``replicate``, ``tp``). Between
    stages, per rank four scopes naming two channels each way: ``pp_send_next`` /
    ``pp_recv_prev`` (the channel ``pp>c`` from pipeline rank c to c + 1 mod pp, at the same
    data and tp coordinates) and ``pp_send_prev`` / ``pp_recv_next`` (``pp<c``, to c − 1).
    Ranks of one pipeline rank behave alike, so replay's equivalence classes are the pipeline
    coordinate (:meth:`class_code`)."""

    def __init__(self, inner: DeviceMesh) -> None:
        self.inner = inner
        self.world = inner.world
        self.pp = inner.dims["pp"]
        self.stride = inner.world // self.pp
        self.scopes = tuple(s for s in inner.scopes if s != "pp") + _P2P

    def coord(self, rank: int) -> int:
        """The rank's pipeline coordinate."""
        return rank // self.stride

    def _step(self, rank: int, d: int) -> int:
        return rank + ((self.coord(rank) + d) % self.pp - self.coord(rank)) * self.stride

    def key(self, rank: int, scope: str) -> tuple:
        if scope == "pp_send_next":
            return ("pp>", rank)
        if scope == "pp_recv_prev":
            return ("pp>", self._step(rank, -1))
        if scope == "pp_send_prev":
            return ("pp<", rank)
        if scope == "pp_recv_next":
            return ("pp<", self._step(rank, 1))
        return self.inner.key(rank, scope)

    def members(self, rank: int, scope: str) -> Sequence[int]:
        if scope in _P2P:
            d, src = self.key(rank, scope)
            return (src, self._step(src, 1 if d == "pp>" else -1))
        return self.inner.members(rank, scope)

    def codes(self, scope: str) -> tuple[np.ndarray, int]:
        if scope not in _P2P:
            return self.inner.codes(scope)
        ranks = np.arange(self.world, dtype=np.int64)
        c = ranks // self.stride
        d = {"pp_send_next": 0, "pp_recv_prev": -1, "pp_send_prev": 0, "pp_recv_next": 1}[scope]
        return ranks + ((c + d) % self.pp - c) * self.stride, self.world

    def label(self, key: tuple) -> str:
        return f"{key[0]}{key[1]}" if key[0] in ("pp>", "pp<") else self.inner.label(key)

    def dimension(self, scope: str) -> str:
        return "pp" if scope in _P2P else scope

    def class_code(self, nprof: int) -> tuple[np.ndarray, int]:
        ranks = np.arange(self.world, dtype=np.int64)
        return (ranks // self.stride) * nprof + ranks % nprof, self.pp * nprof

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()
