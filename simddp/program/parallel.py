"""How a what-if lays its world out: ``--parallel`` specs such as ``fsdp``, ``hsdp:8``,
``fsdp:32,tp:8`` or ``pp:4,fsdp:16,tp:8``.

A spec is comma-separated dimensions ``name[:size]``; at most one size may be left out and is
the world size over the others. Names (:data:`PARALLEL_MODES`):

* ``ddp`` — DistributedDataParallel over the dimension (torch's Reducer, buckets);
* ``fsdp`` — FSDP2 (``fully_shard``) sharding parameters over the dimension;
* ``hsdp`` — FSDP2 on a 2-D mesh: ``hsdp:S`` shards over groups of S ranks and replicates
  across the world / S such groups (``hsdp:8`` on 8-GPU nodes shards inside each node);
* ``tp`` — tensor parallelism (DTensor ``parallelize_module``) over the dimension;
* ``pp`` — pipeline parallelism (``torch.distributed.pipelining``) over the dimension.

``tp`` is replayed with ``fsdp`` or ``hsdp`` (FSDP2 on the data-parallel submesh, as torchtitan
composes them); ``ddp`` × ``tp`` is refused (:meth:`Parallel.not_replayed` says why). ``pp``
replays a pipeline capture (:class:`~simddp.program.captured.CapturedPipeline`, through
:mod:`simddp.program.pipeline`) with FSDP2 and ``tp`` inside its stages as captured.

The mesh is laid out as torchtitan lays it out, row-major ``pp × replicate × shard × tp``
(tensor parallelism innermost, so it stays inside a node when it fits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .mesh import DeviceMesh

__all__ = ["Parallel", "PARALLEL_MODES"]

PARALLEL_MODES = {
    "ddp": "DistributedDataParallel (torch's Reducer and its buckets)",
    "fsdp": "FSDP2 fully_shard: parameters, gradients and optimizer state sharded",
    "hsdp": "FSDP2 on a replicate × shard mesh: hsdp:S shards over S ranks",
    "tp": "tensor parallelism (DTensor, torchtitan's plan), innermost mesh dimension; with fsdp "
          "or hsdp",
    "pp": "pipeline parallelism (torch.distributed.pipelining), outermost mesh dimension",
}
_DATA = ("ddp", "fsdp", "hsdp")
_ORDER = ("pp", "data", "tp")  # the mesh's row-major order


@dataclass(frozen=True)
class Parallel:
    """A resolved layout: the data-parallel flavour (``data``: ddp, fsdp or hsdp) and every
    dimension's size. ``replicate × shard`` is the data-parallel size (ddp: ``replicate`` is
    the DDP size and ``shard`` 1; fsdp: ``shard`` the FSDP size; hsdp: both)."""

    data: str = "ddp"
    pp: int = 1
    replicate: int = 1
    shard: int = 1
    tp: int = 1

    @classmethod
    def parse(cls, spec: str, world_size: int) -> Parallel:
        """The layout ``spec`` (see the module docstring) describes for ``world_size`` ranks."""
        text = str(spec).strip().lower()
        if not text:
            raise ValueError(_usage("an empty --parallel spec"))
        sizes: dict[str, int | None] = {}
        data = None
        for part in text.split(","):
            name, _, size = part.strip().partition(":")
            if name not in PARALLEL_MODES:
                raise ValueError(_usage(f"unknown parallel mode {name!r} in {spec!r}"))
            key = "data" if name in _DATA else name
            if key in sizes:
                raise ValueError(_usage(f"{spec!r} names the {key} dimension twice"))
            if name in _DATA:
                data = name
            if size == "":
                sizes[key] = None
            elif not size.isdigit() or int(size) < 1:
                raise ValueError(_usage(f"{part!r}: a size is a positive integer"))
            else:
                sizes[key] = int(size)
        data = data or "ddp"
        sizes.setdefault("data", None)
        if data == "hsdp" and sizes["data"] is None:
            raise ValueError(_usage(f"{spec!r}: hsdp needs its shard size, e.g. hsdp:8"))
        known = math.prod(v for k, v in sizes.items() if v is not None and
                          not (k == "data" and data == "hsdp"))
        missing = [k for k, v in sizes.items() if v is None]
        if data == "hsdp":  # hsdp:S fixes the shard size; the replicate size is what is left
            shard = sizes["data"]
            if world_size % (known * shard):
                raise ValueError(f"--parallel {spec!r}: {known * shard} ranks per replica do "
                                 f"not divide world size {world_size}")
            return cls(data, sizes.get("pp") or 1, world_size // (known * shard), shard,
                       sizes.get("tp") or 1)
        if len(missing) > 1:
            raise ValueError(_usage(f"{spec!r} leaves {' and '.join(missing)} without a size: "
                                    f"give all but one"))
        if missing:
            if world_size % known:
                raise ValueError(f"--parallel {spec!r}: the given sizes ({known} ranks) do not "
                                 f"divide world size {world_size}")
            sizes[missing[0]] = world_size // known
        total = math.prod(v for v in sizes.values() if v is not None)
        if total != world_size:
            raise ValueError(f"--parallel {spec!r} lays out {total} ranks, the world has "
                             f"{world_size}")
        d = sizes["data"] or 1
        return cls(data, sizes.get("pp") or 1, d if data == "ddp" else 1,
                   d if data == "fsdp" else 1, sizes.get("tp") or 1)

    def not_replayed(self) -> str | None:
        """Why this layout cannot be replayed (None: it can)."""
        if self.pp > 1:
            if self.data == "ddp" and self.replicate > 1:
                return ("pipeline stages are replicated with FSDP2 (pp:P,fsdp:N or pp:P,hsdp:S, "
                        "torchtitan's composition), not DDP")
            return None
        if self.tp > 1 and self.data == "ddp":
            return ("tensor parallelism is replayed with FSDP2 as the data-parallel layer (fsdp:N,"
                    "tp:T or hsdp:S,tp:T, torchtitan's composition): DDP over DTensor "
                    "parameters is not what torch composes with TP")
        return None

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.tp

    def mesh(self) -> DeviceMesh:
        """The device mesh: the data-parallel flavour's own dimensions, and the others that
        are larger than 1."""
        dims = {"pp": self.pp, "replicate": self.replicate, "shard": self.shard, "tp": self.tp}
        own = {"ddp": ("replicate",), "fsdp": ("shard",), "hsdp": ("replicate", "shard")}
        kept = {k: v for k, v in dims.items() if v > 1 or k in own[self.data]}
        return DeviceMesh(self.world_size, kept)

    def __str__(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pp:{self.pp}")
        if self.data == "ddp":
            if self.replicate > 1 or self.world_size == 1:
                parts.append(f"ddp:{self.replicate}")
        elif self.data == "fsdp":
            parts.append(f"fsdp:{self.shard}")
        else:
            parts.append(f"hsdp:{self.replicate}x{self.shard}")
        if self.tp > 1:
            parts.append(f"tp:{self.tp}")
        return ",".join(parts)


def _usage(what: str) -> str:
    modes = "; ".join(f"{k}: {v}" for k, v in PARALLEL_MODES.items())
    return (f"{what}. A --parallel spec is comma-separated name[:size] (at most one size left "
            f"out: the world over the others), e.g. fsdp, hsdp:8, fsdp:32,tp:8, "
            f"pp:4,fsdp:16,tp:8. Modes: {modes}")
