"""Every private torch name fakepg uses, in one place (fakepg's base room: imports nothing from
fakepg).

A torch upgrade that moves or renames one of these fails in ``tests/test_compat.py``, which
resolves each of :data:`NAMES` on the running torch, with the name. The aliases below are bound
once, at import, for the modules that read them (no call layer per op).

Not yet routed (tests/test_compat.py lists them, as an expected failure): fakepg's use sites
still read most of these names from torch directly; moving each read here is mechanical.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch._C._distributed_c10d as c10d_C  # the C++ c10d bindings (backend option classes)
import torch.distributed.distributed_c10d as _c10d
import torch.utils._python_dispatch as _pd

# the dispatch-mode stack and autograd's engine
len_pre_dispatch_stack = torch._ops._len_torch_dispatch_stack_pre_dispatch
disable_current_modes = _pd._disable_current_modes
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
current_graph_task_id = torch._C._current_graph_task_id
current_autograd_node = torch._C._current_autograd_node
queue_callback = torch.autograd.Variable._execution_engine.queue_callback
AutoDispatchBelowADInplaceOrView = torch._C._AutoDispatchBelowADInplaceOrView
# record_function and the legacy profiler
record_function_with_args_enter = torch.autograd._record_function_with_args_enter
record_function_with_args_exit = torch.autograd._record_function_with_args_exit
profiler_enabled = torch.autograd._profiler_enabled
foreach_copy = torch._foreach_copy_  # one kernel call for many copies (all_reduce's results)
enable_record_function = torch.autograd._enable_record_function
# c10d's Python world
World = _c10d._World
get_default_group = _c10d._get_default_group
rank_not_in_group = _c10d._rank_not_in_group
warn_not_in_group = _c10d._warn_not_in_group
check_valid_timeout = _c10d._check_valid_timeout
new_process_group_helper = _c10d._new_process_group_helper
# absent from some builds: None there
unregister_all_process_groups = getattr(_c10d, "_unregister_all_process_groups", None)
set_thread_isolation_mode = c10d_C._set_thread_isolation_mode

# Every private name fakepg reads, as "module:attribute.path" (module imported on resolution:
# torch.testing._internal is heavy, so only the conformance runner and the test import it).
NAMES: tuple[str, ...] = (
    "torch._ops:_len_torch_dispatch_stack_pre_dispatch",
    "torch.utils._python_dispatch:_disable_current_modes",
    "torch:_C._len_torch_dispatch_stack",
    "torch:_C._current_graph_task_id",
    "torch:_C._current_autograd_node",
    "torch:_C._AutoDispatchBelowADInplaceOrView",
    "torch:_C.fork",
    "torch:_C._profiler._ExperimentalConfig",
    "torch:_tensor_str.PRINT_OPTS",
    "torch:autograd.Variable._execution_engine.queue_callback",
    "torch:autograd._record_function_with_args_enter",
    "torch:autograd._record_function_with_args_exit",
    "torch:autograd._enable_record_function",
    "torch:autograd._profiler_enabled",
    "torch:autograd._enable_profiler_legacy",
    "torch:autograd._disable_profiler_legacy",
    "torch:autograd._add_metadata_json",
    "torch.autograd.profiler:_enable_profiler",
    "torch.autograd.profiler:_prepare_profiler",
    "torch.autograd.profiler:_disable_profiler",
    "torch._C._distributed_c10d:_set_thread_isolation_mode",
    "torch.distributed.distributed_c10d:_World",
    "torch.distributed.distributed_c10d:_world",
    "torch.distributed.distributed_c10d:_get_default_group",
    "torch.distributed.distributed_c10d:_rank_not_in_group",
    "torch.distributed.distributed_c10d:_warn_not_in_group",
    "torch.distributed.distributed_c10d:_check_valid_timeout",
    "torch.distributed.distributed_c10d:_new_process_group_helper",
    "torch.distributed:ProcessGroupGloo._Options",
    "torch.distributed:Backend._plugins",
    "torch.nn.parallel:DistributedDataParallel._match_all_reduce_for_bwd_pass",
    "torch.testing._internal.common_distributed:TEST_SKIPS",
    "torch.testing._internal.common_distributed:MultiProcessTestCase",
    "torch.testing._internal.common_distributed:get_timeout",
    "torch.testing._internal.common_utils:TestCase",
)


def resolve(name: str) -> Any:
    """The object ``name`` ("module:attribute.path", one of :data:`NAMES`) names on this torch."""
    module, _, path = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
