"""The world answers as the backend the program asked for: its name, its refusals, its words.

The gloo refusals are compared with real 2-process gloo (``gloo`` marker); the NCCL ones
follow ProcessGroupNCCL's sources (no GPU on these machines).
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import fakepg
from gloo_processes import gloo_results


def _probes(rank):
    """Calls gloo refuses or accepts; each gives ("ok",) or (error type, first line)."""
    probes = {
        "premul_sum": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
        "avg_float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.AVG),
        "band_int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND),
        "all_to_all_unequal": lambda: dist.all_to_all([torch.zeros(1 + rank, 2) for _ in range(2)],
                                                      [torch.ones(1 + i, 2) for i in range(2)]),
        "all_to_all_equal": lambda: dist.all_to_all([torch.zeros(2) for _ in range(2)],
                                                    [torch.ones(2) for _ in range(2)]),
    }
    out = {}
    for name, call in probes.items():
        try:
            call()
            out[name] = ("ok",)
        except RuntimeError as e:
            out[name] = ("RuntimeError", str(e).split("\nException raised from")[0].split(" (rank ")[0])
        dist.barrier()
    return out


@pytest.mark.gloo
def test_a_gloo_world_refuses_and_accepts_what_real_gloo_does_with_its_messages(tmp_path):
    real = gloo_results(_probes, 2, tmp_path)
    fake = fakepg.spawn(_probes, nprocs=2, backend="gloo").returns
    assert fake == real
    assert real[0]["premul_sum"] == ("RuntimeError", "Cannot use ReduceOp.PREMUL_SUM with Gloo")


def test_a_gloo_world_refuses_an_integer_average_as_gloo_does():
    # Seen on real gloo (torch 2.13): the sum is cast back to the integer input and fails.
    def body(rank):
        with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired "
                                               "output type Long"):
            dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)
        return True

    assert fakepg.spawn(body, nprocs=2, backend="gloo").returns == [True, True]


def test_the_fakepg_personality_allows_what_fakepg_can_compute():
    out = fakepg.spawn(_probes, nprocs=2).returns[0]
    assert set(out.values()) == {("ok",)}


@pytest.mark.parametrize("asked, reported", [(None, "fakepg"), ("gloo", "gloo"), ("nccl", "nccl"),
                                             ("cpu:gloo,cuda:nccl", "nccl")])
def test_get_backend_and_the_groups_name_report_what_the_program_asked_for(asked, reported):
    def body(rank):
        if asked is not None:
            dist.init_process_group(asked)
        pg = dist.distributed_c10d._get_default_group()
        return str(dist.get_backend()), pg.name()

    assert fakepg.spawn(body, nprocs=2).returns == [(reported, reported)] * 2


def test_spawn_backend_sets_the_personality_and_new_group_can_name_another():
    def body(rank):
        nccl = dist.new_group(backend="nccl")
        return str(dist.get_backend()), str(dist.get_backend(nccl))

    assert fakepg.spawn(body, nprocs=2, backend="gloo").returns == [("gloo", "nccl")] * 2


def test_an_unknown_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'mpi'.*gloo.*nccl"):
        fakepg.spawn(lambda rank: None, nprocs=2, backend="mpi")


@pytest.mark.parametrize("call, error, says", [
    (lambda rank: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), ValueError,
     "Cannot use ReduceOp.BAND with NCCL"),
    (lambda rank: dist.recv(torch.zeros(1)), RuntimeError,
     "Backend nccl does not support recvAnysource"),
    (lambda rank: dist.monitored_barrier(), ValueError,
     "monitored_barrier is only implemented for GLOO backend."),
])
def test_an_nccl_world_refuses_what_nccl_refuses(call, error, says):
    def body(rank):
        with pytest.raises(error, match=says):
            call(rank)
        return True

    assert fakepg.spawn(body, nprocs=2, backend="nccl").returns == [True, True]


def test_an_nccl_timeout_is_worded_as_its_watchdog():
    def body(rank):
        g = dist.new_group(timeout=datetime.timedelta(milliseconds=100))
        if rank == 1:
            time.sleep(0.3)
            return None
        with pytest.raises(dist.DistBackendError) as info:
            dist.all_reduce(torch.ones(3), group=g)
        return str(info.value).splitlines()[0]

    first_line = fakepg.spawn(body, nprocs=2, backend="nccl").returns[0]
    assert first_line == ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
                          "OpType=ALLREDUCE, NumelIn=3, NumelOut=3, Timeout(ms)=100) ran for 100 "
                          "milliseconds before timing out.")


def test_collectives_show_in_the_profiler_as_async_events_named_by_the_backend():
    def body(rank):
        dist.init_process_group("gloo")
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            if rank == 0:
                dist.send(torch.ones(3), 1)
            else:
                dist.recv(torch.zeros(3))
        return [(e.name, e.is_async, e.input_shapes) for e in prof.function_events
                if e.name.startswith("gloo:")]

    assert fakepg.spawn(body, nprocs=2).returns == [[("gloo:send", True, [[3]])],
                                                    [("gloo:recvAnySource", True, [[3]])]]
