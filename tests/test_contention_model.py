"""simddp.models.Contention: a rank's compute slowed while its own collectives run, and a fixed
compute-stream cost per issued collective — applied by replay, carried by the network model,
read from a `simddp calibrate --json` file."""

import dataclasses
import json

import pytest

from simddp import Contention, MeasuredNetwork, Network
from simddp.program.captured import CapturedIteration, ParamInfo, RankProfile
from simddp.replay import replay

MS = 1e-3
# one 4000-byte bucket on 2 ranks: a ring all_reduce costs 2·α (+ 4 kB at 1e18 B/s ≈ 0)
NET = Network(bandwidth_GBps=1e9, latency_us=500.0)  # 1 ms per all_reduce of 2 ranks


def one_bucket(ready_ms: float = 2.0, backward_ms: float = 4.0, forward_ms: float = 1.0,
               optimizer_ms: float = 0.0, forward_collectives=()) -> CapturedIteration:
    """A hand-made capture: forward, then backward in which the only bucket (one 1000-element
    parameter) is ready ``ready_ms`` after backward starts."""
    return CapturedIteration(
        name="hand", world_size=2, iteration=0,
        params=[ParamInfo(0, "w", [1000], "float32")], ready_order=[0],
        bucket_cap_bytes=25 << 20, first_bucket_bytes=25 << 20, find_unused_parameters=False,
        static_graph=False, gradient_as_bucket_view=False, bucket_indices=[[0]],
        bucket_bytes=[4000],
        profiles=[RankProfile(forward=forward_ms * MS, ready=[ready_ms * MS],
                              backward=backward_ms * MS, optimizer=optimizer_ms * MS,
                              forward_collectives=list(forward_collectives))])


def run(cap, contention=None, **kw):
    return replay(cap, network=NET.with_(contention=contention), progress=False, **kw)


def test_without_contention_the_bucket_all_reduce_hides_behind_backward():
    res = run(one_bucket())
    # forward 1, bucket issued at 1 + 2 = 3, all_reduce 3 → 4, backward ends at 1 + 4 = 5
    (c,) = res.collectives
    assert (c["start"], c["end"]) == pytest.approx((3 * MS, 4 * MS), rel=1e-9)
    assert res.iteration_time == pytest.approx(5 * MS, rel=1e-9)


def test_an_inactive_contention_changes_nothing_bitwise():
    cap = one_bucket()
    base = run(cap)
    for inactive in (Contention(), Contention(slowdown=1.0, per_collective_us=0.0)):
        res = run(cap, inactive)
        assert res.iteration_time == base.iteration_time
        assert res.collectives == base.collectives
        assert res.timeline.exposed_comm() == base.timeline.exposed_comm()


def test_compute_overlapping_the_ranks_all_reduce_runs_at_one_over_slowdown_of_its_rate():
    res = run(one_bucket(), Contention(slowdown=2.0))
    # backward's last 2 ms of work: 1 ms beside the all_reduce (3 → 4) does 0.5 ms of work,
    # the other 1.5 ms run alone: backward ends at 4 + 1.5 = 5.5 ms (not 5)
    assert res.collectives[0]["end"] == pytest.approx(4 * MS, rel=1e-9)
    assert res.iteration_time == pytest.approx(5.5 * MS, rel=1e-9)
    # the exposed communication a user would measure, T(DDP) − T(no communication), grows by
    # the 0.5 ms the overlap cost: 0.5 ms where the contention-free model said 0
    compute_only = replay(one_bucket(), network=Network(bandwidth_GBps=1e9, latency_us=0.0),
                          progress=False)
    assert res.iteration_time - compute_only.iteration_time == pytest.approx(0.5 * MS, rel=1e-6)


def test_a_collective_that_outlasts_backward_slows_all_of_the_rest_of_it():
    slow = Network(bandwidth_GBps=1e9, latency_us=1500.0)  # 3 ms all_reduce: 3 → 6
    res = replay(one_bucket(), network=slow.with_(contention=Contention(slowdown=2.0)),
                 progress=False)
    # 2 ms of work at half rate take 4 ms, but the all_reduce ends at 6: 3 → 6 does 1.5 ms,
    # the last 0.5 ms alone: 6.5 ms
    assert res.iteration_time == pytest.approx(6.5 * MS, rel=1e-9)


