"""Conformance of every fakepg collective with its reference semantics.

Each property spawns a fake world of 1..8 ranks. A rank builds its inputs from
(example seed, rank) alone, so the test can rebuild every rank's inputs afterwards and
compute the reference itself: reductions fold in rank order 0..n-1 (fakepg's promise),
which makes bitwise equality the right check, also for floating point.
"""

from __future__ import annotations

import functools
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fakepg

pytestmark = [  # torch's own deprecation notices for APIs this suite must still cover
    pytest.mark.filterwarnings("ignore:`torch.distributed.all_.*_coalesced` will be deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.distributed.(all_gather_into|reduce_scatter)_tensor` is deprecated:FutureWarning"),
]

R = dist.ReduceOp
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
DTYPES = FLOATS + INTS
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
INT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]

worlds = st.integers(1, 8)
seeds = st.integers(0, 2**20)
dtypes = st.sampled_from(DTYPES)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@st.composite
def dtype_and_op(draw, dtypes=dtypes):
    dtype = draw(dtypes)
    ops = INT_OPS if dtype in INTS else FLOAT_OPS
    name = draw(st.sampled_from(ops))
    factor = draw(st.sampled_from([0.5, 0.25, 2.0, 1.0 / 3.0])) if name == "PREMUL_SUM" else None
    return dtype, name, factor


def make_op(name: str, factor: float | None = None):
    """The ReduceOp to pass to torch (built inside the rank: PREMUL_SUM ops are objects)."""
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(R, name)


def data(seed: int, rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: a pure function of its arguments (no global RNG)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919 + salt * 104_729) % 2**62)
    if dtype.is_floating_point:
        # values in [0.5, 2) with a random sign keep products of 8 ranks finite in float16
        mag = torch.rand(shape, generator=g, dtype=torch.float64) * 1.5 + 0.5
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return (mag * sign).to(dtype)
    return torch.randint(-9, 10, shape, generator=g, dtype=dtype)


def reference(xs: list[torch.Tensor], name: str, factor: float | None = None) -> torch.Tensor:
    """``xs`` (one per rank, rank order) folded left to right, as fakepg promises."""
    if name == "PREMUL_SUM":
        return functools.reduce(lambda a, b: a + b * factor, xs[1:], xs[0] * factor)
    fold = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
            "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
            "BXOR": torch.bitwise_xor}[name]
    acc = functools.reduce(fold, xs[1:], xs[0].clone())
    if name == "AVG":
        n = len(xs)
        if acc.dtype.is_floating_point:
            return acc / n
        # integer AVG truncates toward zero, as NCCL's ncclAvg (sum, then C division)
        return (acc.abs() // n) * acc.sign()
    return acc


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}:\n got      {actual}\n expected {expected}"


def run(fn, n: int, *args):
    return fakepg.spawn(fn, args=args, nprocs=n)


def _line() -> int:
    """The caller's line number (to find it again in error messages)."""
    return sys._getframe(1).f_lineno


# ---------------------------------------------------------------------------------
# all_reduce and friends
# ---------------------------------------------------------------------------------

EVERY_DTYPE_AND_OP = [(d, o) for d in DTYPES for o in (INT_OPS if d in INTS else FLOAT_OPS)]


@pytest.mark.parametrize("dtype, name", EVERY_DTYPE_AND_OP, ids=lambda x: str(x).replace("torch.", ""))
@settings(max_examples=8, deadline=None)
@given(n=worlds, seed=seeds, shape=shapes, factor=st.sampled_from([0.5, 0.25, 2.0, 1.0 / 3.0]))
def test_all_reduce_matches_rank_order_reference(dtype, name, n, seed, shape, factor):
    factor = factor if name == "PREMUL_SUM" else None

    def body(rank):
        t = data(seed, rank, shape, dtype)
        assert dist.all_reduce(t, op=make_op(name, factor)) is None
        return t

    res = run(body, n)
    expected = reference([data(seed, r, shape, dtype) for r in range(n)], name, factor)
    for r in range(n):
        assert_same(res.returns[r], expected, f"rank {r} all_reduce {name}")
    for r in range(n):
        (rec,) = res.trace[r]
        assert (rec.op, rec.seq, rec.reduce_op, rec.shapes) == ("all_reduce", 0, name, (shape,))
        assert rec.dtypes == (str(dtype).replace("torch.", ""),)


