"""simddp: virtual time on the fake cluster (DESIGN, simddp semantics 1-3)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
import simddp
from simddp import Compute, Network, Timing

NET = Network(bandwidth_GBps=10.0, latency_us=5.0)
ALPHA, BW = 5e-6, 10e9
mm_costs_one_second = Compute.from_profile({"aten::mm": 1.0}, fallback=Compute.constant(0.0))


def train(rank, iters=4, width=256, depth=6, cap=0.25, hook=None):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]), bucket_cap_mb=cap)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)
    for _ in range(iters):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def buckets_of(result, rank, iteration):
    lo, hi = result.timeline.windows(rank)[iteration]
    return [r for r in result.trace[rank] if lo <= r.issue < hi and r.op == "all_reduce"]


@pytest.mark.parametrize("n, nbytes", [(2, 1_000_000), (4, 4_000_000), (8, 12_345_676)])
def test_one_all_reduce_of_B_bytes_on_n_ranks_without_compute_lasts_the_ring_formula(n, nbytes):
    def body(rank):
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t)
        return simddp.now()

    res = simddp.simulate(body, nprocs=n, timing=Timing(network=NET, compute=Compute.constant(0)))
    expected = 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * nbytes / BW
    for rank in range(n):
        (rec,) = [r for r in res.trace[rank] if r.op == "all_reduce"]
        assert rec.bytes == nbytes
        assert (rec.issue, rec.start) == (0.0, 0.0)
        assert rec.end == pytest.approx(expected, rel=1e-12)
        assert res.returns[rank] == pytest.approx(expected, rel=1e-12)


def test_ddp_iteration_with_negligible_compute_lasts_the_sum_of_its_bucket_collectives():
    res = simddp.simulate(train, nprocs=4, timing=Timing(network=NET, compute=Compute.constant(0)))
    times = res.timeline.iteration_times()
    assert len(times) == 4
    for it in (2, 3):  # after DDP rebuilt its buckets
        buckets = buckets_of(res, 0, it)
        assert len(buckets) >= 3
        for b in buckets:
            assert b.end - b.start == pytest.approx(NET.collective_time("all_reduce", b.bytes, 4))
        assert times[it] == pytest.approx(sum(b.end - b.start for b in buckets), rel=1e-9)
        assert res.timeline.exposed_comm()[it] == pytest.approx(times[it], rel=1e-9)


def test_ddp_iteration_with_heavy_compute_exposes_only_the_last_bucket():
    res = simddp.simulate(train, nprocs=4, timing=Timing(network=NET, compute=Compute.constant(1e-3)))
    tl = res.timeline
    for it in (2, 3):
        buckets = buckets_of(res, 0, it)
        durations = [b.end - b.start for b in buckets]
        assert len(buckets) >= 3
        assert tl.exposed_comm()[it] == pytest.approx(durations[-1], rel=1e-9)
        assert sum(durations) > 2 * durations[-1]  # the others hid behind backward
        row = next(r for r in tl.breakdown() if r.iteration == it and r.rank == 0)
        assert row.duration == pytest.approx(row.compute + durations[-1], rel=1e-9)
        assert row.wait == pytest.approx(durations[-1], rel=1e-9)


def test_a_rank_at_half_speed_makes_the_others_wait_by_the_difference():
    timing = dict(network=NET, compute=Compute.constant(1e-4))
    slow = simddp.simulate(train, nprocs=3, timing=Timing(rank_speed={1: 0.5}, **timing))
    even = simddp.simulate(train, nprocs=3, timing=Timing(**timing))
    rows = {(r.iteration, r.rank): r for r in slow.timeline.breakdown()}
    for it in (2, 3):
        fast, straggler = rows[it, 0], rows[it, 1]
        difference = straggler.compute - fast.compute
        assert straggler.compute == pytest.approx(2 * fast.compute, rel=1e-9)
        assert fast.wait - straggler.wait == pytest.approx(difference, rel=1e-9)
        assert rows[it, 2].wait == pytest.approx(fast.wait, rel=1e-9)
        assert slow.timeline.iteration_times()[it] - even.timeline.iteration_times()[it] == \
            pytest.approx(difference, rel=1e-9)


def test_a_wait_moves_the_clock_to_the_collectives_end_and_never_back():
    def body(rank, ops_before_wait):
        t = torch.ones(250_000)  # 1 MB
        work = dist.all_reduce(t, async_op=True)
        issued = simddp.now()
        a = torch.ones(2, 2)
        for _ in range(ops_before_wait):
            a = a @ a  # 1 s each
        before = simddp.now()
        work.wait()
        return issued, before, simddp.now()

    duration = NET.collective_time("all_reduce", 1_000_000, 2)
    timing = Timing(network=NET, compute=mm_costs_one_second)
    res = simddp.simulate(body, args=(0,), nprocs=2, timing=timing)
    for issued, before, after in res.returns:
        assert before == issued == 0.0 and after == pytest.approx(duration)
    res = simddp.simulate(body, args=(3,), nprocs=2, timing=timing)
    for issued, before, after in res.returns:
        assert before == after == 3.0


def test_a_collective_starts_at_its_last_issue_and_after_the_groups_previous_collective():
    def body(rank):
        if rank == 1:
            a = torch.ones(2, 2)
            a @ a  # rank 1 issues 1 s late
        x, y = torch.ones(250_000), torch.ones(250_000)
        w1 = dist.all_reduce(x, async_op=True)
        w2 = dist.all_reduce(y, async_op=True)
        w1.wait()
        w2.wait()
        return simddp.now()

    res = simddp.simulate(body, nprocs=2, timing=Timing(network=NET, compute=mm_costs_one_second))
    d = NET.collective_time("all_reduce", 1_000_000, 2)
    for rank in range(2):
        first, second = res.trace[rank]
        assert first.issue == (0.0 if rank == 0 else 1.0)
        assert first.start == 1.0 and first.end == pytest.approx(1.0 + d)
        assert second.start == first.end and second.end == pytest.approx(1.0 + 2 * d)
        assert res.returns[rank] == second.end


def test_a_receive_still_in_flight_holds_back_no_collective_issued_after_it():
    # a pipeline's early-posted receive (rank 2 sends 3 s late) and an all-reduce on another
    # group: on a GPU their communicators finish independently, and so do they here
    def body(rank):
        pair = dist.new_group([0, 1])
        t = torch.ones(250_000)
        if rank == 2:
            a = torch.ones(2, 2)
            for _ in range(3):
                a = a @ a  # 1 s each
            dist.send(t, dst=0)
            return simddp.now()
        recv = dist.irecv(torch.empty(250_000), src=2) if rank == 0 else None
        dist.all_reduce(t, group=pair)  # synchronous: waited at once
        done = simddp.now()
        if recv is not None:
            recv.wait()
        return done

    res = simddp.simulate(body, nprocs=3, timing=Timing(network=NET, compute=mm_costs_one_second))
    d = NET.collective_time("all_reduce", 1_000_000, 2)
    assert res.returns[0] == res.returns[1] == pytest.approx(d)


def test_point_to_point_costs_one_send_of_its_bytes():
    def body(rank):
        t = torch.ones(1000)
        if rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
        return simddp.now()

    res = simddp.simulate(body, nprocs=2, timing=Timing(network=NET, compute=Compute.constant(0)))
    assert res.returns == [pytest.approx(ALPHA + 4000 / BW)] * 2


def test_phases_are_forward_backward_and_optimizer_and_iterations_end_at_optimizer_steps():
    res = simddp.simulate(train, args=(3,), nprocs=2,
                          timing=Timing(network=NET, compute=Compute.constant(1e-4)))
    tl = res.timeline
    assert {s.kind for s in tl.spans} == {"forward", "backward", "optimizer", "wait"}
    assert tl.num_iterations() == 3
    for rank in range(2):
        optimizer_ends = [s.end for s in tl.rank_spans(rank, ["optimizer"])]
        assert tl.boundaries[rank] == optimizer_ends
        spans = tl.rank_spans(rank)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # one clock per rank


def test_results_and_collectives_are_those_of_the_untimed_run():
    untimed = fakepg.spawn(train, args=(2,), nprocs=2)
    timed = simddp.simulate(train, args=(2,), nprocs=2, timing=Timing())
    for a, b in zip(untimed.returns, timed.returns):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert [[(r.op, r.seq, r.bytes) for r in rs] for rs in untimed.trace] == \
        [[(r.op, r.seq, r.bytes) for r in rs] for rs in timed.trace]
    assert all(r.issue <= r.start <= r.end for rs in timed.trace for r in rs)


def test_a_future_callback_reading_the_output_runs_after_the_collective_and_is_no_race():
    def body(rank):
        t = torch.ones(1000)
        fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
        value = fut.wait()
        after_wait = simddp.now()
        return value[0].item(), after_wait

    res = simddp.simulate(body, nprocs=2, timing=Timing(network=NET, compute=Compute.constant(1e-3)))
    end = res.trace[0][0].end
    assert end == pytest.approx(1e-3 + NET.collective_time("all_reduce", 4000, 2))
    assert res.returns == [(4.0, pytest.approx(end + 1e-3))] * 2  # the callback's one op


def test_comm_hook_callbacks_run_on_a_side_stream_after_their_bucket():
    res = simddp.simulate(train, (3, 256, 6, 0.25, default_hooks.fp16_compress_hook),
                          nprocs=2, timing=Timing(network=NET, compute=Compute.constant(1e-3)))
    tl = res.timeline
    ends = {c.end for c in tl.rank_comms(0)}
    callbacks = tl.rank_spans(0, ["callback"])
    assert len(callbacks) >= 3
    for s in callbacks:
        assert s.start in ends or any(s.start == o.end for o in callbacks)
    last = buckets_of(res, 0, 2)[-1]
    assert tl.waits(0)[2] == pytest.approx(last.end - last.start + 1e-3, rel=1e-9)