def test_compute_waits_for_nothing_a_collective_that_has_not_started_does_not_slow_it():
    # rank 1 is 4x slower, so the all_reduce starts when rank 1 issues it (1·4 + 2·4 = 12 ms);
    # rank 0's backward (3 → 5 ms) never overlaps it and is not slowed
    res = run(one_bucket(), Contention(slowdown=3.0), rank_speed={1: 0.25}, per_rank=True)
    spans = res.timeline.rank_spans(0, ["backward"])
    assert spans[-1].end == pytest.approx(5 * MS, rel=1e-9)
    assert res.collectives[0]["start"] == pytest.approx(12 * MS, rel=1e-9)


def test_the_fixed_cost_per_collective_delays_the_issue_and_the_rest_of_backward():
    res = run(one_bucket(), Contention(per_collective_us=100.0))
    (c,) = res.collectives
    # issued at 3 + 0.1 ms, so it runs 3.1 → 4.1; backward ends 0.1 ms later: 5.1 ms
    assert (c["start"], c["end"]) == pytest.approx((3.1 * MS, 4.1 * MS), rel=1e-9)
    assert res.iteration_time == pytest.approx(5.1 * MS, rel=1e-9)


def test_both_together_add_up_as_computed_by_hand():
    res = run(one_bucket(), Contention(slowdown=2.0, per_collective_us=100.0))
    # issue 3.1, all_reduce 3.1 → 4.1 does 0.5 ms of backward's remaining 2, then 1.5 alone
    assert res.iteration_time == pytest.approx(5.6 * MS, rel=1e-9)


def test_a_forward_collective_pays_the_issue_cost_and_slows_the_forward_after_it():
    fwd = [{"offset": 0.5 * MS, "op": "broadcast", "bytes": 4000, "wait_at": None}]
    cap = one_bucket(forward_collectives=fwd, ready_ms=4.0)  # bucket at the end of backward
    base = run(cap)
    res = run(cap, Contention(slowdown=2.0, per_collective_us=200.0))
    b0 = next(c for c in base.collectives if "fwd" in c["name"])
    b1 = next(c for c in res.collectives if "fwd" in c["name"])
    assert b1["start"] - b0["start"] == pytest.approx(0.2 * MS, rel=1e-9)
    # issue cost 0.5 → 0.7 ms; a broadcast of 2 ranks is one step, α = 0.5 ms: 0.7 → 1.2 ms;
    # the forward's last 0.5 ms of work: 0.25 beside it (0.7 → 1.2), 0.25 alone: ends at 1.45
    fwd_end = max(s.end for s in res.timeline.rank_spans(0, ["forward"]))
    assert fwd_end == pytest.approx(1.45 * MS, rel=1e-9)


def test_many_buckets_cost_more_than_few_when_each_collective_has_a_fixed_cost(tmp_path):
    from fakepg import zoo
    from simddp import Compute, Timing
    from simddp import capture

    net = Network.preset("dgx1-v100")
    cap = capture(zoo.get("mlp", depth=6, width=256), 2,
                  timing=Timing(network=net, compute=Compute.roofline("v100")))
    # the preset's own V100 contention (on by default) off: only the cost below differs
    plain = {mb: replay(cap, network=net, bucket_cap_mb=mb, progress=False,
                        gpu_contention="off").iteration_time for mb in (0.05, 25)}
    costly = net.with_(contention=Contention(per_collective_us=50.0))
    with_cost = {mb: replay(cap, network=costly, bucket_cap_mb=mb, progress=False)
                 for mb in (0.05, 25)}
    n_small = len(with_cost[0.05].buckets)
    assert n_small > len(with_cost[25].buckets) == 1
    # 1 bucket: +50 µs; n buckets: +n·50 µs on the critical path (all issued in backward)
    assert with_cost[25].iteration_time - plain[25] == pytest.approx(50e-6, rel=1e-6)
    assert with_cost[0.05].iteration_time - plain[0.05] >= (n_small - 1) * 50e-6