@SETTINGS
@given(n=worlds, seed=seeds, shape=nonempty_shapes, dop=dtype_and_op())
def test_async_all_reduce_work_wait_gives_reference_and_future_yields_the_tensor(n, seed, shape, dop):
    dtype, name, factor = dop

    def body(rank):
        t = data(seed, rank, shape, dtype)
        work = dist.all_reduce(t, op=make_op(name, factor), async_op=True)
        assert work.wait() is True
        value = work.get_future().wait()
        return t, work.is_completed(), work.is_success(), value, work.result()

    res = run(body, n)
    expected = reference([data(seed, r, shape, dtype) for r in range(n)], name, factor)
    for r, (t, completed, success, value, result) in enumerate(res.returns):
        assert_same(t, expected, f"rank {r}")
        assert completed and success
        assert isinstance(value, list) and len(value) == 1, value
        assert value[0].data_ptr() == t.data_ptr(), "the future yields the reduced tensor itself"
        assert len(result) == 1 and result[0].data_ptr() == t.data_ptr()
        assert res.trace[r][0].async_op


@SETTINGS
@given(n=worlds, seed=seeds, tensor_shapes=st.lists(nonempty_shapes, min_size=1, max_size=4),
       dop=dtype_and_op(st.sampled_from([torch.float32, torch.float64, torch.int64])),
       async_op=st.booleans())
def test_all_reduce_coalesced_reduces_each_tensor_in_rank_order(n, seed, tensor_shapes, dop, async_op):
    dtype, name, factor = dop

    def body(rank):
        ts = [data(seed, rank, s, dtype, salt=i) for i, s in enumerate(tensor_shapes)]
        out = dist.all_reduce_coalesced(ts, op=make_op(name, factor), async_op=async_op)
        if async_op:  # torch returns the future here, not the Work
            value = out.wait()
            assert [v.data_ptr() for v in value] == [t.data_ptr() for t in ts]
        return ts

    res = run(body, n)
    for i, s in enumerate(tensor_shapes):
        expected = reference([data(seed, r, s, dtype, salt=i) for r in range(n)], name, factor)
        for r in range(n):
            assert_same(res.returns[r][i], expected, f"rank {r} tensor {i}")
    assert [rec.op for rec in res.trace[0]] == ["all_reduce_coalesced"]


# ---------------------------------------------------------------------------------
# rooted collectives
# ---------------------------------------------------------------------------------

@SETTINGS
@given(n=worlds, seed=seeds, shape=shapes, dtype=dtypes, src_pick=st.integers(0, 7))
def test_broadcast_copies_src_tensor_to_every_rank(n, seed, shape, dtype, src_pick):
    src = src_pick % n

    def body(rank):
        t = data(seed, rank, shape, dtype)
        dist.broadcast(t, src=src)
        return t

    res = run(body, n)
    expected = data(seed, src, shape, dtype)
    for r in range(n):
        assert_same(res.returns[r], expected, f"rank {r} after broadcast from {src}")
        assert res.trace[r][0].root == src


@SETTINGS
@given(n=worlds, seed=seeds, shape=shapes, dop=dtype_and_op(), dst_pick=st.integers(0, 7))
def test_reduce_writes_rank_order_reduction_on_dst_and_leaves_others_alone(n, seed, shape, dop, dst_pick):
    dtype, name, factor = dop
    dst = dst_pick % n

    def body(rank):
        t = data(seed, rank, shape, dtype)
        dist.reduce(t, dst=dst, op=make_op(name, factor))
        return t

    res = run(body, n)
    xs = [data(seed, r, shape, dtype) for r in range(n)]
    assert_same(res.returns[dst], reference(xs, name, factor), f"dst {dst}")
    for r in range(n):
        if r != dst:
            # torch leaves it undefined and gloo uses it as scratch; fakepg, like NCCL,
            # does not touch it
            assert_same(res.returns[r], xs[r], f"non-dst rank {r}")


@SETTINGS
@given(n=worlds, seed=seeds, shape=shapes, dtype=dtypes, dst_pick=st.integers(0, 7))
def test_gather_collects_every_ranks_tensor_on_dst_only(n, seed, shape, dtype, dst_pick):
    dst = dst_pick % n

    def body(rank):
        t = data(seed, rank, shape, dtype)
        out = [torch.full(shape, 7, dtype=dtype) for _ in range(n)] if rank == dst else None
        dist.gather(t, out, dst=dst)
        return out

    res = run(body, n)
    for r in range(n):
        if r == dst:
            assert len(res.returns[r]) == n
            for j in range(n):
                assert_same(res.returns[r][j], data(seed, j, shape, dtype), f"dst slot {j}")
        else:
            assert res.returns[r] is None


