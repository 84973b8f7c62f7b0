"""Profilers inside a fake world: each rank gets its own session, with its own ops only.

Overlapping Kineto sessions used to kill the process with SIGSEGV, which would take the
pytest worker down with it; so the scenarios run in one child process and the tests read
what it reports.
"""

import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fakepg.world.events import collective_event

SCENARIOS = textwrap.dedent(r'''
    import json, os, sys, tempfile
    import torch, torch.distributed as dist
    import fakepg
    from torch.nn.parallel import DistributedDataParallel as DDP
    out, tmp = {}, sys.argv[1]

    def autograd_profile(rank):
        t = torch.ones(4)
        with torch.autograd.profiler.profile(record_shapes=True) as p:
            dist.all_reduce(t)
            (t * 2).sum() if rank == 0 else (t + 1).sum()
        return [[e.name, e.input_shapes] for e in p.function_events]
    out["autograd"] = fakepg.spawn(autograd_profile, nprocs=2).returns
    out["autograd_again"] = fakepg.spawn(autograd_profile, nprocs=2).returns

    def scheduled_ddp(rank):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 8))
        traces = []
        def ready(prof):
            path = os.path.join(tmp, f"rank{rank}-{prof.step_num}.json")
            prof.export_chrome_trace(path)
            traces.append(path)
        sched = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
        with torch.profiler.profile(schedule=sched, on_trace_ready=ready, record_shapes=True) as prof:
            for _ in range(5):
                with torch.profiler.record_function("train_step"):
                    model(torch.randn(4, 8)).sum().backward()
                prof.step()
        names = sorted({e.key for e in prof.key_averages()})
        return {"names": names, "traces": traces}
    out["scheduled"] = fakepg.spawn(scheduled_ddp, nprocs=2).returns

    def for_compute(rank):
        a = torch.randn(16, 16)
        with torch.profiler.profile() as prof:
            dist.all_reduce(a)
            a @ a
        from simddp import Compute
        model = Compute.from_profile(prof)
        return model.op_time(torch.ops.aten.mm.default, (a, a), {}, a @ a) > 0
    out["compute"] = fakepg.spawn(for_compute, nprocs=2).returns

    def raises_inside(rank):
        with torch.profiler.profile():
            dist.barrier()
            if rank == 1:
                raise ValueError("boom")
            dist.barrier()
    try:
        fakepg.spawn(raises_inside, nprocs=2)
    except fakepg.RankFailedError as e:
        out["raised"] = type(e.__cause__).__name__
    out["enabled_after_failure"] = [torch.autograd._profiler_enabled(),
                                    torch.autograd.profiler._is_profiler_enabled]
    out["after_failure"] = fakepg.spawn(autograd_profile, nprocs=2).returns

    # The host's own profiler, outside any world, is torch's Kineto one, unchanged.
    with torch.profiler.profile() as host:
        torch.ones(3).sum()
    host.export_chrome_trace(os.path.join(tmp, "host.json"))
    out["host"] = sorted({e.key for e in host.key_averages()})
    out["host_result_type"] = type(host.profiler.kineto_results).__name__
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiles")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", SCENARIOS, str(tmp)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), tmp


def _names(events):
    return {name for name, _ in events}


def test_two_ranks_profiling_around_a_collective_do_not_crash(run):
    out, _ = run
    assert len(out["autograd"]) == 2 and all(out["autograd"])


def test_each_rank_profile_holds_its_own_ops_only(run):
    out, _ = run
    rank0, rank1 = (_names(r) for r in out["autograd"])
    assert "aten::mul" in rank0 and "aten::mul" not in rank1
    assert "aten::add" in rank1 and "aten::add" not in rank0


def test_a_collective_appears_as_the_backend_names_it_with_its_input_shapes(run):
    out, _ = run
    for events in out["autograd"]:
        assert ["gloo:all_reduce", [[4]]] in events


def test_the_emulated_networks_data_movement_is_in_no_ranks_profile(run):
    out, _ = run
    # all_reduce's reduction runs on whichever rank completes it; only the user's ops count
    for events in out["autograd"]:
        assert len([n for n, _ in events if n == "aten::add_"]) == 0


def test_a_second_world_profiles_the_same_way(run):
    out, _ = run
    assert [_names(r) for r in out["autograd_again"]] == [_names(r) for r in out["autograd"]]


def test_schedule_and_step_with_ddp_backward_give_each_rank_key_averages(run):
    out, _ = run
    for rank in out["scheduled"]:
        assert "train_step" in rank["names"]
        assert "gloo:all_reduce" in rank["names"]  # the Reducer's bucket, from backward
        assert any(n.startswith("ProfilerStep") for n in rank["names"]), rank["names"]


def test_exported_chrome_traces_are_json_with_the_ranks_events(run):
    out, _ = run
    for rank, result in enumerate(out["scheduled"]):
        assert len(result["traces"]) == 1
        doc = json.loads(Path(result["traces"][0]).read_text())
        names = {e["name"] for e in doc["traceEvents"]}
        assert "train_step" in names and "gloo:all_reduce" in names
        labels = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
        assert labels == [f"fakepg rank {rank}"]
        assert doc["distributedInfo"]["rank"] == rank


def test_simddp_compute_model_reads_a_ranks_profile(run):
    out, _ = run
    assert out["compute"] == [True, True]


def test_a_rank_raising_inside_a_profiler_leaves_profiling_off_and_the_next_world_works(run):
    out, _ = run
    assert out["raised"] == "ValueError"
    assert out["enabled_after_failure"] == [False, False]
    assert [_names(r) for r in out["after_failure"]] == [_names(r) for r in out["autograd"]]


def test_the_profiler_outside_a_world_is_torchs_own(run):
    out, tmp = run
    assert "aten::sum" in out["host"]
    assert out["host_result_type"] == "_ProfilerResult"
    assert json.loads((tmp / "host.json").read_text())["traceEvents"]


def test_a_collective_event_costs_nothing_when_no_profiler_records():
    assert isinstance(collective_event("all_reduce", [torch.ones(1)]), contextlib.nullcontext)
