"""Every private torch name simddp uses, in one place.

A torch upgrade that moves or renames one of these fails here, at import (the eager names) or
in ``tests/test_compat.py`` (which resolves the lazy ones too), naming it, rather than deep in
a capture. The rest of simddp imports the public names below; ``tests/test_compat.py`` fails
on any private torch name (``torch._C``, ``torch.utils._python_dispatch`` …) used elsewhere.

Hot-path names are bound here once, at import, as plain aliases (no call layer per op).
Names whose module is heavy or not yet importable when simddp is (FakeTensor, FSDP2's
internals, pipelining, functional collectives, DDP's bucketing) are functions that import on
first call.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.utils._python_dispatch as _pd

__all__ = [
    # the dispatch-mode stack
    "TorchDispatchMode", "is_traceable_wrapper_subclass", "is_traceable_wrapper_subclass_type",
    "pop_mode", "push_mode", "len_torch_dispatch_stack", "pop_torch_dispatch_stack",
    "push_on_torch_dispatch_stack", "is_torch_function_mode_enabled", "DispatchKey", "DispatchKeySet",
    # autograd's engine
    "current_graph_task_id", "queue_callback", "AccumulateGrad", "SavedTensor",
    # ops
    "OpOverload", "functional_wait_tensor",
    # lazy: import on first call
    "fake_tensor_class", "checkpoint_wrapper", "functional_collectives", "generate_stage_to_rank_mapping",
    "schedule_with_comms", "compute_bucket_assignment_by_size", "default_first_bucket_bytes",
    "fsdp_meta_device_patches", "tree_flatten", "context_parallel_module", "head_tail_load_balancer",
    "dtensor_op_dispatcher", "LAZY",
]

TorchDispatchMode = _pd.TorchDispatchMode
is_traceable_wrapper_subclass = _pd.is_traceable_wrapper_subclass
is_traceable_wrapper_subclass_type = _pd.is_traceable_wrapper_subclass_type
tree_flatten = importlib.import_module("torch.utils._pytree").tree_flatten
pop_mode = _pd._pop_mode
push_mode = _pd._push_mode
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
pop_torch_dispatch_stack = torch._C._pop_torch_dispatch_stack
push_on_torch_dispatch_stack = torch._C._push_on_torch_dispatch_stack
is_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
DispatchKey = torch._C.DispatchKey
DispatchKeySet = torch._C.DispatchKeySet

current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward
queue_callback = torch.autograd.Variable._execution_engine.queue_callback  # runs at the backward's end
AccumulateGrad = torch._C._functions.AccumulateGrad
SavedTensor = torch._C._autograd.SavedTensor

OpOverload = torch._ops.OpOverload
functional_wait_tensor = torch.ops._c10d_functional.wait_tensor.default


def fake_tensor_class() -> type:
    """``torch._subclasses.fake_tensor.FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor


def checkpoint_wrapper(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torch's ``checkpoint_wrapper`` (activation checkpointing of one module)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap
    return wrap(module, **kwargs)


def functional_collectives() -> Any:
    """The ``torch.distributed._functional_collectives`` module (funcol)."""
    return importlib.import_module("torch.distributed._functional_collectives")


def generate_stage_to_rank_mapping(pp: int, stages: int, style: str = "loop") -> dict[int, int]:
    """Stage → rank as torch's pipeline schedules place stages (``"loop"`` or ``"v"``)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping as mapping
    return mapping(pp, stages, style=style)


def schedule_with_comms(stages: list, microbatches: int, pipeline_order: dict) -> dict:
    """A multi-stage schedule's per-rank actions with its sends and receives, as
    ``_PipelineScheduleRuntime`` lowers and runs them."""
    import torch.distributed.pipelining.schedules as S
    runtime = S._PipelineScheduleRuntime(stages, microbatches)
    runtime._prepare_schedule_with_comms(pipeline_order)
    return runtime.pipeline_order_with_comms


def compute_bucket_assignment_by_size(*args: Any) -> Any:
    """DDP's bucketing (``torch.distributed._compute_bucket_assignment_by_size``)."""
    import torch.distributed as dist
    return dist._compute_bucket_assignment_by_size(*args)


def default_first_bucket_bytes() -> int:
    """DDP's first-bucket cap (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
    import torch.distributed as dist
    return int(dist._DEFAULT_FIRST_BUCKET_BYTES)


_FSDP = "torch.distributed.fsdp._fully_shard."


def fsdp_meta_device_patches(meta_device: Callable[[Any], torch.device],
                             device_handle: Callable[..., Any]) -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for FSDP2's internals so that it runs on meta
    parameters: its device from the mesh, its device handle (streams, events), and its check
    that parameters are materialised (replaced by a no-op)."""
    fully_shard = importlib.import_module(_FSDP + "_fully_shard")
    param_group = importlib.import_module(_FSDP + "_fsdp_param_group")
    patches: list[tuple[Any, str, Any]] = [(fully_shard, "_get_device_from_mesh", meta_device)]
    for name in ("_fsdp_param_group", "_fsdp_collectives", "_fsdp_state"):
        mod = importlib.import_module(_FSDP + name)
        if hasattr(mod, "_get_device_handle"):
            patches.append((mod, "_get_device_handle", device_handle))
    patches.append((param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None))
    return [(obj, name, value) for obj, name, value in patches if hasattr(obj, name)]


def context_parallel_module() -> Any:
    """torch's context-parallel module (``_context_parallel._attention`` since torch 2.9;
    ``tensor.experimental._attention`` before)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # pragma: no cover - older layout
        from torch.distributed.tensor.experimental import _attention  # type: ignore[no-redef]
    return _attention


def head_tail_load_balancer(seq_len: int, cp: int, device: Any) -> Any:
    """torch's round-robin (head-tail) load balancer for causal context-parallel attention."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import \
            _HeadTailLoadBalancer
    except ImportError:  # pragma: no cover - older layout
        from torch.distributed.tensor.experimental._load_balancer import (  # type: ignore
            _HeadTailLoadBalancer)
    return _HeadTailLoadBalancer(seq_len, cp, device)


def dtensor_op_dispatcher() -> Any:
    """DTensor's op dispatcher (``DTensor._op_dispatcher``)."""
    from torch.distributed.tensor import DTensor
    return DTensor._op_dispatcher


def _resolve_lazy() -> dict[str, Any]:
    """Every lazily imported private name, resolved on the running torch (tests/test_compat.py)."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as cw
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping as mapping
    found = {"FakeTensor": fake_tensor_class(), "checkpoint_wrapper": cw,
             "generate_stage_to_rank_mapping": mapping,
             "functional_collectives.wait_tensor": functional_collectives().wait_tensor,
             "_PipelineScheduleRuntime._prepare_schedule_with_comms":
                 S._PipelineScheduleRuntime._prepare_schedule_with_comms,
             "_compute_bucket_assignment_by_size": dist._compute_bucket_assignment_by_size,
             "_DEFAULT_FIRST_BUCKET_BYTES": default_first_bucket_bytes(),
             "context_parallel._attention": context_parallel_module(),
             "_HeadTailLoadBalancer": head_tail_load_balancer(8, 2, "cpu"),
             "DTensor._op_dispatcher": dtensor_op_dispatcher()}
    for obj, name, _ in fsdp_meta_device_patches(lambda mesh: torch.device("meta"), lambda *a: None):
        found[f"{getattr(obj, '__name__', obj)}.{name}"] = getattr(obj, name)
    return found


LAZY: Callable[[], dict[str, Any]] = _resolve_lazy
