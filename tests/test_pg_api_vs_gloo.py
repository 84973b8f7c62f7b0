"""The ProcessGroup object API under the gloo personality answers as real gloo does.

One real gloo world (ranks as threads, each with its own ``ProcessGroupGloo`` on a shared
``HashStore``) runs every probe; a fakepg world with ``backend="gloo"`` runs the same probes on
its default group. Each probe gives ``("ok", value)`` or ``("error", base type, message gist)``,
the gist being the message up to fakepg's " (rank ..." suffix and torch's C++ trailer.
"""

from __future__ import annotations

import datetime
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


# -- a bare ProcessGroupGloo: gloo's own argument checks (torch's test_c10d_gloo.py's *_checks) --

def _gloo_check_probes(rank: int, pg: Any, n: int) -> dict[str, Callable[[], Any]]:
    """Malformed calls, as torch's test_c10d_gloo.py makes them, each refused by gloo."""
    t1, t2, t3 = torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)
    sp2 = torch.sparse_coo_tensor([[0]], [1], size=(2,))
    sp4 = torch.sparse_coo_tensor([[0]], [1], size=(4,))
    sp1 = torch.sparse_coo_tensor([[0]], [1], size=(1,))

    def opts(kind: Any, root: int, tensor: int | None = None, op: Any = None) -> Any:
        o = kind()
        if root is not None:
            o.rootRank = root
        if tensor is not None:
            o.rootTensor = tensor
        if op is not None:
            o.reduceOp = op
        return o

    B, R = dist.BroadcastOptions, dist.ReduceOptions
    S, G = dist.ScatterOptions, dist.GatherOptions
    other = (rank + 1) % n
    outs = lambda: [[torch.zeros(1)] for _ in range(n)]  # noqa: E731
    return {
        "broadcast root -1": lambda: pg.broadcast([t1], opts(B, -1, 0)),
        "broadcast root n": lambda: pg.broadcast([t1], opts(B, n, 0)),
        "broadcast root tensor -1": lambda: pg.broadcast([t1], opts(B, rank, -1)),
        "broadcast root tensor 1": lambda: pg.broadcast([t1], opts(B, rank, 1)),
        "broadcast []": lambda: pg.broadcast([], opts(B, rank, 0)),
        "broadcast types": lambda: pg.broadcast([t1, t2], opts(B, rank, 0)),
        "broadcast sizes": lambda: pg.broadcast([t1, t3], opts(B, rank, 0)),
        "allreduce []": lambda: pg.allreduce([], dist.AllreduceOptions()),
        "allreduce types": lambda: pg.allreduce([t1, t1, t2]),
        "allreduce sizes": lambda: pg.allreduce([t1, t3]),
        "allreduce_coalesced []": lambda: pg.allreduce_coalesced([], dist.AllreduceCoalescedOptions()),
        "allreduce_coalesced types": lambda: pg.allreduce_coalesced([t1, t2], dist.AllreduceCoalescedOptions()),
        "allreduce_coalesced layouts": lambda: pg.allreduce_coalesced([t1, sp1], dist.AllreduceCoalescedOptions()),
        "allreduce_coalesced sparse": lambda: pg.allreduce_coalesced([sp1, sp1.clone()], dist.AllreduceCoalescedOptions()),
        "sparse allreduce layouts": lambda: pg.allreduce([t1, sp2]),
        "sparse allreduce sizes": lambda: pg.allreduce([sp2, sp4]),
        "sparse allreduce MAX": lambda: pg.allreduce([sp4], opts(dist.AllreduceOptions, None, op=dist.ReduceOp.MAX)),
        "scatter root -1": lambda: pg.scatter([t1], [], opts(S, -1)),
        "scatter root n": lambda: pg.scatter([t1], [], opts(S, n)),
        "scatter no output": lambda: pg.scatter([], [], opts(S, 0)),
        "scatter two outputs": lambda: pg.scatter([t1, t1], [], opts(S, 0)),
        "scatter root without input": lambda: pg.scatter([t1], [], opts(S, rank)),
        "scatter root with two inputs": lambda: pg.scatter([t1], [[t1] * n, [t1] * n], opts(S, rank)),
        "scatter short input": lambda: pg.scatter([t1], [[t1] * (n - 1)], opts(S, rank)),
        "scatter long input": lambda: pg.scatter([t1], [[t1] * (n + 1)], opts(S, rank)),
        "scatter types": lambda: pg.scatter([t1], [[t2] * n], opts(S, rank)),
        "scatter sizes": lambda: pg.scatter([t1], [[t3] * n], opts(S, rank)),
        "scatter input on non-root": lambda: pg.scatter([t1], [[t1] * n], opts(S, other)),
        "gather root -1": lambda: pg.gather([], [t1], opts(G, -1)),
        "gather root n": lambda: pg.gather([], [t1], opts(G, n)),
        "gather no input": lambda: pg.gather([], [], opts(G, 0)),
        "gather two inputs": lambda: pg.gather([], [t1, t1], opts(G, 0)),
        "gather root without output": lambda: pg.gather([], [t1], opts(G, rank)),
        "gather root with two outputs": lambda: pg.gather([[t1] * n, [t1] * n], [t1], opts(G, rank)),
        "gather short output": lambda: pg.gather([[t1] * (n - 1)], [t1], opts(G, rank)),
        "gather long output": lambda: pg.gather([[t1] * (n + 1)], [t1], opts(G, rank)),
        "gather types": lambda: pg.gather([[t2] * n], [t1], opts(G, rank)),
        "gather sizes": lambda: pg.gather([[t3] * n], [t1], opts(G, rank)),
        "gather output on non-root": lambda: pg.gather([[t1] * n], [t1], opts(G, other)),
        "allgather []": lambda: pg.allgather([], []),
        "allgather no output": lambda: pg.allgather([], [t1]),
        "allgather two outputs": lambda: pg.allgather([[t1] * n, [t1] * n], [t1]),
        "allgather short output": lambda: pg.allgather([[t1] * (n - 1)], [t1]),
        "allgather long output": lambda: pg.allgather([[t1] * (n + 1)], [t1]),
        "allgather input types": lambda: pg.allgather([[t1, t1] * n, [t1, t1] * n], [t1, t2]),
        "allgather input sizes": lambda: pg.allgather([[t1, t1] * n, [t1, t1] * n], [t1, t3]),
        "allgather output types": lambda: pg.allgather([([t1, t2] * n)[:n]], [t1]),
        "allgather output sizes": lambda: pg.allgather([([t1, t3] * n)[:n]], [t1]),
        "allgather_coalesced output size": lambda: pg.allgather_coalesced([[torch.zeros(0)]] + outs()[1:], [t1]),
        "allgather_coalesced output type": lambda: pg.allgather_coalesced([[t2]] + outs()[1:], [t1]),
        "allgather_coalesced too many lists": lambda: pg.allgather_coalesced(outs() + [[t1]], [t1]),
        "all_gather_coalesced (torch.distributed)": lambda: dist.all_gather_coalesced([[torch.zeros(0)]] + outs()[1:], [t1], pg),
        "reduce root -1": lambda: pg.reduce([t1], opts(R, -1, 0)),
        "reduce root n": lambda: pg.reduce([t1], opts(R, n, 0)),
        "reduce root tensor 1": lambda: pg.reduce([t1], opts(R, rank, 1)),
        "reduce two tensors": lambda: pg.reduce([t1, t1], opts(R, rank, 0)),
    }


