"""Capture: one DDP iteration of a scenario, recorded from co-simulation for replay.

:func:`capture` runs a scenario (a ``models.Scenario``, or any object with its attributes:
``name``, ``ddp_kwargs``, ``build_model()``, ``optimizer(params)``, ``inputs(rank,
world_size)``, ``step(model, batch)``) under :func:`simddp.simulate` on the fake cluster —
torch's real DDP and Reducer — and records its last iteration per rank; see
:mod:`simddp.replay` for what is recorded and how replay uses it. The end-of-backward wait
comes from the co-simulation's :class:`~simddp.cosim.simulate.Observer`; the training loop
is :func:`_train`, the one piece to swap for the zoo's own loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from fakepg.arguments import integer

from ..models import Network
from ..timing import Timing
from ..program.captured import CapturedIteration, ParamInfo, RankProfile, parse_indices
from .simulate import Observer, SimResult, now, simulate

__all__ = ["capture"]

_FLOATS = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")


def _train(scenario: Any, model: Any, opt: Any, batches: list,
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


def _batches(scenario: Any, rank: int, world_size: int, iterations: int) -> list:
    """``iterations`` batches of ``rank``, the scenario's batches repeated as needed."""
    data = list(scenario.inputs(rank, world_size))
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


def _probe_costs(compute: Any) -> dict[str, float] | None:
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


def _rank_run(scenario: Any, kwargs: Mapping[str, Any], iterations: int,
              recorder: _Recorder) -> Callable[[int], dict[str, Any]]:
    """The function each fake rank runs: train, timing the last iteration's phases and each
    parameter's grad-ready time."""
    last = iterations - 1

    def run(rank: int) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(scenario.build_model(), **kwargs)
        opt = scenario.optimizer(model.parameters())
        named = _reducer_params(model)
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

        _train(scenario, model, opt, _batches(scenario, rank, dist.get_world_size(),
                                              iterations), mark)
        del nodes
        out = {"marks": dict(t0=marks["start"], t_b=marks["backward"],
                             t_ab=marks["backward_done"], t_s=marks["backward_done"],
                             t_e=marks["end"]),
               "ready": st["ready"], "order": st["order"],
               "params": [(name, list(p.shape), str(p.dtype).replace("torch.", ""),
                           _expects_sparse_gradient(mod)) for name, p, mod in named]}
        if rank == 0:
            out["logging"] = {k: v for k, v in model._get_ddp_logging_data().items()
                              if isinstance(v, (int, float, str))}
            out["ddp"] = _ddp_config(model)
        return out

    return run


def capture(scenario: Any, nprocs: int = 2, *, timing: Timing | None = None,
            iterations: int = 3, seed: int = 0,
            ddp_kwargs: Mapping[str, Any] | None = None) -> CapturedIteration:
    """Run ``scenario`` (a ``models.Scenario``, or any object with its attributes) on
    ``nprocs`` fake ranks under :func:`simddp.simulate` with ``timing`` and record its last
    iteration (of ``iterations`` ≥ 3, so that DDP has rebuilt its buckets). ``ddp_kwargs``
    update the scenario's. See :mod:`simddp.replay`."""
    iterations = integer("capture: iterations", iterations, minimum=3,
                         hint="DDP rebuilds its buckets after the first iteration; the second "
                              "still broadcasts the new layout")
    timing = Timing() if timing is None else timing
    kwargs = {**dict(getattr(scenario, "ddp_kwargs", {}) or {}), **dict(ddp_kwargs or {})}
    recorder = _Recorder(nprocs)
    res = simulate(_rank_run(scenario, kwargs, iterations, recorder), (), nprocs, timing=timing,
                   seed=seed, observer=recorder)
    last = iterations - 1
    r0 = res.returns[0]
    profiles = [_profile(res, rank, o, recorder.eob[rank]) for rank, o in enumerate(res.returns)]
    bucket_recs, extra, coll_rows = _rank0_collectives(res, r0["marks"])
    logging = r0["logging"]
    cap = CapturedIteration(
        name=str(getattr(scenario, "name", "scenario")), world_size=nprocs, iteration=last,
        params=[ParamInfo(i, name, shape, dtype, sparse)
                for i, (name, shape, dtype, sparse) in enumerate(r0["params"])],
        ready_order=list(r0["order"]),
        bucket_indices=parse_indices(logging.get("rebuilt_per_bucket_param_indices", "")),
        bucket_bytes=[c.bytes for c in bucket_recs], profiles=profiles,
        backward_collectives=extra,
        network=(dataclasses.asdict(timing.network)
                 if isinstance(timing.network, Network) else None),
        compute=repr(timing.compute), costs=_probe_costs(timing.compute),
        cosim_iteration_time=res.timeline.iteration_times()[last],
        cosim_exposed_comm=res.timeline.exposed_comm()[last], collectives=coll_rows,
        logging_data=logging, batch_size=_batch_size(scenario, nprocs), **r0["ddp"])
    if not cap.bucket_indices:
        cap.bucket_indices = cap.buckets()
    return cap


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

    fwd_colls = []
    for rec in res.trace[rank]:
        if rec.issue is None or rec.issue < m["t0"] or rec.issue >= m["t_b"]:
            continue
        offset = rec.issue - m["t0"] - waited(m["t0"], rec.issue)
        # where the rank waited for it (a wait, or an op reading its tensor): the wait span in
        # forward that ends at the collective's end
        wait_at = None
        for s, e in waits:
            if rec.end is not None and rec.issue <= s < m["t_b"] and e == rec.end:
                wait_at = max(offset, s - m["t0"] - waited(m["t0"], s))
                break
        fwd_colls.append({"offset": max(0.0, offset), "op": rec.op, "bytes": rec.bytes,
                          "wait_at": wait_at})
    eob = eob or (m["t_ab"], m["t_ab"])
    return RankProfile(
        forward=(m["t_b"] - m["t0"]) - waited(m["t0"], m["t_b"]),
        ready=list(o["ready"]),
        backward=eob[0] - m["t_b"],
        post_backward=max(0.0, m["t_ab"] - eob[1]),
        before_step=m["t_s"] - m["t_ab"],
        optimizer=m["t_e"] - m["t_s"],
        forward_collectives=fwd_colls)


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
