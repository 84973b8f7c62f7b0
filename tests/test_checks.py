"""One checker interface: a backend's refusals and NCCL's and gloo's hazards are checkers that
the world calls through one list, never by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg.fidelity.backends import Refusals
from fakepg.fidelity.gloo_checks import ArgumentChecks
from fakepg.fidelity.gloo_hazards import GlooHazards
from fakepg.fidelity.nccl_hazards import NcclHazards
from fakepg.world.binding import current_cluster
from fakepg.world.checks import Checker, Checkers


class Recorder(Checker):
    def __init__(self, name: str, log: list, *, holds: bool = False, refuses: bool = False):
        self.name, self.log, self._holds, self._refuses = name, log, holds, refuses

    def calling(self, pg, method, args, kwargs):
        self.log.append((self.name, "calling", method, len(args)))

    def issuing(self, call):
        self.log.append((self.name, "issuing"))
        if self._refuses:
            raise ValueError(f"{self.name} refuses")

    def holds(self, call):
        self.log.append((self.name, "holds"))
        return self._holds

    def released(self, coll):
        return [f"{self.name}'s held call"]

    def call_of(self, future, rank):
        return f"{self.name}'s call" if self._holds else None

    def hang_notes(self):
        return [f"{self.name}: a note"]


def test_a_checker_overrides_only_the_hooks_it_needs() -> None:
    quiet = Checker()
    call = SimpleNamespace()
    assert quiet.issuing(call) is None and quiet.issued(call) is None and quiet.waited(call) is None
    assert quiet.calling(object(), "allreduce", (), {}) is None
    assert (quiet.holds(call), list(quiet.released(call)), quiet.call_of(object(), 0),
            quiet.hang_notes()) == (False, [], None, [])


def test_the_list_calls_every_checker_in_order_and_the_first_refusal_wins() -> None:
    log: list = []
    checks = Checkers([Recorder("a", log), Recorder("b", log, refuses=True), Recorder("c", log)])
    with pytest.raises(ValueError, match="b refuses"):
        checks.issuing(SimpleNamespace())
    assert log == [("a", "issuing"), ("b", "issuing")]


def test_every_checker_sees_a_call_to_hold_even_after_one_holds_it() -> None:
    # a checker that holds nothing now may hold the next call behind this one (NCCL's streams)
    log: list = []
    checks = Checkers([Recorder("a", log, holds=True), Recorder("b", log)])
    assert checks.holds(SimpleNamespace()) is True
    assert log == [("a", "holds"), ("b", "holds")]
    assert list(checks.released(SimpleNamespace())) == ["a's held call", "b's held call"]
    assert checks.call_of(object(), 0) == "a's call"
    assert checks.hang_notes() == ["a: a note", "b: a note"]


def test_a_world_of_something_else_than_checkers_is_refused_with_what_it_takes() -> None:
    with pytest.raises(TypeError, match="must be fakepg.world.checks.Checker instances, got function"):
        Checkers([lambda call: None])


def test_only_the_checkers_that_look_at_a_methods_arguments_are_called_with_them() -> None:
    log: list = []
    checks = Checkers([Checker(), Recorder("a", log)])
    checks.calling(object(), "allreduce", ([torch.ones(1)],), {})
    assert [type(c) for c in checks.calls_checked] == [Recorder]
    assert log == [("a", "calling", "allreduce", 1)]


def test_spawn_runs_argument_checks_devices_check_refusals_and_gloo_hazard_in_that_order() -> None:
    def kinds(rank: int) -> list[str]:
        return [type(c).__name__ for c in current_cluster()[0].checkers.all]

    assert fakepg.spawn(kinds, nprocs=1).returns == [
        [ArgumentChecks.__name__, NcclHazards.__name__, Refusals.__name__, GlooHazards.__name__]]


def test_a_process_group_method_without_tensors_is_refused_by_the_argument_checker() -> None:
    def empty_allreduce(rank: int) -> None:
        dist.distributed_c10d._get_default_group().allreduce([])

    with pytest.raises(fakepg.RankFailedError) as err:
        fakepg.spawn(empty_allreduce, nprocs=2)
    assert "There were no tensor arguments to this function" in str(err.value.__cause__)


def test_a_refusal_reaches_the_program_through_the_checkers() -> None:
    def premul_sum_on_gloo(rank: int) -> None:
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))

    with pytest.raises(fakepg.RankFailedError) as err:
        fakepg.spawn(premul_sum_on_gloo, nprocs=2, backend="gloo")
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in str(err.value.__cause__)
