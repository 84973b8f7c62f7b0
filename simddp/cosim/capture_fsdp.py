"""Capture of an FSDP2 training step: torch's real ``fully_shard`` on the fake cluster, under
virtual time, recorded per rank for the FSDP planner (:mod:`simddp.program.fsdp`).

:func:`capture_fsdp` builds the scenario's model, applies ``fully_shard`` to each block (the
elements of its first ``nn.ModuleList``, else each child that holds parameters) and to the
root — as torchtitan does — on a 1-D (FSDP) or 2-D (HSDP: replicate × shard) ``DeviceMesh``,
or, with tensor parallelism, on the data-parallel submesh of a mesh with an innermost
``"tp"`` dimension, after torchtitan's TP plan
(:func:`~simddp.cosim.tensor_parallel.apply_tensor_parallel`) has sharded the model over
``mesh["tp"]`` (the ranks of a TP group see the same batch). It trains ``iterations`` steps
with the scenario's optimizer and records the last one: per rank and phase (forward,
backward, optimizer) the compute (waits excluded) and every collective issued, in issue
order, at its compute offset, with where the rank waited for it and on which mesh dimension
it ran (``"tp"`` for DTensor's). It also measures what memory needs: the parameters' bytes
(whole, and per TP rank), the optimizer state per rank, and the activations autograd saved
for backward (a ``saved_tensors_hooks`` count of non-parameter storages).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from fakepg.arguments import integer

from ..models import Network
from ..program.captured import CapturedStep
from ..program.mesh import DeviceMesh
from ..timing import Timing
from .blocks import fsdp_units
from .capture import (SavedTotals, rank_batches, probe_costs, train_steps, activation_bytes,
                      saved_bytes, state_bytes)
from .checkpointing import apply as checkpoint_apply
from .checkpointing import checkpointed_modules, is_op, policy_name
from .meta import (DEVICES, fsdp_on_meta, functional_waits_on_meta, fused_attention,
                   in_meta_scope)
from .represent import choose, fill, represented, stand_ins
from .simulate import SimResult, now, simulate
from .tensor_parallel import apply_tensor_parallel

__all__ = ["capture_fsdp", "fsdp_units", "outputs_not_modified_in_place", "checkpoint_units",
           "checkpoint_blocks", "span_profile", "PHASES", "PHASE_BOUNDS", "shard_model",
           "step_marks", "sharded_capture_scope", "sharded_step_fields"]

PHASES = ("forward", "backward", "optimizer")
# each phase of a recorded step: from one mark of train_steps to the next
PHASE_BOUNDS = {"forward": ("start", "backward"), "backward": ("backward", "backward_done"),
                "optimizer": ("backward_done", "end")}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


@contextlib.contextmanager
def outputs_not_modified_in_place() -> Iterator[None]:
    """FSDP2 warns of every module output that is a view (DTensor's sequence shards are) in
    case the program modifies it in place; the zoo's models and stages never do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view "
                                "tensor")
        yield


@contextlib.contextmanager
def sharded_capture_scope(device: str) -> Iterator[None]:
    """What a capture of FSDP2 runs under: on meta, FSDP2 and functional collectives' waits
    working without data (:mod:`simddp.cosim.meta`); FSDP2's warnings of view outputs off."""
    with (fsdp_on_meta() if device == "meta" else contextlib.nullcontext()), \
            (functional_waits_on_meta() if device == "meta" else contextlib.nullcontext()), \
            outputs_not_modified_in_place():
        yield


