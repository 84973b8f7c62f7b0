"""The planner contract: every planner's program is a Program the engines run without asking
what it has (simddp.program.contract), and check_planner tells a broken planner what it broke."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fakepg import zoo
from simddp import Compute, Network, Timing, capture
from simddp.cosim.capture_fsdp import capture_fsdp
from simddp.program import Knobs, plan_ddp, plan_fsdp, plan_pipeline
from simddp.program.contract import Program
from simddp.program.pipeline import uniform_pipeline
from simddp.program.steps import Compute as ComputeStep, Wait
from simddp.replay import PlannerContractError, check_planner, replay

NET = Network.preset("ib-ndr", gpus_per_node=8)
TIMING = Timing(network=NET, compute=Compute.roofline("a100"))


@pytest.fixture(scope="module")
def ddp_cap():
    return capture(zoo.get("mlp"), nprocs=2, timing=TIMING)


@pytest.fixture(scope="module")
def fsdp_cap():
    sc = zoo.get("transformer_block")
    return capture_fsdp(sc.with_(optimizer=lambda p: torch.optim.Adam(p)), 2, timing=TIMING)


def test_the_ddp_planner_keeps_the_contract_with_its_knobs(ddp_cap):
    for knobs in (Knobs(), Knobs(bucket_cap_mb=1, comm_hook="fp16"), Knobs(uneven={1: 1}),
                  Knobs(localsgd_period=2, iterations=2)):
        prog = check_planner(plan_ddp, ddp_cap, knobs.checked(16, NET))
        assert isinstance(prog, Program) and prog.communication_buckets()[0]


def test_the_fsdp_planner_keeps_the_contract_and_has_no_buckets(fsdp_cap):
    prog = check_planner(plan_fsdp, fsdp_cap, Knobs(parallel="fsdp").checked(64, NET))
    assert prog.communication_buckets() == ([], []) and prog.bubble_fractions(None) is None


def test_the_pipeline_planner_keeps_the_contract():
    cap = uniform_pipeline(4, 8, 1e-3, 2e-3)
    prog = check_planner(plan_pipeline, cap, Knobs().checked(4, NET))
    assert prog.knob_values()["microbatches"] == 8


def test_a_planner_returning_something_else_is_told_to_subclass_program(ddp_cap):
    class Loose:  # the old duck-typed shape: engines would have probed it with hasattr
        nprofiles = iterations = 1

    with pytest.raises(PlannerContractError, match="Program subclass"):
        check_planner(lambda cap, checked: Loose(), ddp_cap, Knobs().checked(4, NET))


def test_a_wait_for_a_collective_never_issued_names_the_rank_and_tag(ddp_cap):
    def planner(cap, checked):
        prog = plan_ddp(cap, checked)

        class Broken(type(prog)):
            def iteration(self, rank, it):
                return (*super().iteration(rank, it), Wait(("nowhere",), "wait: nothing"))

        prog.__class__ = Broken
        return prog

    with pytest.raises(PlannerContractError, match=r"rank 0, iteration 0: waits for \[\('nowhere',\)\]"):
        check_planner(planner, ddp_cap, Knobs().checked(4, NET), replay=False)


def test_a_duration_per_profile_is_required(ddp_cap):
    def planner(cap, checked):
        prog = plan_ddp(cap, checked)

        class Short(type(prog)):
            def iteration(self, rank, it):
                return (ComputeStep("forward", ()), *super().iteration(rank, it))

        prog.__class__ = Short
        return prog

    with pytest.raises(PlannerContractError, match="0 durations, nprofiles is 2"):
        check_planner(planner, ddp_cap, Knobs().checked(4, NET), replay=False)


def test_an_fsdp_capture_of_the_ddp_capture_function_is_refused_with_what_fits():
    cap = capture(zoo.get("mlp"), nprocs=2, timing=TIMING, parallel="fsdp")
    with pytest.raises(ValueError, match="capture_fsdp"):
        replay(cap, 8, network=NET, progress=False)


def test_programs_declare_every_member_the_engines_read():
    # replaying.py and both engines read these and nothing else of a program
    read = {"nprofiles", "iterations", "mesh", "param_bytes", "parallel", "iteration",
            "epilogue", "uniform", "memory", "rank_kinds", "knob_values", "bubble_fractions",
            "communication_buckets"}
    declared = {n for n in dir(Program) if not n.startswith("_")} | set(Program.__annotations__)
    assert read <= declared
    assert not dataclasses.is_dataclass(Program)