@SETTINGS
@given(n=worlds, seed=seeds, shape=shapes, dtype=dtypes, src_pick=st.integers(0, 7))
def test_scatter_delivers_entry_r_of_src_list_to_rank_r(n, seed, shape, dtype, src_pick):
    src = src_pick % n

    def body(rank):
        out = torch.zeros(shape, dtype=dtype)
        chunks = [data(seed, src, shape, dtype, salt=j) for j in range(n)] if rank == src else None
        dist.scatter(out, chunks, src=src)
        return out

    res = run(body, n)
    for r in range(n):
        assert_same(res.returns[r], data(seed, src, shape, dtype, salt=r), f"rank {r}")


# ---------------------------------------------------------------------------------
# gathers, reduce-scatters, all-to-alls
# ---------------------------------------------------------------------------------

@SETTINGS
@given(n=worlds, seed=seeds, shape=shapes, dtype=dtypes, async_op=st.booleans())
def test_all_gather_collects_every_ranks_tensor_in_rank_order(n, seed, shape, dtype, async_op):
    def body(rank):
        out = [torch.zeros(shape, dtype=dtype) for _ in range(n)]
        work = dist.all_gather(out, data(seed, rank, shape, dtype), async_op=async_op)
        value = None
        if async_op:
            value = work.get_future().wait()  # as gloo: the flat list of gathered tensors
            assert [v.data_ptr() for v in value] == [o.data_ptr() for o in out]
        return out

    res = run(body, n)
    for r in range(n):
        for j in range(n):
            assert_same(res.returns[r][j], data(seed, j, shape, dtype), f"rank {r} slot {j}")


@SETTINGS
@given(n=worlds, seed=seeds, tensor_shapes=st.lists(nonempty_shapes, min_size=1, max_size=3),
       dtype=dtypes)
def test_all_gather_coalesced_fills_output_lists_indexed_by_rank_then_tensor(n, seed, tensor_shapes, dtype):
    def body(rank):
        ins = [data(seed, rank, s, dtype, salt=i) for i, s in enumerate(tensor_shapes)]
        outs = [[torch.zeros(s, dtype=dtype) for s in tensor_shapes] for _ in range(n)]
        fut = dist.all_gather_coalesced(outs, ins, async_op=True)  # torch returns the future
        value = fut.wait()
        return outs, value

    res = run(body, n)
    for r, (outs, value) in enumerate(res.returns):
        for j in range(n):
            for i, s in enumerate(tensor_shapes):
                assert_same(outs[j][i], data(seed, j, s, dtype, salt=i), f"rank {r} out[{j}][{i}]")
        # gloo's future: the list of per-rank lists (just the one list for a world of 1)
        flat = value if n == 1 else [t for per_rank in value for t in per_rank]
        assert [t.data_ptr() for t in flat] == [t.data_ptr() for per_rank in outs for t in per_rank]


@SETTINGS
@given(n=worlds, seed=seeds, shape=nonempty_shapes, dtype=dtypes,
       layout=st.sampled_from(["concat", "stack", "flat"]))
def test_all_gather_into_tensor_concatenates_in_rank_order(n, seed, shape, dtype, layout):
    out_shape = {"concat": (n * shape[0],) + shape[1:], "stack": (n,) + shape,
                 "flat": (n * torch.Size(shape).numel(),)}[layout]

    def body(rank):
        out = torch.zeros(out_shape, dtype=dtype)
        dist.all_gather_into_tensor(out, data(seed, rank, shape, dtype))
        return out

    res = run(body, n)
    expected = torch.cat([data(seed, j, shape, dtype).reshape(-1) for j in range(n)]).reshape(out_shape)
    for r in range(n):
        assert_same(res.returns[r], expected, f"rank {r}")


@SETTINGS
@given(n=worlds, seed=seeds, shape=shapes, dop=dtype_and_op())
def test_reduce_scatter_gives_rank_r_the_reduction_of_everyones_entry_r(n, seed, shape, dop):
    dtype, name, factor = dop

    def body(rank):
        out = torch.zeros(shape, dtype=dtype)
        ins = [data(seed, rank, shape, dtype, salt=j) for j in range(n)]
        dist.reduce_scatter(out, ins, op=make_op(name, factor))
        return out

    res = run(body, n)
    for r in range(n):
        expected = reference([data(seed, i, shape, dtype, salt=r) for i in range(n)], name, factor)
        assert_same(res.returns[r], expected, f"rank {r}")