def test_contention_is_a_network_field_that_survives_a_capture_round_trip():
    net = NET.with_(contention=Contention(slowdown=1.5, per_collective_us=8.4, source="test"))
    again = Network(**dataclasses.asdict(net))  # how a capture stores and restores it
    assert again == net and again.contention.slowdown == 1.5
    assert net.describe()["contention_slowdown"] == 1.5
    assert net.describe()["per_collective_us"] == 8.4
    assert "contention_slowdown" not in NET.describe()  # no column when there is none


def test_a_calibrate_file_carries_its_contention_into_replay(tmp_path):
    rows = [{"op": "all_reduce", "world_size": 2, "bytes": b, "seconds": s}
            for b, s in [(4000, 1 * MS), (1 << 20, 2 * MS)]]
    cont = {"slowdown": 2.0, "per_collective_us": 100.0, "source": "simddp calibrate",
            "measurements": [{"world_size": 2, "slowdown": 2.0}]}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"measurements": rows, "alpha_beta": {}, "contention": cont}))
    net = Network.from_measurements(path)
    assert net.contention == Contention(slowdown=2.0, per_collective_us=100.0,
                                        source="simddp calibrate")
    assert MeasuredNetwork.load(path, contention=None).contention is None  # explicit override
    # a 4000-byte all_reduce on this table: 1 ms as measured; so the hand-computed 5.6 ms again
    res = replay(one_bucket(), network=net, progress=False)
    assert res.iteration_time == pytest.approx(5.6 * MS, rel=1e-9)
    assert res.knobs["contention_slowdown"] == 2.0


@pytest.mark.parametrize("kw, message", [
    ({"slowdown": 0.5}, "Contention.slowdown"),
    ({"per_collective_us": -1.0}, "Contention.per_collective_us"),
])
def test_bad_contention_figures_are_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        Contention(**kw)
    with pytest.raises(TypeError, match="contention"):
        Network(bandwidth_GBps=1.0, latency_us=1.0, contention=2.0)


def test_the_gpu_form_is_the_sm_share_nccl_leaves_to_compute():
    assert Contention.sm_share(80, 8).slowdown == pytest.approx(80 / 72)
    with pytest.raises(ValueError, match="channels"):
        Contention.sm_share(80, 80)


@pytest.mark.gloo
def test_calibrate_measures_gloo_contention_and_stores_it_for_whatif(tmp_path):
    from simddp.cli import main

    path = tmp_path / "cal.json"
    assert main(["calibrate", "--world-size", "2", "--sizes", "4K,1M", "--reps", "2",
                 "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    (m,) = doc["contention"]["measurements"]
    assert m["world_size"] == 2 and m["overlapped_kernels"] > 0
    assert doc["contention"]["slowdown"] >= 1.0 and doc["contention"]["per_collective_us"] > 0
    net = Network.from_measurements(path)
    assert net.contention.slowdown == doc["contention"]["slowdown"]


def test_whatif_contention_option_sets_it_for_every_network_or_drops_a_files(tmp_path, capsys):
    from simddp.cli import main

    rows = [{"op": "all_reduce", "world_size": 2, "bytes": b, "seconds": s}
            for b, s in [(4000, 1 * MS), (1 << 20, 2 * MS)]]
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"measurements": rows, "contention": {"slowdown": 2.0}}))
    out = tmp_path / "rows.json"
    assert main(["whatif", "mlp", "--world-size", "2", "--network", f"100gbe,{cal}",
                 "--contention", "1.5:20", "--no-progress", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [(r["contention_slowdown"], r["per_collective_us"]) for r in got] == [(1.5, 20.0)] * 2
    assert main(["whatif", "mlp", "--world-size", "2", "--network", str(cal),
                 "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["contention_slowdown"] == 2.0  # the file's own
    assert main(["whatif", "mlp", "--world-size", "2", "--network", str(cal),
                 "--contention", "off", "--no-progress", "--json", str(out)]) == 0
    assert "contention_slowdown" not in json.loads(out.read_text())[0]
    with pytest.raises(SystemExit):
        main(["whatif", "mlp", "--world-size", "2", "--contention", "fast"])
    assert "SLOWDOWN[:US]" in capsys.readouterr().err
