"""The parallelism registry: every parallelism simddp knows, registered in one place.

A parallelism is a :class:`Parallelism`: its ``--parallel`` spec name, the mesh dimension its
size fills, what torch runs for it, its capture (the real program on the fake cluster), the
captured type that capture returns, the planner that turns that into a step program, and what
it composes with. :class:`~simddp.program.parallel.Parallel` parses a spec against this
registry once; every stage (CLI, capture choice, planner, engines) reads that one object.

Captures, captured types and planners are named as ``"module:attribute"`` strings and
imported when first used, so the registry (and ``simddp --help``) loads no torch.

Adding a parallelism (context or expert parallelism) is:

1. a capture module (``simddp/cosim/capture_X.py``, a function taking a :class:`CaptureRequest`
   and returning the captured object; see :mod:`simddp.parallelisms` for the built-in ones),
2. a planner module (``simddp/program/X.py``: ``plan_X(captured, checked) -> StepProgram``),
3. one :func:`register` call in :data:`BUILTIN` below (or in your own module, before parsing),
4. tests (a spec parses, the capture runs, the planner passes ``check_planner``).

The mesh is laid out row-major in :data:`MESH_ORDER` (torchtitan's
``pp × dp_replicate × dp_shard × cp × tp``): tensor parallelism innermost.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping

__all__ = ["Parallelism", "CaptureOptions", "CaptureRequest", "register", "get", "names",
           "REGISTRY", "MESH_ORDER", "DATA_DIMS", "resolve", "for_captured", "planner_for"]

# the mesh's row-major order (torchtitan's ParallelDims): pp outermost, tp innermost
MESH_ORDER = ("pp", "replicate", "shard", "cp", "tp")
# what a data-parallel flavour's size fills: "replicate" (all-reduce), "shard" (FSDP's
# shards), "hybrid" (the size shards, the ranks left over replicate)
DATA_DIMS = ("replicate", "shard", "hybrid")


@dataclass(frozen=True)
class Parallelism:
    """One registered parallelism.

    ``name``: its spec name (``"fsdp"``, ``"tp"``, ``"cp"``); ``dim``: the mesh dimension its
    size fills — one of :data:`MESH_ORDER` but ``replicate``/``shard``, or ``"data"`` for a
    data-parallel flavour (at most one per spec; ``layout`` says where its size goes);
    ``help``: one line for ``--help``; ``runs``: what torch runs, when the name maps onto
    another composition (ZeRO names onto FSDP2); ``data``: for a data flavour, the program
    torch runs (``"ddp"``: the Reducer; ``"fsdp"``/``"hsdp"``: FSDP2 on a 1-/2-D mesh);
    ``layout``: for a data flavour, one of :data:`DATA_DIMS`; ``reshard_after_forward``: what
    the flavour fixes of FSDP2's (None: free); ``capture``: ``"module:function"`` taking a
    :class:`CaptureRequest` and returning a ``captured`` (None: another active parallelism's
    capture runs this one inside, as FSDP2's capture runs TP); ``captured``: ``"module:Class"``;
    ``planner``: ``"module:function(captured, checked)"``; ``owner_rank``: where several
    active parallelisms have a capture, the highest rank's captures the whole layout (pp 30 over
    cp 20 over the data flavours 10); ``composes_with``: names of the parallelisms it may be
    combined with (a pair composes if either lists the other); ``refusals``: name → why it does
    not compose with that one (shown instead of the generic reason); ``reserved``: a reason the
    name is refused for now (its capture or planner is not there yet)."""

    name: str
    dim: str
    help: str
    runs: str = ""
    data: str | None = None
    layout: str | None = None
    reshard_after_forward: bool | None = None
    capture: str | None = None
    captured: str | None = None
    planner: str | None = None
    owner_rank: int = 0
    composes_with: frozenset[str] = frozenset()
    refusals: Mapping[str, str] = field(default_factory=dict)
    reserved: str | None = None

    def __post_init__(self) -> None:
        if self.dim != "data" and self.dim not in MESH_ORDER:
            raise ValueError(f"parallelism {self.name!r}: dim {self.dim!r} is not 'data' or "
                             f"one of {MESH_ORDER}")
        if self.dim == "data" and (self.data not in ("ddp", "fsdp", "hsdp")
                                   or self.layout not in DATA_DIMS):
            raise ValueError(f"data flavour {self.name!r} needs data in ddp/fsdp/hsdp and "
                             f"layout in {DATA_DIMS}")
        object.__setattr__(self, "composes_with", frozenset(self.composes_with))

    def composes(self, other: Parallelism) -> bool:
        return other.name in self.composes_with or self.name in other.composes_with

    def why_not(self, other: Parallelism) -> str:
        """Why ``self`` and ``other`` do not compose (their own words where they give them)."""
        reason = self.refusals.get(other.name) or other.refusals.get(self.name)
        if reason:
            return reason
        return (f"{self.name} does not compose with {other.name} ({self.name} composes with: "
                f"{', '.join(sorted(self.composes_with)) or 'nothing'})")

    def load(self, what: str) -> Any:
        """The object ``capture``, ``captured`` or ``planner`` names, imported."""
        ref = getattr(self, what)
        if ref is None:
            raise LookupError(f"parallelism {self.name!r} registers no {what}")
        return _load(ref)


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class CaptureOptions:
    """The choices that change a capture (and so key the on-disk cache): FSDP2's
    ``reshard_after_forward`` and ``MixedPrecisionPolicy`` (``param_dtype`` also casts a DDP
    model), the activation-checkpointing policy (:mod:`simddp.cosim.checkpointing`),
    torchtitan's sequence parallelism with TP, the DDP capture's rank count, and a pipeline's
    schedule, captured microbatch count and size, and virtual stages per rank."""

    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    activation_checkpointing: str | None = None
    sequence_parallel: bool = True
    capture_ranks: int = 1
    pp_schedule: str | None = None
    microbatches: int | None = None
    microbatch_size: int | None = None
    stages_per_rank: int | None = None

    def replace(self, **kw: Any) -> CaptureOptions:
        return replace(self, **kw)


@dataclass(frozen=True)
class CaptureRequest:
    """What a registered capture function receives: the workload (a ``fakepg.zoo.Scenario``),
    the layout (:class:`~simddp.program.parallel.Parallel`, as parsed at the first world size
    it fits), the :class:`~simddp.timing.Timing` the capture runs under, the device ("cpu" or
    "meta"), the seed and the :class:`CaptureOptions`."""

    scenario: Any
    parallel: Any
    timing: Any
    device: str = "cpu"
    seed: int = 0
    options: CaptureOptions = field(default_factory=CaptureOptions)


REGISTRY: dict[str, Parallelism] = {}


def register(p: Parallelism, *, replace_existing: bool = False) -> Parallelism:
    """Add ``p`` to the registry (a name registered twice is an error unless
    ``replace_existing``: the cp helper's registration replaces the reserved ``cp``)."""
    if p.name in REGISTRY and not replace_existing:
        raise ValueError(f"parallelism {p.name!r} is registered already")
    REGISTRY[p.name] = p
    return p


def get(name: str) -> Parallelism:
    """The registered parallelism ``name``; an unknown name lists the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown parallel mode {name!r}: the modes are "
                         f"{', '.join(REGISTRY)}") from None


def names() -> Iterator[str]:
    return iter(REGISTRY)


def resolve(ref: str) -> Any:
    """A ``"module:attribute"`` reference, imported."""
    return _load(ref)


def for_captured(captured: Any) -> Parallelism | None:
    """The first registered parallelism whose captured type ``captured`` is an instance of."""
    for p in REGISTRY.values():
        if p.captured is not None and p.reserved is None and isinstance(captured,
                                                                          _load(p.captured)):
            return p
    return None


def planner_for(captured: Any) -> Callable[[Any, Any], Any]:
    """The planner registered for ``captured``'s type; an unknown type is refused naming the
    captured types that have one."""
    p = for_captured(captured)
    if p is None or p.planner is None:
        known = sorted({p.captured.rpartition(":")[2] for p in REGISTRY.values()
                        if p.captured and p.planner and p.reserved is None})
        raise TypeError(f"no planner for {type(captured).__name__}: the captures replay knows "
                        f"are {', '.join(known)}")
    return p.load("planner")


# -- the built-in parallelisms ----------------------------------------------------------------
_CAP = "simddp.program.captured:"
_DDP_CAPTURE, _FSDP_CAPTURE, _PP_CAPTURE = (f"simddp.parallelisms:{f}" for f in
                                            ("capture_ddp", "capture_fsdp2", "capture_pipeline"))
_FSDP_LIKE = frozenset({"fsdp", "hsdp", "dp", "zero1", "zero2", "zero3", "distributed-optimizer"})
_SHARDED = dict(data="fsdp", layout="shard", capture=_FSDP_CAPTURE, captured=_CAP + "CapturedStep",
                planner="simddp.program.fsdp:plan_fsdp", owner_rank=10,
                composes_with=frozenset({"tp", "pp", "cp"}))
_TP_REASON = ("tensor parallelism is replayed with FSDP2 as the data-parallel layer (fsdp:N,tp:T "
              "or hsdp:S,tp:T, torchtitan's composition; dp:N,tp:T for Megatron-style data "
              "parallelism): DDP over DTensor parameters is not what torch composes with TP")
_PP_REASON = ("pipeline stages are replicated with FSDP2 (pp:P,fsdp:N, pp:P,hsdp:S or "
              "pp:P,dp:N, torchtitan's composition), not DDP")

BUILTIN: tuple[Parallelism, ...] = (
    Parallelism("ddp", "data", "DistributedDataParallel (torch's Reducer and its buckets)",
                data="ddp", layout="replicate", capture=_DDP_CAPTURE,
                captured=_CAP + "CapturedIteration", planner="simddp.program.ddp:plan_ddp",
                owner_rank=10, refusals={"tp": _TP_REASON, "pp": _PP_REASON}),
    Parallelism("fsdp", "data", "FSDP2 fully_shard: parameters, gradients and optimizer state "
                "sharded", **_SHARDED),
    Parallelism("hsdp", "data", "FSDP2 on a replicate × shard mesh: hsdp:S shards over S ranks",
                **{**_SHARDED, "data": "hsdp", "layout": "hybrid"}),
    Parallelism("dp", "data", "Megatron-style data parallelism: parameters replicated, "
                "gradients all-reduced; composes with tp, pp and bf16",
                runs="FSDP2 on a replicate × shard mesh with shard 1 (HSDP with one shard: "
                     "all-reduce over the replicas, MixedPrecisionPolicy for bf16), "
                     "reshard_after_forward=False (parameters stay whole)",
                reshard_after_forward=False,
                **{**_SHARDED, "data": "hsdp", "layout": "replicate"}),
    Parallelism("zero1", "data", "ZeRO-1: optimizer state sharded",
                runs="FSDP2 with reshard_after_forward=False (one all-gather and one "
                     "reduce-scatter a step, optimizer state sharded)",
                reshard_after_forward=False, **_SHARDED),
    Parallelism("zero2", "data", "ZeRO-2: gradients and optimizer state sharded",
                runs="FSDP2 with reshard_after_forward=False", reshard_after_forward=False,
                **_SHARDED),
    Parallelism("zero3", "data", "ZeRO-3: parameters, gradients and optimizer state sharded",
                runs="FSDP2 with reshard_after_forward=True", reshard_after_forward=True,
                **_SHARDED),
    Parallelism("distributed-optimizer", "data", "Megatron's distributed optimizer (optimizer "
                "state and main parameters sharded)",
                runs="FSDP2 with reshard_after_forward=False", reshard_after_forward=False,
                **_SHARDED),
    Parallelism("tp", "tp", "tensor parallelism (DTensor, torchtitan's plan), innermost mesh "
                "dimension; with fsdp, hsdp or dp", composes_with=_FSDP_LIKE | {"pp", "cp"}),
    Parallelism("pp", "pp", "pipeline parallelism (torch.distributed.pipelining), outermost "
                "mesh dimension", capture=_PP_CAPTURE, captured=_CAP + "CapturedPipeline",
                planner="simddp.program.pipeline:plan_pipeline", owner_rank=30,
                composes_with=_FSDP_LIKE | {"tp"}),
    Parallelism("cp", "cp", "context parallelism (torch's ring attention, causal load "
                "balancing), between shard and tp; with fsdp, hsdp or dp (FSDP2 over shard × "
                "cp)", runs="torch's _ContextParallel plan and templated ring attention, "
                "rotate method allgather (torchtitan's default); FSDP2 over the data-parallel "
                "and CP ranks together (torchtitan's dp_shard_cp)",
                capture="simddp.cosim.context_parallel:capture_request",
                captured="simddp.program.context:CapturedCP",
                planner="simddp.program.context:plan_cp", owner_rank=20,
                composes_with=_FSDP_LIKE | {"tp"},
                refusals={"ddp": "context parallelism is replayed with FSDP2 sharding over "
                                 "the data-parallel and CP ranks together (cp:N,fsdp or "
                                 "cp:N,hsdp:S, torchtitan's composition), not with DDP",
                          "pp": "context parallelism inside pipeline stages is not captured "
                                "yet: cp:N composes with fsdp, hsdp, dp and tp"}),
)
for _p in BUILTIN:
    register(_p)
