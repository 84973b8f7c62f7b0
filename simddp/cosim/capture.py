"""Capture: one DDP iteration of a scenario, recorded from co-simulation for replay.

:func:`capture` runs a scenario (a ``models.Scenario``, or any object with its attributes:
``name``, ``ddp_kwargs``, ``build_model()``, ``optimizer(params)``, ``inputs(rank,
world_size)``, ``step(model, batch)``) under :func:`simddp.simulate` on the fake cluster —
torch's real DDP and Reducer — and records its last iteration per rank; see
:mod:`simddp.replay` for what is recorded and how replay uses it. The end-of-backward wait
comes from the co-simulation's :class:`~simddp.cosim.simulate.Observer`; the training loop
is :func:`train_steps`, the one piece to swap for the zoo's own loop.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import torch

from fakepg.arguments import integer

from ..models import Network
from ..timing import Timing
from ..program.captured import CapturedIteration, ParamInfo, RankProfile, parse_indices
from .meta import DEVICES, fsdp_on_meta, meta_scope
from .simulate import Observer, SimResult, now, simulate
# the step's bytes are step_bytes.py's; the other captures import them from here too
from .step_bytes import SavedTotals, saved_bytes, state_bytes

__all__ = ["capture", "capture_workload", "PARALLEL"]

_FLOATS = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")


def train_steps(scenario: Any, model: Any, opt: Any, batches: list,
           mark: Callable[[int, str], None]) -> None:
    """The zoo's training loop (``models/scenario.py``), calling ``mark(i, phase)`` at each
    phase boundary of iteration ``i``: "start", "backward" (loss computed), "backward_done",
    "end" (optimizer step done)."""
    for i, batch in enumerate(batches):
        mark(i, "start")
        opt.zero_grad()
        loss = scenario.step(model, batch)
        mark(i, "backward")
        loss.backward()
        mark(i, "backward_done")
        opt.step()
        mark(i, "end")


def activation_bytes(scenario: Any, device: str = "cpu", dtype: torch.dtype | None = None,
                     units: Callable[[torch.nn.Module], list] | None = None,
                     checkpointed: Any = False, temporaries: bool = False) -> SavedTotals:
    """Bytes autograd saves for backward in one forward (and loss) of ``scenario``'s model on
    rank 0's first batch, run plainly (no ranks, no virtual time; on the meta device for a
    real-size capture; ``dtype``: the parameters' compute dtype, e.g. FSDP2's
    ``MixedPrecisionPolicy.param_dtype``). Returns (held from forward to backward, held only
    while one unit is recomputed in backward): see :func:`saved_bytes`, with ``units(model)``
    checkpointed as the policy ``checkpointed`` says (:mod:`simddp.cosim.checkpointing`; True:
    full); ``temporaries``: measure the step's temporaries too (a backward is run)."""
    from .checkpointing import checkpointed_modules, is_op

    with torch.device(device):
        model = scenario.build_model()
    if dtype is not None:
        model = model.to(dtype)
    batch = rank_batches(scenario, 0, 1, 1, device)[0]
    return saved_bytes(lambda: scenario.step(model, batch), device,
                       checkpointed_modules(units(model), checkpointed)
                       if checkpointed and units is not None else None,
                       model.parameters(), temporaries, op_saved=is_op(checkpointed))


def rank_batches(scenario: Any, rank: int, world_size: int, iterations: int,
             device: str = "cpu") -> list:
    """``iterations`` batches of ``rank``, the scenario's batches repeated as needed (on the
    meta device: ``scenario.inputs(..., device="meta")``, drawn on CPU and moved)."""
    data = list(scenario.inputs(rank, world_size) if device == "cpu"
                else scenario.inputs(rank, world_size, device=device))
    if not data:
        raise ValueError(f"scenario {getattr(scenario, 'name', scenario)!r} gives rank {rank} "
                         f"no batches")
    return [data[i % len(data)] for i in range(iterations)]


class _Recorder(Observer):
    """Per rank: whether the recorded iteration's backward runs, and its end-of-backward
    wait ``(start, end)`` (the first one of that backward)."""

    def __init__(self, nprocs: int) -> None:
        self.on = [False] * nprocs
        self.eob: list[tuple[float, float] | None] = [None] * nprocs

    def backward_waited(self, rank: int, start: float, end: float) -> None:
        if self.on[rank] and self.eob[rank] is None:
            self.eob[rank] = (start, end)


