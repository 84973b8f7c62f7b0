"""Whole-process isolation: what one rank changes in its "process" no other rank, the caller
after spawn, or a later world sees."""

import os
import threading

import torch
import torch.distributed as dist

import fakepg
from fakepg.world.isolation import ProcessState, capture_switches


def test_a_variable_one_rank_sets_is_seen_by_no_other_rank_nor_the_caller():
    os.environ.pop("FAKEPG_TEST_VAR", None)

    def body(rank):
        if rank == 0:
            os.environ["FAKEPG_TEST_VAR"] = "rank0"
        dist.barrier()  # rank 1 runs while rank 0's change is in place
        return os.environ.get("FAKEPG_TEST_VAR")

    assert fakepg.spawn(body, nprocs=2).returns == ["rank0", None]
    assert "FAKEPG_TEST_VAR" not in os.environ
    assert fakepg.spawn(lambda rank: os.environ.get("FAKEPG_TEST_VAR"), nprocs=2).returns == [None, None]


def test_ranks_start_from_the_callers_environment_and_cannot_remove_it_for_others():
    os.environ["FAKEPG_TEST_INHERITED"] = "from-caller"
    try:
        def body(rank):
            seen = os.environ.get("FAKEPG_TEST_INHERITED")
            if rank == 0:
                del os.environ["FAKEPG_TEST_INHERITED"]
                os.environ["RANK"] = "99"
            dist.barrier()
            return seen, os.environ.get("FAKEPG_TEST_INHERITED"), os.environ["RANK"]

        out = fakepg.spawn(body, nprocs=2).returns
        assert out == [("from-caller", None, "99"), ("from-caller", "from-caller", "1")]
        assert os.environ["FAKEPG_TEST_INHERITED"] == "from-caller"
        assert "RANK" not in os.environ or os.environ["RANK"] != "99"
    finally:
        os.environ.pop("FAKEPG_TEST_INHERITED", None)


def test_a_rank_changes_the_environment_c_code_sees_too():
    import ctypes
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p

    def body(rank):
        if rank == 1:
            os.environ["FAKEPG_TEST_C"] = "one"
        dist.barrier()
        return getenv(b"FAKEPG_TEST_C")

    assert fakepg.spawn(body, nprocs=2).returns == [None, b"one"]
    assert getenv(b"FAKEPG_TEST_C") is None


def test_extra_per_rank_variables_are_added_to_the_callers_environment():
    os.environ["FAKEPG_TEST_BASE"] = "base"
    try:
        state = ProcessState.for_rank(0, 2, 0, {"RANK": "0", "EXTRA": "x", "FAKEPG_TEST_BASE": None})
        host = ProcessState()
        host.save()
        state.install()
        seen = dict(os.environ)
        host.install()
    finally:
        os.environ.pop("FAKEPG_TEST_BASE", None)
    assert seen["RANK"] == "0" and seen["EXTRA"] == "x" and "FAKEPG_TEST_BASE" not in seen
    assert "EXTRA" not in os.environ


def test_default_dtype_is_per_rank_and_restored_for_the_caller():
    def body(rank):
        if rank == 0:
            torch.set_default_dtype(torch.float64)
        dist.barrier()
        return torch.ones(1).dtype

    assert fakepg.spawn(body, nprocs=2).returns == [torch.float64, torch.float32]
    assert torch.get_default_dtype() == torch.float32


def test_deterministic_algorithms_and_warn_only_are_per_rank():
    def body(rank):
        if rank == 1:
            torch.use_deterministic_algorithms(True, warn_only=True)
        dist.barrier()
        return (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())

    assert fakepg.spawn(body, nprocs=2).returns == [(False, False), (True, True)]
    assert not torch.are_deterministic_algorithms_enabled()


def test_backend_switches_and_matmul_precision_are_per_rank(monkeypatch):
    # importing torch.testing._internal.common_utils (torch's suite, in another test of this
    # worker) freezes the cudnn flags process-wide: unfreeze them for this test
    monkeypatch.setitem(torch.backends.flags_frozen.__globals__, "__allow_nonbracketed_mutation_flag", True)
    einsum = torch.backends.opt_einsum.enabled  # True only where the opt_einsum package is

    def switches():
        return (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                torch.backends.mkldnn.enabled, torch.backends.opt_einsum.enabled,
                torch.get_float32_matmul_precision())

    def body(rank):
        if rank == 0:
            torch.backends.cudnn.benchmark = True
            torch.backends.cudnn.deterministic = True
            torch.backends.mkldnn.enabled = False
            torch.backends.opt_einsum.enabled = not einsum if einsum else False
            torch.set_float32_matmul_precision("high")
        dist.barrier()
        return switches()

    # the caller's values, whatever an earlier test in this worker left (rank 1 inherits them)
    callers, before = switches(), capture_switches()
    assert callers[:3] != (True, True, False) and callers[4] != "high", "a test leaked switches"
    out = fakepg.spawn(body, nprocs=2).returns
    assert out[0] == (True, True, False, False, "high")
    assert out[1] == callers
    assert capture_switches() == before


