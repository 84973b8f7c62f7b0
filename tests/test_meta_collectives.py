"""fakepg's collectives on meta tensors: validated, matched and traced as on real tensors
(bytes from shapes), moving no data — what capture at real size (simddp's
``capture(device="meta")``) relies on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fakepg

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.distributed.(all_gather_into|reduce_scatter)_tensor` is deprecated:FutureWarning")


def _every_collective(device: str) -> object:
    def run(rank: int) -> list[str]:
        n = dist.get_world_size()

        def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.ones(shape, dtype=dtype, device=device)

        dist.all_reduce(t(3, 5))
        dist.all_reduce(t(7, dtype=torch.bfloat16), op=dist.ReduceOp.MAX)
        dist.broadcast(t(4, 2), src=1)
        dist.all_gather([t(6) for _ in range(n)], t(6))
        dist.all_gather_into_tensor(t(n * 8), t(8))
        dist.reduce_scatter_tensor(t(5), t(n * 5))
        dist.reduce_scatter(t(2), [t(2) for _ in range(n)])
        dist.all_to_all_single(t(n * 3), t(n * 3))
        dist.reduce(t(9), dst=0)
        dist.gather(t(4), [t(4) for _ in range(n)] if rank == 0 else None, dst=0)
        dist.scatter(t(4), [t(4) for _ in range(n)] if rank == 0 else None, src=0)
        if rank == 0:
            dist.send(t(11), dst=1)
        elif rank == 1:
            dist.recv(t(11), src=0)
        work = dist.all_reduce(t(2, 2), async_op=True)
        work.wait()
        dist.barrier()
        out = t(n * 2)
        dist.all_gather_into_tensor(out, t(2))
        return [out.device.type]
    return run


def _signature(trace: list) -> list[tuple]:
    return [(r.op, r.group, r.seq, tuple(map(tuple, r.shapes)), tuple(r.dtypes), r.bytes)
            for r in trace]


def test_every_collective_on_meta_traces_what_real_tensors_trace():
    real = fakepg.spawn(_every_collective("cpu"), nprocs=3)
    meta = fakepg.spawn(_every_collective("meta"), nprocs=3)
    assert meta.returns == [["meta"]] * 3  # outputs stay meta: nothing was materialised
    for rank in range(3):
        assert _signature(meta.trace[rank]) == _signature(real.trace[rank])
        assert all(r.bytes > 0 or r.op == "barrier" for r in meta.trace[rank])


def test_mismatched_shapes_on_meta_are_caught_like_real_ones():
    def run(rank: int) -> None:
        dist.all_reduce(torch.empty(4 + rank, device="meta"))

    with pytest.raises(fakepg.CollectiveMismatchError) as info:
        fakepg.spawn(run, nprocs=2)
    assert "rank 0: all_reduce(shapes=[(4,)]" in str(info.value)
    assert "rank 1: all_reduce(shapes=[(5,)]" in str(info.value)


def test_meta_and_cpu_tensors_in_one_collective_are_a_mismatch():
    def run(rank: int) -> None:
        dist.all_reduce(torch.zeros(4, device="meta" if rank else "cpu"))

    with pytest.raises(fakepg.CollectiveMismatchError):
        fakepg.spawn(run, nprocs=2)


def test_invalid_all_gather_into_tensor_on_meta_is_refused():
    def run(rank: int) -> None:
        dist.all_gather_into_tensor(torch.empty(3, device="meta"), torch.empty(2, device="meta"))

    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(run, nprocs=2)
    assert "world_size × input" in str(info.value)