def _expects_sparse_gradient(module: torch.nn.Module) -> bool:
    """DDP's ``_check_if_sparse_gradient``: an Embedding(Bag) with ``sparse=True``."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) \
        and bool(module.sparse)


def _reducer_params(ddp: Any) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module]]:
    """DDP's parameter list for its Reducer (``_build_params_for_reducer``): per module, its own
    parameters that require grad and are not ignored, deduplicated."""
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    out, memo = [], set()
    for mname, module in ddp.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if not p.requires_grad or full in ignore or p in memo:
                continue
            memo.add(p)
            out.append((full, p, module))
    return out


def probe_costs(compute: Any) -> dict[str, float] | None:
    """A roofline summary of ``compute``: per-op overhead, bytes/s of a copy, FLOP/s of a
    matmul — used to cost comm-hook compression in replay. None if the model cannot say."""
    aten = torch.ops.aten
    try:
        def t(*shape: int) -> torch.Tensor:
            return torch.empty(shape, device="meta")
        tiny = t(1)
        overhead = float(compute.op_time(aten.add.Tensor, (tiny, tiny), {}, tiny))
        n = 1 << 22
        a, b = t(n), t(n)
        copy = float(compute.op_time(aten.copy_.default, (a, b), {}, a)) - overhead
        m = 2048
        x = t(m, m)
        mm = float(compute.op_time(aten.mm.default, (x, x), {}, x)) - overhead
    except Exception:  # noqa: BLE001 - a profile-based model knows no such ops
        return None
    if not (copy > 0 and mm > 0 and overhead >= 0):
        return None
    return {"overhead_s": overhead, "bytes_per_s": 2 * 4 * n / copy,
            "flops_per_s": 2.0 * m ** 3 / mm}


def _ddp_config(model: Any) -> dict[str, Any]:
    """The Reducer's bucket caps and flags, as CapturedIteration fields."""
    cfg = getattr(model, "_bucket_config", None)
    return dict(
        bucket_cap_bytes=int(model.bucket_bytes_cap),
        first_bucket_bytes=int(getattr(cfg, "first_bucket_bytes_cap", model.bucket_bytes_cap)),
        bucket_cap_bytes_list=[int(x) for x in getattr(cfg, "per_bucket_bytes_caps", ())],
        find_unused_parameters=bool(model.find_unused_parameters),
        static_graph=bool(getattr(model, "static_graph", False)),
        gradient_as_bucket_view=bool(model.gradient_as_bucket_view))


def _wrap(module: torch.nn.Module, parallel: str, kwargs: Mapping[str, Any],
          device: str) -> Any:
    """``module`` under DDP, or sharded with FSDP2 as torchtitan shards a decoder: each
    block (:func:`~simddp.cosim.blocks.fsdp_units`), then the root, on a 1-D mesh of
    the world."""
    if parallel == "ddp":
        if device == "meta":
            kwargs = {**kwargs, "init_sync": False}  # see simddp.cosim.meta
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(module, **kwargs)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .blocks import fsdp_units

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in fsdp_units(module):
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(module, mesh=mesh, **kwargs)


def _fsdp_groups(model: Any) -> list[dict[str, Any]]:
    """FSDP2's parameter groups in module order: the module, its parameters (global shape,
    dtype, this rank's padded shard) and the policy that sizes its collectives."""
    out = []
    for fqn, module in model.named_modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is None:
            continue
        mp = group.mp_policy
        out.append({
            "module": fqn,
            "params": [{"name": p._param_fqn, "shape": list(p._orig_size),
                        "dtype": str(p.orig_dtype).replace("torch.", ""),
                        "padded_shard_numel": int(p.padded_sharded_param_size.numel())}
                       for p in group.fsdp_params],
            "reshard_after_forward": group.post_forward_mesh_info is not None,
            "param_dtype": None if mp.param_dtype is None
            else str(mp.param_dtype).replace("torch.", ""),
            "reduce_dtype": None if mp.reduce_dtype is None
            else str(mp.reduce_dtype).replace("torch.", "")})
    return out