def _check_outcomes(rank: int, pg: Any, n: int) -> dict[str, tuple]:
    out = {name: _outcome(fn) for name, fn in _gloo_check_probes(rank, pg, n).items()}
    out["options._timeout"] = _outcome(lambda: str(pg.options._timeout))
    pg._set_default_timeout(datetime.timedelta(seconds=23))
    out["options._timeout after _set_default_timeout"] = _outcome(lambda: str(pg.options._timeout))
    return out


def _sparse_allreduce(rank: int, pg: Any, n: int) -> list[Any]:
    from torch.testing._internal.common_distributed import simple_sparse_reduce_tests

    out = []
    for per_rank in (1, 2):
        for inputs, _ in simple_sparse_reduce_tests(rank, n, num_inputs=per_rank):
            fut = pg.allreduce(inputs).get_future()
            fut.wait()
            out.append([(t._nnz(), t.is_coalesced(), t._indices().tolist(), t._values().tolist())
                        for t in (*fut.value(), *inputs)])
    return out


@pytest.fixture(scope="module")
def bare_gloo_real_and_fake():
    """The same probes on bare ProcessGroupGloo objects: real ones on threads, and in a fake
    world the ones ``dist.ProcessGroupGloo(store, rank, size, timeout)`` builds there."""
    def both(rank: int, pg: Any, n: int) -> tuple:
        return _check_outcomes(rank, pg, n), _sparse_allreduce(rank, pg, n)

    def fake(rank: int) -> tuple:
        store = dist.FileStore("fakepg-bare-gloo-probes", N)  # the fake world's, not a file
        return both(rank, dist.ProcessGroupGloo(store, rank, N, datetime.timedelta(seconds=20)), N)

    return run_gloo(both, N), fakepg.spawn(fake, nprocs=N).returns