@SETTINGS
@given(n=worlds, seed=seeds, shape=nonempty_shapes, dop=dtype_and_op())
def test_reduce_scatter_tensor_gives_rank_r_chunk_r_of_the_reduction(n, seed, shape, dop):
    dtype, name, factor = dop
    in_shape = (n * shape[0],) + shape[1:]

    def body(rank):
        out = torch.zeros(shape, dtype=dtype)
        dist.reduce_scatter_tensor(out, data(seed, rank, in_shape, dtype), op=make_op(name, factor))
        return out

    res = run(body, n)
    full = reference([data(seed, i, in_shape, dtype) for i in range(n)], name, factor)
    for r in range(n):
        assert_same(res.returns[r], full.chunk(n)[r], f"rank {r}")


@SETTINGS
@given(n=worlds, seed=seeds, dtype=dtypes, data_=st.data())
def test_all_to_all_delivers_input_j_of_rank_i_to_output_i_of_rank_j(n, seed, dtype, data_):
    # per pair (i -> j) its own length: list all_to_all lets shapes differ by pair
    lens = data_.draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=n, max_size=n))

    def body(rank):
        ins = [data(seed, rank, (lens[rank][j], 2), dtype, salt=j) for j in range(n)]
        outs = [torch.zeros(lens[i][rank], 2, dtype=dtype) for i in range(n)]
        dist.all_to_all(outs, ins)
        return outs

    res = run(body, n)
    for j in range(n):
        for i in range(n):
            assert_same(res.returns[j][i], data(seed, i, (lens[i][j], 2), dtype, salt=j), f"{i} -> {j}")


@SETTINGS
@given(n=worlds, seed=seeds, dtype=dtypes, equal=st.booleans(), data_=st.data())
def test_all_to_all_single_sends_split_j_of_rank_i_to_rank_j(n, seed, dtype, equal, data_):
    if equal:
        k = data_.draw(st.integers(1, 3))
        splits = [[k] * n for _ in range(n)]
    else:
        splits = data_.draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=n, max_size=n))
    rows_in = [sum(splits[i]) for i in range(n)]
    rows_out = [sum(splits[i][j] for i in range(n)) for j in range(n)]

    def body(rank):
        inp = data(seed, rank, (rows_in[rank], 3), dtype)
        out = torch.zeros(rows_out[rank], 3, dtype=dtype)
        if equal:  # no split sizes: torch splits dim 0 evenly
            dist.all_to_all_single(out, inp)
        else:
            dist.all_to_all_single(out, inp, output_split_sizes=[splits[i][rank] for i in range(n)],
                                   input_split_sizes=splits[rank])
        return out

    res = run(body, n)
    for j in range(n):
        pieces = [data(seed, i, (rows_in[i], 3), dtype).split(splits[i])[j] for i in range(n)]
        assert_same(res.returns[j], torch.cat(pieces), f"rank {j}")


# ---------------------------------------------------------------------------------
# barriers
# ---------------------------------------------------------------------------------

@FEW
@given(n=worlds, monitored=st.booleans(), wait_all=st.booleans())
def test_barrier_releases_no_rank_before_every_rank_reached_it(n, monitored, wait_all):
    arrived: list[int] = []
    lock = threading.Lock()

    def body(rank):
        with lock:
            arrived.append(rank)
        if monitored:
            dist.monitored_barrier(wait_all_ranks=wait_all)
        else:
            assert dist.barrier() is None
        with lock:
            return sorted(arrived)

    res = run(body, n)
    assert res.returns == [list(range(n))] * n
    op = "monitored_barrier" if monitored else "barrier"
    assert all([rec.op for rec in tr] == [op] for tr in res.trace)


@FEW
@given(n=worlds)
def test_async_barrier_work_completes_with_an_empty_result(n):
    def body(rank):
        work = dist.barrier(async_op=True)
        work.wait()
        return work.is_completed(), work.is_success(), work.get_future().wait(), work.result()

    assert run(body, n).returns == [(True, True, [], [])] * n


# ---------------------------------------------------------------------------------
# point-to-point
# ---------------------------------------------------------------------------------

