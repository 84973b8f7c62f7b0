"""simddp: the timeline's exports, reproducibility, and the public API (DESIGN, simddp 6, 8)."""

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fakepg
import simddp
from simddp import Compute, Network, Timing


def train(rank, iters=3):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]), bucket_cap_mb=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128)
    for _ in range(iters):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


TIMING = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("cpu"),
                rank_speed={1: 0.5}, jitter=0.05)


@pytest.fixture(scope="module")
def result():
    return simddp.simulate(train, nprocs=3, timing=TIMING, seed=1)


def test_chrome_trace_is_valid_json_with_one_process_per_rank_and_complete_events(result, tmp_path):
    path = tmp_path / "trace.json"
    result.timeline.to_chrome_trace(path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(e["ts"] >= 0 and e["dur"] >= 0 for e in complete)
    assert {e["cat"] for e in complete} >= {"forward", "backward", "optimizer", "wait", "comm"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    comm = [e for e in complete if e["cat"] == "comm"]
    assert all(threads[e["pid"], e["tid"]].startswith("comm") for e in comm)
    assert all(threads[e["pid"], e["tid"]] == "compute" for e in complete if e["cat"] == "backward")
    buckets = [e for e in comm if e["pid"] == 0 and e["args"]["in_backward"]]
    assert len(buckets) >= 2 * 3  # several buckets per iteration, each its own span
    last = max(e["ts"] + e["dur"] for e in complete)
    assert last == pytest.approx(result.timeline.makespan * 1e6)


def test_plot_writes_a_real_png(result, tmp_path):
    path = result.timeline.plot(tmp_path / "timeline.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


def test_summary_is_a_table_of_iteration_time_exposed_comm_and_overlap(result, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # a piped CI log: 80 columns
    text = result.timeline.summary()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert max(len(line) for line in result.timeline.summary(width=100).splitlines()) > 80
    assert "time ms" in text and "exposed ms" in text and "overlap" in text
    first = f"{result.timeline.iteration_times()[0] * 1e3:.3f}"
    assert first in text
    csv = result.timeline.to_csv()
    assert csv.splitlines()[0].startswith("iteration,rank,start,end,duration")
    assert len(csv.splitlines()) == 1 + 3 * 3


def test_timelines_are_identical_across_reruns_with_the_same_seed_and_differ_with_another_jitter_seed(result):
    again = simddp.simulate(train, nprocs=3, timing=TIMING, seed=1)
    assert again.timeline.to_chrome_trace() == result.timeline.to_chrome_trace()
    assert again.to_json() == result.to_json()
    other = simddp.simulate(train, nprocs=3, timing=dataclasses.replace(TIMING, seed=2), seed=1)
    assert other.timeline.iteration_times() != result.timeline.iteration_times()
    assert [[(r.op, r.bytes) for r in rs] for rs in other.trace] == \
        [[(r.op, r.bytes) for r in rs] for rs in result.trace]  # only the times moved
    no_jitter = simddp.simulate(train, nprocs=3, timing=dataclasses.replace(TIMING, jitter=0.0), seed=1)
    assert no_jitter.timeline.iteration_times() != result.timeline.iteration_times()


def test_trace_records_carry_virtual_issue_start_and_end(result):
    for rank, recs in enumerate(result.trace):
        assert recs
        for r in recs:
            assert 0.0 <= r.issue <= r.start <= r.end <= result.timeline.end_times[rank]
    doc = json.loads(result.to_json())
    assert doc["ranks"][0][0]["end"] == result.trace[0][0].end


def test_the_public_api():
    for name in ("simulate", "SimResult", "Timing", "Network", "Compute", "Timeline",
                 "CollectiveRaceError", "CollectiveTimeoutError"):
        assert hasattr(simddp, name) and name in simddp.__all__
    assert "simulate(" in simddp.__doc__
    assert issubclass(simddp.CollectiveRaceError, fakepg.FakePGError)
    assert issubclass(simddp.CollectiveTimeoutError, fakepg.CollectiveTimeoutError)
    t = Timing(network=Network.preset("ib-hdr"), compute=Compute.constant(0), rank_speed={3: 0.5},
               jitter=0.1, timeout=5)
    assert dataclasses.is_dataclass(t) and t.speed(3) == 0.5 and t.speed(0) == 1.0
    with pytest.raises(ValueError, match="rank_speed"):
        Timing(rank_speed={0: 0})
    with pytest.raises(ValueError, match="jitter"):
        Timing(jitter=-1)
    with pytest.raises(TypeError, match="Timing"):
        simddp.simulate(train, nprocs=2, timing=None)
    with pytest.raises(RuntimeError, match="inside a rank"):
        simddp.now()
