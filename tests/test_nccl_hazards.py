"""NCCL's hazards under the nccl personality: what gloo lets pass and a GPU job meets."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg.fidelity.nccl_hazards import NcclHazardError, NcclHazards, NcclHazardWarning, parse_modes


def _inverted_order(rank):
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    t = torch.ones(2)
    works = [dist.all_reduce(t, group=g, async_op=True) for g in ((a, b) if rank == 0 else (b, a))]
    for w in works:
        w.wait()
    return t.tolist()


def _same_order_or_waited(rank):
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    t = torch.ones(2)
    works = [dist.all_reduce(t, group=g, async_op=True) for g in (a, b)]  # the same order
    for w in works:
        w.wait()
    works = [dist.all_reduce(t, group=a, async_op=True) for _ in range(2)]  # one communicator
    dist.all_reduce(t, group=b)
    for w in works:
        w.wait()
    return t.tolist()


def _crossing_p2p(rank):
    other = 1 - rank
    works = [dist.isend(torch.ones(3), other), dist.irecv(torch.zeros(3), other)]
    for w in works:
        w.wait()
    return True


def _ordered_p2p(rank):
    other, buf = 1 - rank, torch.zeros(3)
    if rank == 0:  # one sends first, the other receives first: NCCL matches them in order
        works = [dist.isend(torch.ones(3), other), dist.irecv(buf, other)]
    else:
        works = [dist.irecv(buf, other), dist.isend(torch.ones(3) * 2, other)]
    for w in works:
        w.wait()
    return buf.tolist()


def _batched_p2p(rank):
    other, buf = 1 - rank, torch.zeros(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), other),
                                    dist.P2POp(dist.irecv, buf, other)])
    for w in works:
        w.wait()
    return buf.tolist()


def _cpu_all_reduce(rank):
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.tolist()


def test_inconsistent_order_across_communicators_is_a_potential_deadlock_naming_groups_and_sites():
    with pytest.raises(fakepg.RankFailedError) as info:
        fakepg.spawn(_inverted_order, nprocs=2, backend="nccl")
    cause = info.value.__cause__
    assert isinstance(cause, NcclHazardError)
    lines = str(cause).splitlines()
    assert "potential deadlock under NCCL" in lines[0]
    line = _inverted_order.__code__.co_firstlineno + 3
    site = f"test_nccl_hazards.py:{line}"
    assert lines[1].startswith("  rank 1: all_reduce #0 on group '2'") and "then all_reduce #0 on group '1'" in lines[1]
    assert lines[2].startswith("  rank 0: all_reduce #0 on group '1'") and "then all_reduce #0 on group '2'" in lines[2]
    assert lines[1].count(site) == 2 and lines[2].count(site) == 2


def test_the_same_inverted_order_is_accepted_under_gloo_and_warned_with_warn():
    assert fakepg.spawn(_inverted_order, nprocs=2, backend="gloo").returns == [[4.0, 4.0]] * 2
    with pytest.warns(NcclHazardWarning, match="potential deadlock under NCCL"):
        out = fakepg.spawn(_inverted_order, nprocs=2, backend="nccl", nccl_hazards="warn")
    assert out.returns == [[4.0, 4.0]] * 2


def test_consistent_order_or_a_wait_between_is_not_reported():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NcclHazardWarning)
        out = fakepg.spawn(_same_order_or_waited, nprocs=2, backend="nccl")
    assert out.returns == [[32.0, 32.0]] * 2


def test_crossing_unbatched_isend_irecv_is_a_hang_verdict_under_nccl_saying_why():
    with pytest.raises(fakepg.CollectiveHangError) as info:
        fakepg.spawn(_crossing_p2p, nprocs=2, backend="nccl")
    report = str(info.value)
    assert "unbatched sends and receives between two ranks match in issue order" in report
    site = f"test_nccl_hazards.py:{_crossing_p2p.__code__.co_firstlineno + 2}"
    for rank in (0, 1):
        assert re.search(f"rank {rank}: recv with rank {1 - rank} at \\S*{site} runs after its "
                         f"unmatched send with rank {1 - rank} at \\S*{site}", report)
    assert "batch_isend_irecv" in report


def test_gloo_keeps_accepting_crossing_isend_irecv_and_nccl_warn_goes_on():
    assert fakepg.spawn(_crossing_p2p, nprocs=2, backend="gloo").returns == [True, True]
    with pytest.warns(NcclHazardWarning, match="run in issue order on the pair's NCCL stream"):
        out = fakepg.spawn(_crossing_p2p, nprocs=2, backend="nccl", nccl_hazards={"p2p": "warn"})
    assert out.returns == [True, True]


def test_p2p_in_matching_order_and_batch_isend_irecv_run_under_nccl():
    assert fakepg.spawn(_ordered_p2p, nprocs=2, backend="nccl").returns == [[2.0] * 3, [1.0] * 3]
    assert fakepg.spawn(_batched_p2p, nprocs=2, backend="nccl").returns == [[1.0] * 3, [0.0] * 3]


def test_cpu_tensors_to_an_nccl_collective_fail_as_torch_fails():
    def body(rank):
        with pytest.raises(RuntimeError, match="^No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(2))
        return True

    out = fakepg.spawn(body, nprocs=2, backend="nccl", nccl_hazards={"cpu_tensors": "error"})
    assert out.returns == [True, True]


def test_cpu_tensors_can_be_warned_about_or_allowed_and_gloo_takes_them():
    with pytest.warns(NcclHazardWarning, match="No backend type associated with device type cpu"):
        out = fakepg.spawn(_cpu_all_reduce, nprocs=2, backend="nccl", nccl_hazards="warn")
    assert out.returns == [[2.0, 2.0]] * 2
    out = fakepg.spawn(_cpu_all_reduce, nprocs=2, backend="nccl", nccl_hazards={"cpu_tensors": "off"})
    assert out.returns == [[2.0, 2.0]] * 2
    assert fakepg.spawn(_cpu_all_reduce, nprocs=2, backend="gloo",
                        nccl_hazards="error").returns == [[2.0, 2.0]] * 2


def test_cpu_tensors_default_to_an_error_only_where_cuda_could_have_been_used():
    expected = "error" if torch.cuda.is_available() else "off"
    assert NcclHazards().modes["cpu_tensors"] == expected


@pytest.mark.parametrize("setting, error", [("loud", ValueError), ({"order": "maybe"}, ValueError),
                                            ({"deadlocks": "off"}, ValueError), (3, TypeError)])
def test_a_bad_nccl_hazards_setting_is_a_clear_error(setting, error):
    with pytest.raises(error, match="nccl_hazards"):
        fakepg.spawn(lambda rank: None, nprocs=2, nccl_hazards=setting)


def test_modes_default_per_hazard_and_a_mapping_overrides_some():
    assert parse_modes(None) == {"order": "error", "p2p": "error", "cpu_tensors": "auto"}
    assert parse_modes({"p2p": "off"})["p2p"] == "off"
    assert parse_modes("warn") == dict.fromkeys(("order", "p2p", "cpu_tensors"), "warn")