def test_a_bare_gloo_group_refuses_each_malformed_call_as_real_gloo_does(bare_gloo_real_and_fake):
    (real, fake) = bare_gloo_real_and_fake
    for r in range(N):
        checks_real, checks_fake = real[r][0], fake[r][0]
        differ = {k: (checks_real[k], checks_fake[k]) for k in checks_real
                  if checks_real[k] != checks_fake[k]}
        assert not differ, f"rank {r}: (gloo, fakepg) differ on {differ}"
    assert real[0][0]["allreduce []"] == ("error", "RuntimeError",
                                         "ProcessGroupGloo::allreduce: requires non-empty tensor list")
    assert len(real[0][0]) == 58  # 56 malformed calls, the options before and after


def test_sparse_allreduce_gives_gloos_indices_values_and_nnz(bare_gloo_real_and_fake):
    (real, fake) = bare_gloo_real_and_fake
    assert [f[1] for f in fake] == [r[1] for r in real]


def test_a_process_groups_dispatcher_refuses_calls_without_tensors_before_gloo_does():
    # (checked on real gloo behind a dist.ProcessGroup: the schema names the method's op)
    calls = {"broadcast_": lambda pg: pg.broadcast([], dist.BroadcastOptions()),
             "allgather_": lambda pg: pg.allgather([], []),
             "allreduce_coalesced_": lambda pg: pg.allreduce_coalesced([], dist.AllreduceCoalescedOptions())}

    def body(rank):
        pg = c10d._get_default_group()
        return {schema: _outcome(lambda: call(pg)) for schema, call in calls.items()}

    got = fakepg.spawn(body, nprocs=2, backend="gloo").returns[0]
    for schema in calls:
        assert got[schema] == ("error", "NotImplementedError", (
            "There were no tensor arguments to this function (e.g., you passed an empty list of "
            f"Tensors), but no fallback function is registered for schema c10d::{schema}."))


def test_a_bare_gloo_group_in_a_rank_process_refuses_as_real_gloo_does(bare_gloo_real_and_fake):
    # (sparse COO tensors travel too: their probes answer as gloo's, as the dense ones do)
    real = bare_gloo_real_and_fake[0]

    def fake(rank: int) -> dict[str, tuple]:
        store = dist.FileStore("fakepg-bare-gloo-probes", N)
        return _check_outcomes(rank, dist.ProcessGroupGloo(store, rank, N, datetime.timedelta(seconds=20)), N)

    got = fakepg.spawn(fake, nprocs=N, isolation="process").returns
    for r in range(N):
        assert len(real[r][0]) > 53  # the dense probes and the sparse/layout ones
        assert got[r] == real[r][0]
