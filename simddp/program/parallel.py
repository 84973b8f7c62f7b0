"""How a what-if lays its world out: ``--parallel`` specs such as ``fsdp``, ``hsdp:8``,
``fsdp:32,tp:8``, ``dp:8,tp:8`` or ``pp:4,fsdp:16,tp:8``.

A spec is comma-separated dimensions ``name[:size]``; at most one size may be left out and is
the world size over the others. The names are the parallelisms of the registry
(:mod:`simddp.program.registry`, listed by :data:`PARALLEL_MODES`):

* data-parallel flavours (at most one): ``ddp`` — DistributedDataParallel (torch's Reducer);
  ``fsdp`` — FSDP2 ``fully_shard`` over the dimension; ``hsdp:S`` — FSDP2 on a 2-D mesh,
  sharding over groups of S ranks and replicating across the rest; ``dp`` — Megatron-style
  data parallelism (replicated parameters, all-reduced gradients), run as FSDP2 on a
  replicate × shard mesh with one shard, so it composes with ``tp``/``pp`` and bf16;
  ``zero1``/``zero2``/``distributed-optimizer`` — FSDP2 with ``reshard_after_forward=False``;
  ``zero3`` — FSDP2 with ``reshard_after_forward=True`` (docs/parallelisms.md says why);
* ``tp`` — tensor parallelism (DTensor ``parallelize_module``), innermost;
* ``pp`` — pipeline parallelism (``torch.distributed.pipelining``), outermost;
* ``cp`` — context parallelism, between the data dimensions and ``tp`` (reserved until its
  capture and planner are registered).

:meth:`Parallel.parse` resolves a spec once, for one world size, into a :class:`Parallel`;
every stage reads that object. :meth:`Parallel.not_replayed` says why a layout that parses
cannot be replayed (two parallelisms that do not compose); :meth:`Parallel.fixed_world_size`
is the world a spec lays out when it gives every size.

The mesh is laid out as torchtitan lays it out, row-major ``pp × replicate × shard × cp × tp``
(tensor parallelism innermost, so it stays inside a node when it fits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .registry import MESH_ORDER, REGISTRY, Parallelism

__all__ = ["Parallel", "PARALLEL_MODES", "UsageError"]


class UsageError(ValueError):
    """A request that cannot be answered as asked — a malformed ``--parallel`` spec, an
    option that does not apply to the layout — as opposed to a failure while answering it.
    The command line reports it as a usage error (exit status 2)."""


class _Modes(Mapping):
    """name → help of every registered parallelism, read live from the registry (so
    ``--help`` lists what is registered now)."""

    def __getitem__(self, k: str) -> str:
        return REGISTRY[k].help

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)


PARALLEL_MODES: Mapping[str, str] = _Modes()


@dataclass(frozen=True)
class Parallel:
    """A resolved layout: the data-parallel flavour and every mesh dimension's size.

    ``data``: what torch runs for data parallelism (``ddp``, ``fsdp`` or ``hsdp``);
    ``flavour``: the spec's name for it (``dp``, ``zero3``, ...; the same as ``data`` for
    those three); ``replicate × shard`` is the data-parallel size (ddp: ``replicate`` is
    the DDP size and ``shard`` 1; fsdp: ``shard`` the FSDP size; hsdp: both; dp: ``replicate``
    with ``shard`` 1); ``reshard_after_forward``: what the flavour fixes (ZeRO names), else None;
    ``named``: the parallelisms the spec named, in its order."""

    data: str = "ddp"
    pp: int = 1
    replicate: int = 1
    shard: int = 1
    tp: int = 1
    cp: int = 1
    flavour: str = ""
    reshard_after_forward: bool | None = None
    named: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.flavour:
            object.__setattr__(self, "flavour", self.data)

    @classmethod
    def parse(cls, spec: str | Parallel, world_size: int) -> Parallel:
        """The layout ``spec`` (see the module docstring) describes for ``world_size`` ranks
        (a :class:`Parallel` is checked against the world and returned as is). Errors name
        what is wrong in the spec."""
        if isinstance(spec, Parallel):
            if spec.world_size != world_size:
                raise UsageError(f"--parallel {spec}: lays out {spec.world_size} ranks, the "
                                 f"world has {world_size}")
            return spec
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"a world size is a positive integer, got {world_size!r}")
        named, sizes = _split(spec)
        flavour = next((n for n in named if REGISTRY[n].dim == "data"), None)
        fl = REGISTRY[flavour or "ddp"]
        dims = {REGISTRY[n].dim: sizes[n] for n in named}
        dims.setdefault("data", None)
        hybrid = fl.layout == "hybrid"
        if hybrid and dims["data"] is None:
            raise UsageError(_usage(f"{spec!r}: {fl.name} needs its shard size, e.g. "
                                    f"{fl.name}:8"))
        given = {k: v for k, v in dims.items() if v is not None}
        missing = [k for k, v in dims.items() if v is None]
        known = math.prod(given.values())
        if hybrid:  # hsdp:S fixes the shard size; the replicate size is what is left
            if missing:
                raise UsageError(_usage(f"{spec!r}: {fl.name}'s replicas fill the world, so "
                                        f"give {' and '.join(missing)} a size"))
            if world_size % known:
                raise UsageError(f"--parallel {spec!r}: {known} ranks per replica do not "
                                 f"divide world size {world_size}")
            replicate, data = world_size // known, dims["data"]
        else:
            if len(missing) > 1:
                raise UsageError(_usage(f"{spec!r} leaves {' and '.join(missing)} without a "
                                        f"size: give all but one"))
            if missing:
                if world_size % known:
                    raise UsageError(f"--parallel {spec!r}: the given sizes ({known} ranks) do "
                                     f"not divide world size {world_size}")
                dims[missing[0]] = world_size // known
            total = math.prod(v for v in dims.values() if v is not None)
            if total != world_size:
                raise UsageError(f"--parallel {spec!r} lays out {total} ranks, the world has "
                                 f"{world_size}")
            data = dims["data"] or 1
            replicate = data if fl.layout == "replicate" else 1
            data = 1 if fl.layout == "replicate" else data
        return cls(fl.data or "ddp", dims.get("pp") or 1, replicate, data, dims.get("tp") or 1,
                   dims.get("cp") or 1, fl.name, fl.reshard_after_forward, tuple(named))

    @staticmethod
    def fixed_world_size(spec: str) -> int | None:
        """The world size ``spec`` lays out when it gives every size (``pp:4,fsdp:16,tp:8``:
        512), else None (a size left out, or ``hsdp:S`` whose replicas fill the world). A
        malformed spec raises as :meth:`parse` does."""
        named, sizes = _split(spec)
        if any(v is None for v in sizes.values()) or \
                any(REGISTRY[n].layout == "hybrid" for n in named):
            return None
        return math.prod(v for v in sizes.values() if v is not None)

    def parallelisms(self) -> list[Parallelism]:
        """The registered parallelisms this layout runs: the data flavour (when larger than 1,
        or an FSDP2 flavour named) and every other dimension larger than 1."""
        out = []
        # DDP over one replica is no DDP; an FSDP2 flavour named at size 1 still wraps
        if self.data_size > 1 or (self.flavour in self.named and self.data != "ddp"):
            out.append(REGISTRY[self.flavour])
        for dim in ("pp", "cp", "tp"):
            if getattr(self, dim) > 1:
                out.append(next(p for p in REGISTRY.values() if p.dim == dim and
                                (p.name in self.named or p.name == dim)))
        return out

    def not_replayed(self) -> str | None:
        """Why this layout cannot be replayed (None: it can): a reserved parallelism, or two
        that do not compose."""
        active = self.parallelisms()
        for p in active:
            if p.reserved:
                return p.reserved
        for i, a in enumerate(active):
            for b in active[i + 1:]:
                if not a.composes(b):
                    return a.why_not(b)
        return None

    def owner(self) -> Parallelism:
        """The parallelism whose capture records this layout (the highest ``owner_rank``
        among the active ones with a capture; the data flavour's otherwise)."""
        with_capture = [p for p in self.parallelisms() if p.capture is not None]
        if not with_capture:
            return REGISTRY[self.flavour]
        return max(with_capture, key=lambda p: p.owner_rank)

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.cp * self.tp

    @property
    def data_size(self) -> int:
        """The data-parallel degree (replicate × shard)."""
        return self.replicate * self.shard

    def dims(self) -> dict[str, int]:
        """Every mesh dimension's size, in :data:`MESH_ORDER`."""
        return {k: getattr(self, k) for k in MESH_ORDER}

    def mesh(self) -> Any:
        """The device mesh (:class:`~simddp.program.mesh.DeviceMesh`): the data-parallel
        flavour's own dimensions, and the others that are larger than 1."""
        from .mesh import DeviceMesh

        own = {"ddp": ("replicate",), "fsdp": ("shard",), "hsdp": ("replicate", "shard")}
        kept = {k: v for k, v in self.dims().items() if v > 1 or k in own[self.data]}
        return DeviceMesh(self.world_size, kept)

    def capture_key(self) -> str:
        """What a capture of this layout depends on (the on-disk cache's layout key): the
        flavour torch runs and the sizes that shape each rank's program."""
        return (f"{self.owner().name}/{self.data}/{self.flavour}/pp{self.pp}/cp{self.cp}/"
                f"tp{self.tp}/raf{self.reshard_after_forward}")

    def __str__(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pp:{self.pp}")
        fl = REGISTRY.get(self.flavour)
        if fl is not None and fl.layout == "hybrid":
            parts.append(f"{self.flavour}:{self.replicate}x{self.shard}")
        elif self.data_size > 1 or self.flavour in self.named or self.world_size == 1:
            parts.append(f"{self.flavour}:{self.data_size}")
        if self.cp > 1:
            parts.append(f"cp:{self.cp}")
        if self.tp > 1:
            parts.append(f"tp:{self.tp}")
        return ",".join(parts)


def _split(spec: Any) -> tuple[list[str], dict[str, int | None]]:
    """A spec's names in order and their sizes (None: left out); grammar errors raise, and a
    reserved name is refused with its reason."""
    if not isinstance(spec, str):
        raise UsageError(_usage(f"a --parallel spec is text, got {spec!r}"))
    text = spec.strip().lower()
    if not text:
        raise UsageError(_usage("an empty --parallel spec"))
    named: list[str] = []
    sizes: dict[str, int | None] = {}
    dims: dict[str, str] = {}
    for part in text.split(","):
        name, colon, size = (s.strip() for s in part.strip().partition(":"))
        if not name:
            raise UsageError(_usage(f"{spec!r} has an empty dimension (two commas, or a "
                                    f"leading or trailing one)"))
        if name not in REGISTRY:
            raise UsageError(_usage(f"unknown parallel mode {name!r} in {spec!r}"))
        p = REGISTRY[name]
        if p.reserved:
            raise UsageError(f"--parallel {spec!r}: {p.reserved}")
        if p.dim in dims:
            same = "twice" if dims[p.dim] == name else f"twice ({dims[p.dim]} and {name})"
            raise UsageError(_usage(f"{spec!r} names the {p.dim} dimension {same}"))
        dims[p.dim] = name
        if colon and not size:
            raise UsageError(_usage(f"{part.strip()!r}: a size after ':' is a positive "
                                    f"integer (or leave out ':' to fill the world)"))
        if not size:
            sizes[name] = None
        elif not size.isdigit() or int(size) < 1:
            raise UsageError(_usage(f"{part.strip()!r}: a size is a positive integer"))
        else:
            sizes[name] = int(size)
        named.append(name)
        if p.layout == "hybrid" and sizes[name] is None:
            raise UsageError(_usage(f"{spec!r}: {name} needs its shard size, e.g. {name}:8"))
    return named, sizes


def _usage(what: str) -> str:
    modes = ", ".join(n for n, p in REGISTRY.items() if not p.reserved)
    return (f"{what}. A --parallel spec is comma-separated name[:size] (at most one size left "
            f"out: the world over the others), e.g. fsdp, hsdp:8, fsdp:32,tp:8, dp:8,tp:8, "
            f"pp:4,fsdp:16,tp:8. Modes: {modes} (simddp whatif --help says what each runs)")


# -- a replayed layout against its capture (the planners' errors) ----------------------------
def layout_not_captured(spec: str, captured: str, cap_name: str,
                        how: str = "simddp whatif --parallel does, per layout") -> ValueError:
    """The error of a planner asked to replay ``spec`` on a capture (``cap_name``) of another
    layout (``captured``, e.g. "FSDP"): a capture holds one layout's collectives."""
    return ValueError(f"parallel={spec!r} cannot replay a {captured} capture ({cap_name}): "
                      f"capture the layout you replay ({how})")


def degrees_not_captured(spec: str, has: str, cap_name: str, ran: str, depends: str,
                         what: str, how: str) -> ValueError:
    """The error of a planner asked to replay degrees (``has``, e.g. "cp=4, tp=2") other than
    the capture's (``ran``): what each rank does ``depends`` on them, so ``how`` captures the
    ``what`` replayed."""
    return ValueError(f"parallel={spec!r} has {has}; the capture of {cap_name} ran with {ran}: "
                      f"each rank's {depends}, so capture the {what} you replay ({how})")