def _rank_run(scenario: Any, kwargs: Mapping[str, Any], iterations: int,
              recorder: _Recorder, device: str = "cpu",
              parallel: str = "ddp") -> Callable[[int], dict[str, Any]]:
    """The function each fake rank runs: train, timing the last iteration's phases and each
    parameter's grad-ready time (DDP's Reducer parameters; none under FSDP2)."""
    last = iterations - 1
    meta_cache: dict = {}  # shared by the ranks (see MetaDataMode)

    def run(rank: int) -> dict[str, Any]:
        import torch.distributed as dist

        with meta_scope(device, meta_cache):
            with torch.device(device):  # on meta: parameters without storage
                module = scenario.build_model()
            model = _wrap(module, parallel, kwargs, device)
            opt = scenario.optimizer(model.parameters())
            named = _reducer_params(model) if parallel == "ddp" else []
            st: dict[str, Any] = {"t_b": 0.0, "ready": [None] * len(named), "order": []}

            def hook_for(i: int) -> Callable[..., None]:
                def hook(grad_inputs: Any, grad_outputs: Any) -> None:
                    if recorder.on[rank] and st["ready"][i] is None:
                        st["ready"][i] = now() - st["t_b"]
                        st["order"].append(i)
                return hook

            nodes = []
            for i, (_, p, _m) in enumerate(named):
                node = p.view_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad, as DDP finds it
                node.register_hook(hook_for(i))  # after the Reducer's: runs after its hook
                nodes.append(node)
            marks: dict[str, float] = {}

            def mark(i: int, phase: str) -> None:
                if phase == "backward":
                    st["t_b"] = now()
                recorder.on[rank] = i == last and phase == "backward"
                if i == last:
                    marks[phase] = now()

            train_steps(scenario, model, opt, rank_batches(scenario, rank, dist.get_world_size(),
                                                  iterations, device), mark)
            del nodes
        out = {"marks": dict(t0=marks["start"], t_b=marks["backward"],
                             t_ab=marks["backward_done"], t_s=marks["backward_done"],
                             t_e=marks["end"]),
               "ready": st["ready"], "order": st["order"],
               "params": [(name, list(p.shape), str(p.dtype).replace("torch.", ""),
                           _expects_sparse_gradient(mod)) for name, p, mod in named],
               "optimizer_state_bytes": state_bytes(opt)}
        if rank == 0:
            if parallel == "ddp":
                out["logging"] = {k: v for k, v in model._get_ddp_logging_data().items()
                                  if isinstance(v, (int, float, str))}
                out["ddp"] = _ddp_config(model)
            else:
                out["fsdp_groups"] = _fsdp_groups(model)
                out["params"] = [(g["name"], g["shape"], g["dtype"], False)
                                 for grp in out["fsdp_groups"] for g in grp["params"]]
        return out

    return run


PARALLEL = ("ddp", "fsdp")


