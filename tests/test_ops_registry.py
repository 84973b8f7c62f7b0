"""The op registry (fakepg.ops): every c10d collective has an entry, and each entry says
consistently what its op is called, costs and counts."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

import fakepg
from fakepg import ops
from fakepg.world.process_group import FakeProcessGroup

# ProcessGroup attributes (torch 2.13) that are not collectives: identity, configuration,
# lifecycle, coalescing brackets, enum values and pybind plumbing.
PG_NOT_COLLECTIVES = {
    "BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL",  # enum values
    "_backend_id", "_device_types", "_get_backend", "_get_backend_name", "_register_backend",
    "_set_default_backend", "bound_device_id", "name",  # which backend serves which device
    "_id", "_set_group_desc", "_set_group_name", "group_desc", "group_name", "rank", "size",
    "get_group_store",  # identity
    "_enable_collectives_timing", "_has_hooks", "_register_on_completion_hook",
    "_get_sequence_number_for_group", "_set_sequence_number_for_group", "set_timeout",  # config
    "_start_coalescing", "_end_coalescing",  # brackets around collectives, not collectives
    "_wait_for_pending_works", "abort", "shutdown",  # lifecycle
    "merge_remote_group", "split_group", "use_pg_for_symm_mem_rendezvous",  # group management
    "boxed", "unbox", "_pybind11_conduit_v1_",  # pybind / TorchScript plumbing
}

# torch.distributed functions (torch 2.13 ``__all__``) that issue no collective.
API_NOT_COLLECTIVES = {
    "destroy_process_group", "init_process_group", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "split_group", "shrink_group",  # group management
    "get_backend", "get_backend_config", "get_default_backend_for_device", "get_global_rank",
    "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks",
    "get_rank", "get_world_size", "is_backend_available", "is_gloo_available",
    "is_initialized", "is_mpi_available", "is_nccl_available", "is_torchelastic_launched",
    "is_ucc_available", "is_xccl_available", "supports_complex",  # queries
    "record_comm",  # a context manager that renames collectives for profiling
    "reduce_op",  # the deprecated alias of the ReduceOp class
}


def _funcol_excluded(name: str) -> bool:
    """Functional-collective functions that are autograd plumbing or waits, not collectives."""
    return (name.endswith(("_backward", "_setup_context")) or name == "wait_tensor"
            or name == "allow_inflight_collective_as_graph_input_ctx")


def _pg_collectives() -> list[str]:
    return sorted(n for n in dir(dist.ProcessGroup)
                  if not n.startswith("__") and n not in PG_NOT_COLLECTIVES)


def _api_collectives() -> list[str]:
    return sorted(n for n in c10d.__all__
                  if n not in API_NOT_COLLECTIVES and inspect.isfunction(getattr(c10d, n, None)))


def _funcol_collectives() -> list[str]:
    return sorted(n for n, v in vars(funcol).items()
                  if inspect.isfunction(v) and v.__module__ == funcol.__name__
                  and not n.startswith("_") and not _funcol_excluded(n))


def test_the_enumerations_find_the_collectives_they_should():
    assert {"allreduce", "_allgather_base", "alltoall_base", "recv_anysource"} <= set(_pg_collectives())
    assert {"all_reduce", "batch_isend_irecv", "all_gather_object"} <= set(_api_collectives())
    assert {"all_gather_tensor", "reduce_scatter_tensor", "permute_tensor"} <= set(_funcol_collectives())


@pytest.mark.parametrize("method", _pg_collectives())
def test_every_process_group_collective_is_a_registered_op_that_fakepg_implements(method):
    op = ops.lookup(method)
    assert op is ops.get(op.name)
    assert method in ops.c10d_methods()
    # (behind the world checkers' `calling` hook: fakepg.fidelity.gloo_checks)
    assert inspect.unwrap(getattr(FakeProcessGroup, method)) is ops.c10d_methods()[method]


@pytest.mark.parametrize("name", _api_collectives())
def test_every_torch_distributed_collective_maps_to_a_registered_op(name):
    assert ops.lookup(name).name in ops.names()


@pytest.mark.parametrize("name", _funcol_collectives())
def test_every_functional_collective_maps_to_a_registered_op(name):
    assert ops.lookup(name).name in ops.names()


@pytest.mark.parametrize("name", ops.names())
def test_each_op_names_itself_its_cost_kind_and_its_flight_recorder_and_nccl_names(name):
    op = ops.get(name)
    assert op.name == name
    assert op.cost_kind in ops.COST_KINDS
    assert ops.cost_kind(name) == op.cost_kind
    assert op.fr_name and op.nccl_optype == op.nccl_optype.upper()
    for alias in op.aliases:
        assert ops.lookup(alias) is op


def test_names_as_torchs_flight_recorder_and_nccl_watchdog_spell_them():
    assert ops.get("all_gather_into_tensor").fr_name == "_all_gather_base"
    assert ops.get("reduce_scatter_tensor").fr_name == "_reduce_scatter_base"
    assert ops.get("all_reduce_coalesced").fr_name == "allreduce_coalesced"
    assert ops.get("all_to_all_single").nccl_optype == "ALLTOALL_BASE"
    assert ops.get("monitored_barrier").fr_name == "barrier"
    assert ops.cost_kind("isend") == ops.cost_kind("irecv") == "p2p"


def test_unknown_names_are_refused_with_the_known_ones_listed():
    with pytest.raises(KeyError, match="fakepg knows: all_gather"):
        ops.get("allreduce")  # a c10d method name, not a trace name
    with pytest.raises(ValueError, match="use a torch.distributed name"):
        ops.cost_kind("all_reduce_everything")


def _bytes_of_each_op(rank: int) -> None:
    n = dist.get_world_size()
    x = torch.ones(4)  # 16 bytes
    dist.all_reduce(x)
    dist.all_gather([torch.empty(4) for _ in range(n)], x)
    dist.all_gather_single(torch.empty(4 * n), x)
    dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(n)])
    dist.reduce_scatter_single(torch.empty(4), torch.ones(4 * n))
    dist.gather(x, [torch.empty(4) for _ in range(n)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(n)] if rank == 0 else None, src=0)
    dist.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n))
    dist.barrier()


def test_bytes_are_counted_as_nccl_tests_counts_them():
    # nccl-tests sizes all_gather / gather / scatter / reduce_scatter by the full buffer
    trace = fakepg.spawn(_bytes_of_each_op, nprocs=4).trace
    assert {r.op: r.bytes for r in trace[1]} == {
        "all_reduce": 16, "all_gather": 64, "all_gather_into_tensor": 64, "reduce_scatter": 64,
        "reduce_scatter_tensor": 64, "gather": 64, "scatter": 64, "all_to_all_single": 64,
        "barrier": 0}


def test_op_names_read_without_torch_and_public_names_load_it_and_register_the_backend():
    """``import fakepg`` and the ops' names and cost kinds (what simddp's network models read
    replaying a saved capture) load no torch; every public name still resolves, and reading one
    once torch is loaded registers the "fakepg" backend, as the eager package did."""
    import subprocess
    import sys

    code = ("import sys, fakepg\n"
            "from fakepg import ops\n"
            "assert ops.cost_kind('isend') == 'p2p' and 'all_gather' in ops.COST_KINDS\n"
            "assert ops.names()[0] == 'all_reduce'\n"
            "assert 'torch' not in sys.modules, 'torch loaded'\n"
            "import torch.distributed as dist\n"
            "assert all(hasattr(fakepg, n) for n in fakepg.__all__)\n"
            "assert 'fakepg' in dist.Backend.backend_list\n"
            "assert fakepg.ops.get('send').fr_name == 'send'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