@SETTINGS
@given(n=st.integers(2, 8), seed=seeds, dtype=dtypes, data_=st.data())
def test_send_recv_deliver_each_pair_and_tag_in_fifo_order(n, seed, dtype, data_):
    # a list of messages (src, dst, tag); every rank posts its sends then its recvs
    msgs = data_.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 2))
                               .filter(lambda m: m[0] != m[1]), min_size=1, max_size=10))
    use_async = data_.draw(st.booleans())

    def body(rank):
        got = []
        if use_async:  # every isend first, then every irecv, then wait for all of them
            works = [dist.isend(data(seed, s, (k + 1,), dtype, salt=k), d, tag=tag)
                     for k, (s, d, tag) in enumerate(msgs) if s == rank]
            for k, (s, d, tag) in enumerate(msgs):
                if d == rank:
                    got.append(torch.zeros(k + 1, dtype=dtype))
                    works.append(dist.irecv(got[-1], s, tag=tag))
            for w in works:
                w.wait()
        else:  # blocking calls in the list's order (a send waits for its recv, as on gloo)
            for k, (s, d, tag) in enumerate(msgs):
                if s == rank:
                    dist.send(data(seed, s, (k + 1,), dtype, salt=k), d, tag=tag)
                elif d == rank:
                    got.append(torch.zeros(k + 1, dtype=dtype))
                    dist.recv(got[-1], s, tag=tag)
        return got

    res = run(body, n)
    for rank in range(n):
        expected = [data(seed, s, (k + 1,), dtype, salt=k) for k, (s, d, _) in enumerate(msgs) if d == rank]
        assert len(res.returns[rank]) == len(expected)
        for got, exp in zip(res.returns[rank], expected):
            assert_same(got, exp, f"rank {rank}")


@SETTINGS
@given(n=st.integers(2, 8), seed=seeds)
def test_recv_from_any_source_returns_the_sender_and_its_tensor(n, seed):
    def body(rank):
        if rank == 0:
            got = []
            for _ in range(n - 1):
                t = torch.zeros(3)
                sender = dist.recv(t)  # src=None: any source
                got.append((sender, t))
            return got
        dist.send(data(seed, rank, (3,), torch.float32), dst=0)
        return None

    got = run(body, n).returns[0]
    assert sorted(s for s, _ in got) == list(range(1, n))
    for sender, t in got:
        assert_same(t, data(seed, sender, (3,), torch.float32), f"from {sender}")