def torch_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"unknown mixed-precision dtype {name!r}: give one of "
                         f"{', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def checkpoint_units(model: torch.nn.Module, device: str = "cpu", policy: Any = "full") -> None:
    """Activation checkpointing of the model's blocks, the elements of its first
    ``nn.ModuleList``, as ``policy`` says (:func:`checkpoint_blocks`)."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m):
            checkpoint_blocks(m, device, policy)
            return
    raise ValueError(f"activation checkpointing wraps the model's blocks, the elements of an "
                     f"nn.ModuleList; {type(model).__name__} has none")


def checkpoint_blocks(blocks: torch.nn.ModuleList, device: str = "cpu",
                      policy: Any = "full") -> None:
    """``blocks`` (in place) under torch's ``checkpoint_wrapper`` as torchtitan's ``policy``
    says (full, selective-op, selective-layer:N): :func:`simddp.cosim.checkpointing.apply`."""
    checkpoint_apply(blocks, policy, device)


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's: its local shard)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def shard_model(model: torch.nn.Module, mesh: Any, reshard_after_forward: bool,
                mp: tuple[str | None, str | None]) -> None:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on each unit (:func:`fsdp_units`), then
    on the root, over ``mesh`` with the mixed-precision policy ``mp`` (param and reduce dtype
    names, None: the parameters' own)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch_dtype(mp[0]), reduce_dtype=torch_dtype(mp[1]))
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=policy)


def step_marks(last: int) -> tuple[dict[str, float], Callable[[int, str], None]]:
    """The virtual times where step ``last``'s phases begin and end (filled as it runs), and
    the ``mark(i, phase)`` that :func:`~simddp.cosim.capture.train_steps` calls."""
    marks: dict[str, float] = {}

    def mark(i: int, phase: str) -> None:
        if i == last:
            marks[phase] = now()
    return marks, mark


def _rank_run(scenario: Any, mesh_dims: Mapping[str, int], iterations: int,
              reshard_after_forward: bool, mp: tuple[str | None, str | None], device: str,
              checkpointed: Any, sequence_parallel: bool = True):
    last = iterations - 1
    def _run(rank: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", tuple(mesh_dims.values()),
                                mesh_dim_names=tuple(mesh_dims))
        with torch.device(device):  # on meta: parameters without storage
            model = scenario.build_model()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        tp = mesh_dims.get("tp", 1)
        dp_dims = tuple(d for d in mesh_dims if d != "tp")
        if tp > 1:  # torchtitan: TP first, then FSDP2 on the data-parallel submesh
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        local_param_bytes = local_bytes(model)
        dp_mesh = mesh[dp_dims] if len(dp_dims) < len(mesh_dims) else mesh
        if checkpointed:
            checkpoint_units(model, device, checkpointed)
        shard_model(model, dp_mesh, reshard_after_forward, mp)
        opt = scenario.optimizer(model.parameters())
        marks, mark = step_marks(last)
        # the ranks of a TP group train on their data-parallel rank's batch
        train_steps(scenario, model, opt, rank_batches(scenario, rank // tp, dist.get_world_size() // tp,
                                              iterations, device), mark)
        return {"marks": marks, "param_bytes": param_bytes,
                "local_param_bytes": local_param_bytes,
                "optimizer_state_bytes": state_bytes(opt)}

    return in_meta_scope(device, _run)


def _scope(group_ranks: tuple[int, ...], rank: int, mesh: DeviceMesh) -> str:
    """The mesh dimension whose group (through ``rank``) is ``group_ranks``."""
    members = set(group_ranks) if group_ranks else set(range(mesh.world))
    for dim in mesh.dims:
        if set(mesh.members(rank, dim)) == members:
            return dim
    return "world" if len(members) == mesh.world else "other"


def span_profile(res: SimResult, rank: int, windows: Sequence[tuple], mesh: DeviceMesh,
                 skip: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """What ``rank`` did in ``windows`` (virtual-time intervals ``(t0, t1)``, in order, taken
    back to back): ``{"seconds": compute, waits excluded, "events": [{"op", "bytes", "scope",
    "offset", "wait_at"}]}`` — each collective issued in a window (except those
    ``skip(record)`` drops), at its compute offset since the first window's start, with the
    offset where the rank waited for it in that window (None: not there) and its mesh
    dimension (``scope``). A window ``(t0, t1, first, end)`` holds the rank's trace records
    ``first:end`` (counted with :func:`~simddp.cosim.simulate.issued`), whatever their time."""
    waits = [(s.start, s.end) for s in res.timeline.rank_spans(rank, ("wait",))]
    waited = _wait_total(waits)

    events: list[dict[str, Any]] = []
    before = 0.0  # compute in the earlier windows
    for t0, t1, *span in windows:
        records = res.trace[rank][span[0]:span[1]] if span else [
            rec for rec in res.trace[rank] if rec.issue is not None and t0 <= rec.issue < t1]
        if span and records and not t0 <= records[0].issue <= records[-1].issue <= t1:
            raise RuntimeError(f"span_profile: rank {rank}'s trace records {span[0]}:{span[1]} "
                               f"were not issued in its window [{t0}, {t1}]")
        for rec in records:
            if rec.issue is None or (skip and skip(rec)):
                continue
            offset = max(0.0, rec.issue - t0 - waited(t0, rec.issue))
            wait_at = None
            for s, e in waits:  # the wait that ends when this collective ends
                if rec.end is not None and rec.issue <= s < t1 and e == rec.end:
                    wait_at = before + max(offset, s - t0 - waited(t0, s))
                    break
            events.append({"op": rec.op, "bytes": int(rec.bytes),
                           "scope": _scope(rec.group_ranks, rank, mesh),
                           "offset": before + offset, "wait_at": wait_at})
        before += (t1 - t0) - waited(t0, t1)
    return {"seconds": before, "events": events}


def _wait_total(waits: Sequence[tuple[float, float]]) -> Callable[[float, float], float]:
    """``waited(lo, hi)``: the time the spans ``waits`` cover inside ``[lo, hi]``. A rank's
    waits follow one another, so a prefix sum answers each call in log time (a capture at real
    size asks once per collective, thousands of times); overlapping spans are summed one by
    one."""
    starts = [s for s, _ in waits]
    ends = [e for _, e in waits]
    if any(s < e0 for s, e0 in zip(starts[1:], ends)) or any(e < s for s, e in waits):
        return lambda lo, hi: sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in waits)
    prefix = [0.0]
    for s, e in waits:
        prefix.append(prefix[-1] + (e - s))

    def waited(lo: float, hi: float) -> float:
        a, b = bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi) - 1
        if a > b:
            return 0.0
        total = prefix[b + 1] - prefix[a] - max(0.0, lo - starts[a]) - max(0.0, ends[b] - hi)
        return max(0.0, total)

    return waited


def _phase_profile(res: SimResult, rank: int, marks: Mapping[str, float],
                   mesh: DeviceMesh) -> dict[str, Any]:
    """Per phase: compute seconds (waits excluded) and the collectives issued in it."""
    return {phase: span_profile(res, rank, [(marks[a], marks[b])], mesh)
            for phase, (a, b) in PHASE_BOUNDS.items()}


def _tp_activation_bytes(scenario: Any, tp: int, device: str, dtype: torch.dtype | None,
                         sequence_parallel: bool, checkpointed: Any,
                         represent: bool = False) -> SavedTotals:
    """What autograd keeps for backward in one forward (and loss) of rank 0 of a TP group of
    ``tp`` ranks (torchtitan's plan applied), on rank 0's first batch: (held, recompute) per
    rank as :func:`~simddp.cosim.capture.saved_bytes` counts them — with ``checkpointed`` the
    blocks' inputs and what is saved outside them, and the largest block's recompute. TP
    divides them (sequence parallelism: all of them; without: those inside the blocks'
    sharded matmuls). Run on an untimed fake world (saved-tensor hooks add ops the compute
    model would charge); with ``represent`` (on meta) rank 0 alone, its peers' collectives
    answered by stand-ins (:mod:`simddp.cosim.represent`)."""
    import fakepg

    def run(rank: int) -> tuple[int, int]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        with torch.device(device):
            model = scenario.build_model()
        if dtype is not None:
            model = model.to(dtype)
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        batch = rank_batches(scenario, 0, 1, 1, device)[0]
        return saved_bytes(lambda: scenario.step(model, batch), device,
                           checkpointed_modules(fsdp_units(model), checkpointed)
                           if checkpointed else None, model.parameters(),
                           op_saved=is_op(checkpointed))  # temporaries: not under DTensor

    # on meta the TP ranks are symmetric: rank 0 runs, its collectives answered for the rest
    fn = represented(run, stand_ins({"tp": tp}) if represent else {})
    saved = fakepg.spawn(fn, nprocs=tp).returns[0]
    return SavedTotals(*saved, getattr(saved, "sizes", ()), getattr(saved, "temporary", 0))


def capture_fsdp(scenario: Any, nprocs: int = 2, *, timing: Timing | None = None,
                 mesh: Mapping[str, int] | None = None, reshard_after_forward: bool = True,
                 param_dtype: str | None = None, reduce_dtype: str | None = None,
                 iterations: int = 2, seed: int = 0, device: str = "cpu",
                 activation_checkpointing: Any = False,
                 sequence_parallel: bool = True,
                 representatives: bool | None = None) -> CapturedStep:
    """Run ``scenario`` with FSDP2 on ``nprocs`` fake ranks under :func:`simddp.simulate` and
    record its last step (see the module docstring). ``mesh``: ``{"shard": n}`` (FSDP, the
    default) or ``{"replicate": r, "shard": s}`` (HSDP), either with an innermost ``"tp": t``
    (tensor parallelism over groups of t consecutive ranks; ``sequence_parallel``: torchtitan's
    sequence-parallel plan, its default); ``param_dtype`` / ``reduce_dtype``:
    the ``MixedPrecisionPolicy`` ("bf16", "fp16", "fp32"; None: the parameters' own).
    ``device="meta"``: at real size without arithmetic (see :mod:`simddp.cosim.meta`): shapes,
    dtypes and collectives are real, the compute model costs each op from its shapes.
    ``activation_checkpointing``: a policy of :mod:`simddp.cosim.checkpointing` (True: "full",
    each block under torch's ``checkpoint_wrapper``; "selective-op", "selective-layer:N"),
    applied after tensor parallelism and before FSDP2, as torchtitan orders them: backward
    recomputes its forward (and, under TP, its collectives), and it keeps only its input until
    then; the recorded activations are per TP rank. ``representatives``: run one rank for all
    (:mod:`simddp.cosim.represent`: every rank of the mesh does the same work on its shards,
    so rank 0 runs and its groups' collectives are answered as the full world answers them;
    the same capture at the cost of one rank); None (the default): where it holds (on meta,
    with a symmetric timing and placement), False: every rank runs, True: refuse where it
    does not hold."""
    if device not in DEVICES:
        raise ValueError(f"capture_fsdp: device must be one of {', '.join(DEVICES)}, "
                         f"got {device!r}")
    iterations = integer("capture_fsdp: iterations", iterations, minimum=2,
                         hint="the last step is recorded once the optimizer has its state")
    mesh_dims = dict(mesh or {"shard": nprocs})
    size = 1
    for v in mesh_dims.values():
        size *= integer("capture_fsdp: a mesh dimension", v, minimum=1)
    order = [d for d in ("replicate", "shard", "tp") if d in mesh_dims]
    if size != nprocs or list(mesh_dims) != order or "shard" not in mesh_dims:
        raise ValueError(f"capture_fsdp: mesh {mesh_dims} must be {{'shard': s}} or "
                         f"{{'replicate': r, 'shard': s}}, optionally followed by 'tp': t "
                         f"(innermost), with r × s × t = {nprocs}")
    tp = mesh_dims.get("tp", 1)
    torch_dtype(param_dtype), torch_dtype(reduce_dtype)
    ac = policy_name(activation_checkpointing) or False
    timing = Timing() if timing is None else timing
    stand = choose(mesh_dims, timing, device, representatives, "capture_fsdp")
    run = _rank_run(scenario, mesh_dims, iterations, bool(reshard_after_forward),
                    (param_dtype, reduce_dtype), device, ac, bool(sequence_parallel))
    with sharded_capture_scope(device):
        res = simulate(represented(run, stand), (), nprocs, timing=timing,
                       seed=seed)
        if tp > 1:
            saved = _tp_activation_bytes(
                scenario, tp, device, torch_dtype(param_dtype), bool(sequence_parallel), ac,
                represent=device == "meta" and representatives is not False)
    if tp == 1:
        saved = activation_bytes(scenario, device, torch_dtype(param_dtype), fsdp_units, ac,
                                 temporaries=True)
    held, recompute = saved
    r0 = res.returns[0]
    last = iterations - 1
    dmesh = DeviceMesh(nprocs, mesh_dims)
    profiles = [None if r in stand else _phase_profile(res, r, o["marks"], dmesh)
                for r, o in enumerate(res.returns)]
    return CapturedStep(
        **sharded_step_fields(scenario, mesh_dims, r0, reshard_after_forward, param_dtype,
                              reduce_dtype, sequence_parallel),
        profiles=fill(profiles, stand),
        activation_bytes=held, recompute_bytes=recompute,
        activation_sizes=list(saved.sizes), temporary_bytes=saved.temporary,
        activation_checkpointing=bool(activation_checkpointing),
        **cosim_facts(timing, res, last))


def sharded_step_fields(scenario: Any, mesh_dims: Mapping[str, int], r0: Mapping[str, Any],
                        reshard_after_forward: bool, param_dtype: str | None,
                        reduce_dtype: str | None, sequence_parallel: bool) -> dict[str, Any]:
    """The fields of a :class:`~simddp.program.captured.ShardedStep` that the capture's
    arguments and rank 0's return (``r0``: parameter and optimizer-state bytes) give."""
    return dict(name=str(getattr(scenario, "name", "scenario")),
                parallel="hsdp" if "replicate" in mesh_dims else "fsdp",
                world_size=math.prod(mesh_dims.values()), mesh=mesh_dims,
                reshard_after_forward=bool(reshard_after_forward), param_dtype=param_dtype,
                reduce_dtype=reduce_dtype, param_bytes=int(r0["param_bytes"]),
                local_param_bytes=int(r0["local_param_bytes"]),
                sequence_parallel=bool(sequence_parallel) if mesh_dims.get("tp", 1) > 1
                else False,
                optimizer_state_bytes=int(r0["optimizer_state_bytes"]))


def cosim_facts(timing: Timing, res: SimResult, it: int) -> dict[str, Any]:
    """What a sharded capture keeps of its co-simulation: the network and compute models,
    and iteration ``it``'s time and exposed communication (to check replay against)."""
    return dict(network=(timing.network.to_dict()
                         if isinstance(timing.network, Network) else None),
                compute=repr(timing.compute), costs=probe_costs(timing.compute),
                cosim_iteration_time=res.timeline.iteration_times()[it],
                cosim_exposed_comm=res.timeline.exposed_comm()[it])