def capture(scenario: Any, nprocs: int = 2, *, timing: Timing | None = None,
            iterations: int | None = None, seed: int = 0,
            ddp_kwargs: Mapping[str, Any] | None = None, device: str = "cpu",
            parallel: str = "ddp",
            fsdp_kwargs: Mapping[str, Any] | None = None) -> CapturedIteration:
    """Run ``scenario`` (a ``models.Scenario``, or any object with its attributes) on
    ``nprocs`` fake ranks under :func:`simddp.simulate` with ``timing`` and record its last
    iteration (of ``iterations`` ≥ 3, default 3, so that DDP has rebuilt its buckets; FSDP2:
    ≥ 2, default 2, its lazy initialisation done). ``ddp_kwargs`` update the scenario's. See
    :mod:`simddp.replay`.

    ``device="meta"``: capture at real size without arithmetic — the model is built on the
    meta device and the batches moved there (``scenario.inputs(rank, world_size,
    device="meta")``), so the real program runs with real shapes, dtypes and collectives and no
    data; the compute model costs each op from its shapes (see :mod:`simddp.cosim.meta` for
    what torch needs to run there). ``parallel="fsdp"``: FSDP2 instead of DDP —
    ``fully_shard(**fsdp_kwargs)`` on each block of the model's ``layers`` and on the root, on
    a 1-D mesh of the ranks; the capture then holds FSDP2's parameter groups
    (``fsdp_groups``) and every collective in issue order (``RankProfile.collectives``), and no
    DDP buckets.
    """
    if device not in DEVICES:
        raise ValueError(f"capture: device must be one of {', '.join(DEVICES)}, got {device!r}")
    if parallel not in PARALLEL:
        raise ValueError(f"capture: parallel must be one of {', '.join(PARALLEL)}, "
                         f"got {parallel!r}")
    if parallel == "ddp":
        iterations = integer("capture: iterations", 3 if iterations is None else iterations,
                             minimum=3, hint="DDP rebuilds its buckets after the first "
                                             "iteration; the second still broadcasts the new "
                                             "layout")
    else:
        iterations = integer("capture: iterations", 2 if iterations is None else iterations,
                             minimum=2, hint="FSDP2 initialises lazily in the first iteration")
    timing = Timing() if timing is None else timing
    if parallel == "ddp":
        if fsdp_kwargs:
            raise ValueError("capture: fsdp_kwargs apply to parallel='fsdp' only")
        kwargs = {**dict(getattr(scenario, "ddp_kwargs", {}) or {}), **dict(ddp_kwargs or {})}
        if device == "meta" and kwargs.get("find_unused_parameters"):
            raise ValueError("capture(device='meta') cannot run find_unused_parameters=True: "
                             "the Reducer reads its used-parameter map back to the CPU, and "
                             "meta tensors hold no data; capture on device='cpu' instead")
    else:
        if ddp_kwargs:
            raise ValueError("capture: ddp_kwargs apply to parallel='ddp' only; give FSDP2's "
                             "as fsdp_kwargs (reshard_after_forward, mp_policy, ...)")
        kwargs = dict(fsdp_kwargs or {})
    recorder = _Recorder(nprocs)
    with fsdp_on_meta() if device == "meta" and parallel == "fsdp" else contextlib.nullcontext():
        res = simulate(_rank_run(scenario, kwargs, iterations, recorder, device, parallel), (),
                       nprocs, timing=timing, seed=seed, observer=recorder)
    last = iterations - 1
    r0 = res.returns[0]
    profiles = [_profile(res, rank, o, recorder.eob[rank]) for rank, o in enumerate(res.returns)]
    bucket_recs, extra, coll_rows = _rank0_collectives(res, r0["marks"])
    logging = r0.get("logging", {})
    ddp = r0.get("ddp") or dict(bucket_cap_bytes=0, first_bucket_bytes=0,
                                find_unused_parameters=False, static_graph=False,
                                gradient_as_bucket_view=False)
    cap = CapturedIteration(
        name=str(getattr(scenario, "name", "scenario")), world_size=nprocs, iteration=last,
        params=[ParamInfo(i, name, shape, dtype, sparse)
                for i, (name, shape, dtype, sparse) in enumerate(r0["params"])],
        ready_order=list(r0["order"]),
        bucket_indices=parse_indices(logging.get("rebuilt_per_bucket_param_indices", "")),
        bucket_bytes=[c.bytes for c in bucket_recs], profiles=profiles,
        backward_collectives=extra,
        network=(timing.network.to_dict()
                 if isinstance(timing.network, Network) else None),
        compute=repr(timing.compute), costs=probe_costs(timing.compute),
        cosim_iteration_time=res.timeline.iteration_times()[last],
        cosim_exposed_comm=res.timeline.exposed_comm()[last], collectives=coll_rows,
        logging_data=logging, device=device, parallel=parallel,
        fsdp_groups=r0.get("fsdp_groups", []),
        optimizer_state_bytes=int(r0["optimizer_state_bytes"]),
        activation_bytes=activation_bytes(scenario, device)[0],
        batch_size=_batch_size(scenario, nprocs), **ddp)
    if parallel == "ddp" and not cap.bucket_indices:
        cap.bucket_indices = cap.buckets()
    return cap


def capture_workload(name: str, nprocs: int = 2, *, parallel: str = "ddp",
                     timing: Timing | None = None, seed: int = 0,
                     fsdp_kwargs: Mapping[str, Any] | None = None,
                     **overrides: Any) -> CapturedIteration:
    """Capture zoo workload ``name`` (e.g. ``"llama3-8b"``; ``overrides`` such as
    ``seq_len=2048`` go to its factory, see ``fakepg.zoo.get``) at real size: on the meta
    device, under ``parallel`` ("ddp" or "fsdp") on ``nprocs`` fake ranks. ``timing``
    defaults to an H100 roofline (``Compute.roofline("h100")``)."""
    from fakepg import zoo

    from ..models import Compute

    scenario = zoo.get(name, **overrides)
    if timing is None:
        timing = Timing(compute=Compute.roofline("h100"))
    return capture(scenario, nprocs, timing=timing, seed=seed, device="meta",
                   parallel=parallel, fsdp_kwargs=fsdp_kwargs)