@SETTINGS
@given(n=worlds, seed=seeds, dtype=dtypes, shift=st.integers(1, 7))
def test_batch_isend_irecv_ring_exchange_passes_each_tensor_to_the_next_rank(n, seed, dtype, shift):
    def body(rank):
        send = data(seed, rank, (4,), dtype)
        recv = torch.zeros(4, dtype=dtype)
        ops = [dist.P2POp(dist.isend, send, (rank + shift) % n), dist.P2POp(dist.irecv, recv, (rank - shift) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return recv

    res = run(body, n)
    for r in range(n):
        assert_same(res.returns[r], data(seed, (r - shift) % n, (4,), dtype), f"rank {r}")


# ---------------------------------------------------------------------------------
# object collectives
# ---------------------------------------------------------------------------------

def obj(seed: int, rank: int, salt: int = 0):
    return {"rank": rank, "salt": salt, "items": list(range((seed + rank + salt) % 5)), "s": f"r{rank}" * (seed % 3)}


@FEW
@given(n=worlds, seed=seeds, pick=st.integers(0, 7))
def test_object_collectives_move_python_objects_like_their_tensor_versions(n, seed, pick):
    root = pick % n

    def body(rank):
        gathered = [None] * n
        dist.all_gather_object(gathered, obj(seed, rank))
        bl = [obj(seed, rank, 1), obj(seed, rank, 2)]
        dist.broadcast_object_list(bl, src=root)
        go = [None] * n if rank == root else None
        dist.gather_object(obj(seed, rank, 3), go, dst=root)
        so = [None]
        dist.scatter_object_list(so, [obj(seed, root, 10 + j) for j in range(n)] if rank == root else None, src=root)
        return gathered, bl, go, so[0]

    res = run(body, n)
    for r, (gathered, bl, go, so) in enumerate(res.returns):
        assert gathered == [obj(seed, j) for j in range(n)]
        assert bl == [obj(seed, root, 1), obj(seed, root, 2)]
        assert go == ([obj(seed, j, 3) for j in range(n)] if r == root else None)
        assert so == obj(seed, root, 10 + r)


# ---------------------------------------------------------------------------------
# coalescing manager
# ---------------------------------------------------------------------------------

@SETTINGS
@given(n=worlds, seed=seeds, tensor_shapes=st.lists(nonempty_shapes, min_size=1, max_size=4),
       async_ops=st.booleans())
def test_coalescing_manager_reduces_every_tensor_issued_inside_it(n, seed, tensor_shapes, async_ops):
    def body(rank):
        ts = [data(seed, rank, s, torch.float64, salt=i) for i, s in enumerate(tensor_shapes)]
        with dist._coalescing_manager(async_ops=async_ops) as cm:
            for t in ts:
                dist.all_reduce(t)
        if async_ops:
            cm.wait()
        return ts

    res = run(body, n)
    for i, s in enumerate(tensor_shapes):
        expected = reference([data(seed, r, s, torch.float64, salt=i) for r in range(n)], "SUM")
        for r in range(n):
            assert_same(res.returns[r][i], expected, f"rank {r} tensor {i}")


# ---------------------------------------------------------------------------------
# subgroups
# ---------------------------------------------------------------------------------

@SETTINGS
@given(n=worlds, seed=seeds, dtype=st.sampled_from([torch.float32, torch.int64]), data_=st.data())
def test_collectives_on_a_new_group_involve_exactly_its_members(n, seed, dtype, data_):
    members = sorted(data_.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    src = data_.draw(st.sampled_from(members))

    def body(rank):
        sub = dist.new_group(members)  # every rank calls new_group, as torch requires
        if rank not in members:
            t = data(seed, rank, (2,), dtype)
            dist.all_reduce(t)  # then the world all_reduce below pairs with the members' one
            return None, None, t
        a = data(seed, rank, (2,), dtype)
        dist.all_reduce(a, group=sub)
        b = data(seed, rank, (2,), dtype, salt=1)
        dist.broadcast(b, src=src, group=sub)
        gathered = [torch.zeros(2, dtype=dtype) for _ in members]
        dist.all_gather(gathered, data(seed, rank, (2,), dtype, salt=2), group=sub)
        assert dist.get_rank(sub) == members.index(rank) and dist.get_world_size(sub) == len(members)
        t = data(seed, rank, (2,), dtype)
        dist.all_reduce(t)
        return a, (b, gathered), t

    res = run(body, n)
    sub_sum = reference([data(seed, m, (2,), dtype) for m in members], "SUM")
    world_sum = reference([data(seed, r, (2,), dtype) for r in range(n)], "SUM")
    for r in range(n):
        a, rest, t = res.returns[r]
        assert_same(t, world_sum, f"world all_reduce on rank {r}")
        if r in members:
            b, gathered = rest
            assert_same(a, sub_sum, f"subgroup all_reduce on rank {r}")
            assert_same(b, data(seed, src, (2,), dtype, salt=1), f"subgroup broadcast on rank {r}")
            for k, m in enumerate(members):
                assert_same(gathered[k], data(seed, m, (2,), dtype, salt=2), f"rank {r} slot {k}")
            world_group = res.trace[r][-1].group
            sub_recs = [rec for rec in res.trace[r] if rec.group != world_group]
            assert [rec.op for rec in sub_recs] == ["all_reduce", "broadcast", "all_gather"]
            assert [rec.seq for rec in sub_recs] == [0, 1, 2]
            assert all(rec.group_ranks == tuple(members) for rec in sub_recs)
            assert sub_recs[1].root == src  # recorded as a global rank
        else:
            assert [rec.op for rec in res.trace[r]] == ["all_reduce"]


# ---------------------------------------------------------------------------------
# bad input and mismatches
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_bitwise_reduce_op_on_floating_dtype_raises_naming_rank_and_op(dtype, op):
    def body(rank):
        dist.all_reduce(torch.ones(3, dtype=dtype), op=getattr(R, op))

    with pytest.raises(fakepg.RankFailedError) as info:
        run(body, 2)
    msg = str(info.value)
    assert "rank 0" in msg and f"ReduceOp.{op}" in msg and "all_reduce" in msg, msg
    assert str(dtype) in msg and "test_collectives.py:" in msg, msg
    assert isinstance(info.value.__cause__, ValueError)


def _mismatch(kind: str):
    """A body whose rank 0 and rank 1 disagree in ``kind``; records each call's line."""
    lines: dict[int, int] = {}

    def body(rank):
        if kind == "shape":
            if rank == 0:
                lines[0] = _line() + 1
                dist.all_reduce(torch.zeros(3))
            else:
                lines[1] = _line() + 1
                dist.all_reduce(torch.zeros(4))
        elif kind == "dtype":
            if rank == 0:
                lines[0] = _line() + 1
                dist.all_reduce(torch.zeros(3))
            else:
                lines[1] = _line() + 1
                dist.all_reduce(torch.zeros(3, dtype=torch.float64))
        elif kind == "reduce op":
            if rank == 0:
                lines[0] = _line() + 1
                dist.all_reduce(torch.zeros(3), op=R.SUM)
            else:
                lines[1] = _line() + 1
                dist.all_reduce(torch.zeros(3), op=R.MAX)
        elif kind == "root":
            if rank == 0:
                lines[0] = _line() + 1
                dist.broadcast(torch.zeros(3), src=0)
            else:
                lines[1] = _line() + 1
                dist.broadcast(torch.zeros(3), src=1)
        elif kind == "op":
            if rank == 0:
                lines[0] = _line() + 1
                dist.all_reduce(torch.zeros(3))
            else:
                lines[1] = _line() + 1
                dist.broadcast(torch.zeros(3), src=0)
        elif kind == "premul factor":
            if rank == 0:
                lines[0] = _line() + 1
                dist.all_reduce(torch.zeros(3), op=dist._make_nccl_premul_sum(0.5))
            else:
                lines[1] = _line() + 1
                dist.all_reduce(torch.zeros(3), op=dist._make_nccl_premul_sum(0.25))
        elif kind == "split sizes":
            if rank == 0:
                lines[0] = _line() + 1
                dist.all_to_all_single(torch.zeros(2), torch.zeros(2), [1, 1], [1, 1])
            else:
                lines[1] = _line() + 1
                dist.all_to_all_single(torch.zeros(2), torch.zeros(2), [1, 1], [2, 0])

    return body, lines


@pytest.mark.parametrize("kind, words", [
    ("shape", ["shapes=[(3,)]", "shapes=[(4,)]"]),
    ("dtype", ["float32", "float64"]),
    ("reduce op", ["op=SUM", "op=MAX"]),
    ("root", ["root=0", "root=1"]),
    ("op", ["all_reduce(", "broadcast("]),
    ("premul factor", ["op=PREMUL_SUM"]),
    ("split sizes", ["all_to_all_single("]),
])
def test_mismatch_raises_naming_both_ranks_calls_and_their_lines(kind, words):
    body, lines = _mismatch(kind)
    with pytest.raises(fakepg.CollectiveMismatchError) as info:
        run(body, 2)
    msg = str(info.value)
    assert "rank 0: " in msg and "rank 1: " in msg, msg
    for r in (0, 1):
        assert f"test_collectives.py:{lines[r]}" in msg, (r, msg)
    for w in words:
        assert w in msg, (w, msg)


def test_mismatch_in_a_world_of_three_names_the_odd_rank_out():
    def body(rank):
        dist.all_reduce(torch.zeros(5 if rank == 2 else 2))

    with pytest.raises(fakepg.CollectiveMismatchError) as info:
        run(body, 3)
    msg = str(info.value)
    assert "shapes=[(5,)]" in msg and "shapes=[(2,)]" in msg
    assert all(f"rank {r}: all_reduce" in msg for r in range(3)), msg


def test_sparse_all_reduce_writes_the_coalesced_sum_into_each_ranks_own_input_as_gloo_does():
    # Found by torch's own suite (DistributedTest.test_sparse_all_reduce_sum); gloo's behaviour
    # checked by hand: the input tensor itself holds the coalesced sum and is work.result()[0].
    def body(rank):
        t = torch.sparse_coo_tensor(torch.tensor([[rank, 2, rank]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        same = work.result()[0] is t
        dist.barrier()
        if rank == 0:
            t._values().mul_(10)  # must not reach rank 1's tensor
        dist.barrier()
        return same, t.is_coalesced(), t._indices().tolist(), t._values().tolist()

    r0, r1 = fakepg.spawn(body, nprocs=2).returns
    assert r0 == (True, True, [[0, 1, 2]], [40.0, 40.0, 40.0])
    assert r1 == (True, True, [[0, 1, 2]], [4.0, 4.0, 4.0])