def test_anomaly_detection_is_a_process_global_switch_made_per_rank():
    def body(rank):
        if rank == 0:
            torch.autograd.set_detect_anomaly(True)
        dist.barrier()
        return torch.is_anomaly_enabled()

    assert fakepg.spawn(body, nprocs=2).returns == [True, False]
    assert not torch.is_anomaly_enabled()


def test_print_options_are_per_rank():
    def body(rank):
        if rank == 0:
            torch.set_printoptions(precision=2)
        dist.barrier()
        return repr(torch.tensor([1.23456]))

    assert fakepg.spawn(body, nprocs=2).returns == ["tensor([1.23])", "tensor([1.2346])"]
    assert repr(torch.tensor([1.23456])) == "tensor([1.2346])"


def test_thread_count_a_rank_sets_is_its_own_and_the_callers_is_restored(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    host = torch.get_num_threads()

    def body(rank):
        if rank == 0:
            torch.set_num_threads(3)
        dist.barrier()
        return torch.get_num_threads()

    assert fakepg.spawn(body, nprocs=2).returns == [3, 1]
    assert torch.get_num_threads() == host


def _threads_in_a_new_thread() -> int:
    out = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


def test_ranks_of_a_world_start_with_one_intra_op_thread_unless_omp_num_threads_says_otherwise(
        monkeypatch):
    """As torchrun starts several workers (OMP_NUM_THREADS=1 when unset); the caller's count,
    and the count a thread started after the world inherits, come back."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    host = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        count = lambda rank: torch.get_num_threads()  # noqa: E731
        assert fakepg.spawn(count, nprocs=2).returns == [1, 1]
        assert fakepg.spawn(count, nprocs=1).returns == [2]  # one worker: torchrun sets nothing
        assert fakepg.spawn(count, nprocs=2, env={"OMP_NUM_THREADS": "3"}).returns == [3, 3]
        assert fakepg.spawn(count, nprocs=2, env=lambda r: {"OMP_NUM_THREADS": str(r + 2)}
                            ).returns == [2, 3]
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        assert fakepg.spawn(count, nprocs=2).returns == [4, 4]
        assert torch.get_num_threads() == 2
        assert _threads_in_a_new_thread() == 2
    finally:
        torch.set_num_threads(host)


def test_grad_mode_is_per_thread_already_and_each_rank_starts_with_it_on():
    def body(rank):
        if rank == 0:
            torch.set_grad_enabled(False)
        dist.barrier()
        return torch.is_grad_enabled()

    with torch.no_grad():
        assert fakepg.spawn(body, nprocs=2).returns == [False, True]
    assert torch.is_grad_enabled()


def test_python_and_numpy_draws_continue_across_hand_offs_as_in_a_separate_process():
    import random

    import numpy as np

    def draws(rank):
        random.seed(rank)
        np.random.seed(rank)
        # normals leave a cached second value in both generators: it must survive hand-offs
        first = (random.gauss(0, 1), np.random.randn(), np.random.rand())
        dist.barrier()
        second = (random.gauss(0, 1), np.random.randn(), random.random(), np.random.randn())
        dist.barrier()
        return first + second + (np.random.rand(),)

    def alone(rank):  # what a process of its own draws
        py, rs = random.Random(rank), np.random.RandomState(rank)
        return (py.gauss(0, 1), rs.randn(), rs.rand(), py.gauss(0, 1), rs.randn(), py.random(),
                rs.randn(), rs.rand())

    result = fakepg.spawn(draws, nprocs=3)
    assert result.returns == [alone(r) for r in range(3)]


def test_the_callers_python_and_numpy_generators_are_untouched_by_a_world():
    import random

    import numpy as np

    random.seed(7)
    np.random.seed(7)
    random.random(), np.random.randn()  # a cached normal is part of the state too
    before = (random.getstate(), np.random.get_state())
    fakepg.spawn(lambda rank: (random.random(), np.random.randn(), np.random.rand()), nprocs=2)
    after = (random.getstate(), np.random.get_state())
    assert after[0] == before[0]
    assert after[1][0] == before[1][0] and (after[1][1] == before[1][1]).all()
    assert after[1][2:] == before[1][2:]