def _batch_size(scenario: Any, nprocs: int) -> int:
    """Rank 0's samples per iteration: the first dimension of its first batch's first tensor
    (0 when the batch holds no tensor)."""
    try:
        batch = list(scenario.inputs(0, nprocs))[0]
    except Exception:  # noqa: BLE001 - a scenario without inputs() said so earlier
        return 0
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 0


def _profile(res: SimResult, rank: int, o: dict[str, Any],
             eob: tuple[float, float] | None) -> RankProfile:
    """A rank's compute in the recorded iteration, waits excluded, and its forward
    collectives at their compute offsets."""
    m = o["marks"]
    waits = [(s.start, s.end) for s in res.timeline.rank_spans(rank, ("wait",))]

    def waited(lo: float, hi: float) -> float:
        return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in waits)

    def compute_at(t: float) -> float:  # compute seconds since the iteration's start
        return t - m["t0"] - waited(m["t0"], t)

    def placed(rec: Any, until: float) -> tuple[float, float | None]:
        """A collective's compute offset at issue, and where the rank waited for it (a wait,
        or an op reading its tensor: the wait span before ``until`` that ends at the
        collective's end), or None."""
        offset = compute_at(rec.issue)
        for s, e in waits:
            if rec.end is not None and rec.issue <= s < until and e == rec.end:
                return offset, max(offset, compute_at(s))
        return offset, None

    fwd_colls, program = [], []
    for rec in res.trace[rank]:
        if rec.issue is None or rec.issue < m["t0"] or rec.issue >= m["t_e"]:
            continue
        if rec.issue < m["t_b"]:
            offset, wait_at = placed(rec, m["t_b"])
            fwd_colls.append({"offset": max(0.0, offset), "op": rec.op, "bytes": rec.bytes,
                              "wait_at": wait_at})
        offset, wait_at = placed(rec, m["t_e"])
        program.append({"offset": max(0.0, offset), "op": rec.op, "bytes": rec.bytes,
                        "group": rec.group, "group_size": len(rec.group_ranks),
                        "seq": rec.seq, "phase": _phase(rec.issue, m), "wait_at": wait_at})
    eob = eob or (m["t_ab"], m["t_ab"])
    return RankProfile(
        forward=(m["t_b"] - m["t0"]) - waited(m["t0"], m["t_b"]),
        ready=list(o["ready"]),
        backward=eob[0] - m["t_b"],
        post_backward=max(0.0, m["t_ab"] - eob[1]),
        before_step=m["t_s"] - m["t_ab"],
        optimizer=m["t_e"] - m["t_s"],
        forward_collectives=fwd_colls, collectives=program,
        marks={k: compute_at(m[t]) for k, t in (("backward", "t_b"), ("backward_done", "t_ab"),
                                                 ("end", "t_e"))})


def _phase(t: float, m: Mapping[str, float]) -> str:
    """The phase of the iteration that virtual time ``t`` falls in."""
    return "forward" if t < m["t_b"] else "backward" if t < m["t_ab"] else "optimizer"


def _rank0_collectives(res: SimResult, m: Mapping[str, float]) -> tuple[list, list, list]:
    """Rank 0's bucket all_reduces in backward, its other backward collectives
    (``{"op", "bytes"}``), and every collective of the iteration as a table row."""
    bwd = [c for c in res.trace[0]
           if c.issue is not None and m["t_b"] <= c.issue < m["t_ab"]]
    buckets = [c for c in bwd if c.op == "all_reduce" and all(d in _FLOATS for d in c.dtypes)]
    extra = [{"op": c.op, "bytes": c.bytes} for c in bwd if c not in buckets]
    rows = [{"op": c.op, "bytes": c.bytes, "group": c.group, "seq": c.seq,
             "issue": c.issue - m["t0"], "start": (c.start or 0.0) - m["t0"],
             "end": (c.end or 0.0) - m["t0"],
             "phase": "forward" if c.issue < m["t_b"] else "backward"}
            for c in res.trace[0] if c.issue is not None and m["t0"] <= c.issue < m["t_e"]]
    return buckets, extra, rows
