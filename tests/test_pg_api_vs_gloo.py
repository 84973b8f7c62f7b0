"""The ProcessGroup object API under the gloo personality answers as real gloo does.

One real gloo world (ranks as threads, each with its own ``ProcessGroupGloo`` on a shared
``HashStore``) runs every probe; a fakepg world with ``backend="gloo"`` runs the same probes on
its default group. Each probe gives ``("ok", value)`` or ``("error", base type, message gist)``,
the gist being the message up to fakepg's " (rank ..." suffix and torch's C++ trailer.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import fakepg
from test_collectives_vs_gloo import run_gloo  # one way to run a real gloo world

pytestmark = pytest.mark.gloo
N = 3


def _outcome(fn: Callable[[], Any]) -> tuple:
    try:
        value = fn()
    except (RuntimeError, ValueError, NotImplementedError) as e:
        kind = next(k for k in (NotImplementedError, ValueError, RuntimeError) if isinstance(e, k))
        if isinstance(e, fakepg.InvalidCollectiveError):
            kind = RuntimeError if "ProcessGroupGloo" in str(e) else ValueError
        gist = str(e).split("\nException raised from")[0].split(" (rank ")[0]
        return ("error", kind.__name__, gist)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return ("ok", value)


def _probes(rank: int, pg: Any, n: int) -> dict[str, tuple]:
    def allreduce_with_options():
        t = torch.ones(2) * (rank + 1)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        pg.allreduce([t], opts).wait()
        return t

    def broadcast_with_root_keyword():
        t = torch.ones(2) * rank
        pg.broadcast(t, root=1).wait()
        return t

    def broadcast_root_tensor():
        ts = [torch.ones(2) * rank, torch.ones(2) * (rank + 10)]
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 1
        pg.broadcast(ts, opts).wait()
        return [t.tolist() for t in ts]

    def allgather_of_two_inputs():
        ins = [torch.ones(1) * rank, torch.ones(1) * (rank + 10)]
        outs = [[torch.zeros(1) for _ in range(2 * n)] for _ in range(2)]
        pg.allgather(outs, ins).wait()
        return [[t.item() for t in o] for o in outs]

    def all_reduce_coalesced_of_one_tensor_twice():
        t = torch.ones(2)
        pg.allreduce_coalesced([t, t], dist.AllreduceCoalescedOptions()).wait()
        return t

    def reduce_scatter_with_per_rank_output_sizes():
        out = torch.zeros(rank + 1)
        pg.reduce_scatter([out], [[torch.ones(r + 1) * (rank + 1) for r in range(n)]]).wait()
        return out

    def bad_root():
        opts = dist.BroadcastOptions()
        opts.rootRank = 7
        pg.broadcast([torch.ones(1)], opts).wait()

    def non_contiguous_all_to_all_single():
        inp = torch.arange(4.0 * n).reshape(2 * n, 2).t()
        pg.alltoall_base(torch.zeros(2, 2 * n), inp, [], [], dist.AllToAllOptions()).wait()

    probes = {
        "allreduce with options": allreduce_with_options,
        "broadcast(t, root=1)": broadcast_with_root_keyword,
        "broadcast rootTensor": broadcast_root_tensor,
        "allgather of two inputs": allgather_of_two_inputs,
        "all_reduce_coalesced aliased": all_reduce_coalesced_of_one_tensor_twice,
        "reduce_scatter per-rank sizes": reduce_scatter_with_per_rank_output_sizes,
        "allreduce([])": lambda: pg.allreduce([]).wait(),
        "allreduce mixed dtypes": lambda: pg.allreduce([torch.ones(2), torch.ones(2).double()]).wait(),
        "allreduce mixed sizes": lambda: pg.allreduce([torch.ones(2), torch.ones(3)]).wait(),
        "bad root": bad_root,
        "non-contiguous all_to_all_single": non_contiguous_all_to_all_single,
        "name()": lambda: pg.name(),
    }
    return {name: _outcome(fn) for name, fn in probes.items()}


@pytest.fixture(scope="module")
def real_and_fake():
    fake = fakepg.spawn(lambda rank: _probes(rank, c10d._get_default_group(), N), nprocs=N,
                        backend="gloo").returns
    return run_gloo(_probes, N), fake


@pytest.mark.parametrize("probe", [
    "allreduce with options", "broadcast(t, root=1)", "broadcast rootTensor",
    "allgather of two inputs", "all_reduce_coalesced aliased", "reduce_scatter per-rank sizes",
    "allreduce mixed dtypes", "allreduce mixed sizes", "bad root",
    "non-contiguous all_to_all_single", "name()"])
def test_each_pg_api_call_gives_what_real_gloo_gives_on_every_rank(real_and_fake, probe):
    real, fake = real_and_fake
    assert [f[probe] for f in fake] == [r[probe] for r in real]


def test_allreduce_of_no_tensors_is_refused_as_torchs_dispatcher_refuses_it(real_and_fake):
    # A ProcessGroup dispatches before its gloo backend sees the list (checked on a
    # multi-process gloo world); a bare ProcessGroupGloo, as the thread harness holds, says its own.
    real, fake = real_and_fake
    assert real[0]["allreduce([])"] == ("error", "RuntimeError",
                                        "ProcessGroupGloo::allreduce: requires non-empty tensor list")
    assert fake[0]["allreduce([])"] == (
        "error", "NotImplementedError", "There were no tensor arguments to this function (e.g., "
        "you passed an empty list of Tensors), but no fallback function is registered for schema "
        "c10d::allreduce_.")


def test_a_bad_root_is_a_catchable_error_and_the_world_goes_on():
    def body(rank):
        with pytest.raises(RuntimeError, match="ProcessGroupGloo::broadcast: invalid root rank: 7"):
            dist.broadcast(torch.ones(1), src=7)
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    assert fakepg.spawn(body, nprocs=2, backend="gloo").returns == [2.0, 2.0]


def test_the_group_gives_its_gloo_backend_for_cpu():
    def body(rank):
        pg = c10d._get_default_group()
        return type(pg._get_backend(torch.device("cpu"))).__name__, pg.name()

    assert fakepg.spawn(body, nprocs=2, backend="gloo").returns == [("ProcessGroupGloo", "gloo")] * 2
