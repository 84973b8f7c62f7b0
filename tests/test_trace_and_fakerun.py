"""The collective trace (JSON, Flight Recorder) and the fakerun launcher."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import fakepg


def _body(rank):
    t = torch.ones(4, dtype=torch.float16)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.broadcast(torch.zeros(2, 3), src=1)
    out = torch.zeros(2 * 3)
    dist.all_gather_into_tensor(out, torch.ones(3))
    if rank == 0:
        dist.send(torch.ones(5), dst=1)
    else:
        dist.recv(torch.zeros(5), src=0)


def test_trace_records_op_group_seq_shapes_dtypes_bytes_and_user_line():
    trace = fakepg.spawn(_body, nprocs=2).trace
    ar, bc, ag, p2p = trace[0]
    assert (ar.op, ar.seq, ar.shapes, ar.dtypes, ar.bytes, ar.reduce_op) == (
        "all_reduce", 0, ((4,),), ("float16",), 8, "MAX")
    assert (bc.op, bc.seq, bc.root, bc.shapes) == ("broadcast", 1, 1, ((2, 3),))
    assert (ag.op, ag.seq, ag.bytes) == ("all_gather_into_tensor", 2, 2 * 3 * 4)
    assert (p2p.op, p2p.peer, p2p.p2p) == ("send", 1, True)
    assert trace[1][3].op == "recv" and trace[1][3].peer == 0
    assert ar.site == f"tests/test_trace_and_fakerun.py:{_body.__code__.co_firstlineno + 2}"
    assert all(r.state == "completed" for recs in trace for r in recs)
    assert ar.group == trace[1][0].group and ar.group_ranks == (0, 1)


def test_trace_json_round_trips_and_is_identical_across_runs():
    a, b = fakepg.spawn(_body, nprocs=2), fakepg.spawn(_body, nprocs=2)
    assert a.to_json() == b.to_json()
    assert fakepg.from_json(a.to_json()) == a.trace


def test_flight_recorder_dumps_are_read_by_torchs_own_analyser(tmp_path):
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    result = fakepg.spawn(_body, nprocs=2)
    paths = result.dump_flight_recorder(tmp_path)
    dump = pickle.load(open(paths[0], "rb"))
    assert dump["entries"][0]["profiling_name"] == "gloo:all_reduce"
    assert dump["entries"][0]["input_sizes"] == [[4]]
    args = JobConfig().parse_args([str(tmp_path), "--prefix", "rank"])
    details, version = read_dir(args)
    db = build_db(details, args, version)
    assert len(db.collectives) >= 3  # the analyser matched the collectives across ranks


def test_fakerun_runs_an_unmodified_torchrun_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        assert int(os.environ["LOCAL_RANK"]) == rank
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 2))
        model(torch.randn(4, 8)).sum().backward()
        w = model.module.weight.detach().clone()
        ws = [torch.zeros_like(w) for _ in range(world)]
        dist.all_gather(ws, w)
        assert all(torch.equal(w, x) for x in ws)
        print(f"ok rank {rank} of {world}", flush=True)
        dist.destroy_process_group()
    """))
    proc = subprocess.run([sys.executable, "-m", "fakepg.launch.fakerun", "--standalone", "--nnodes", "1",
                           "--nproc-per-node", "3", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"[rank{r}]:ok rank {r} of 3" for r in range(3)]


def test_fakerun_exits_nonzero_with_the_hang_report_on_stderr(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group()
        if int(os.environ["RANK"]) == 0:
            dist.all_reduce(torch.ones(1))
    """))
    proc = subprocess.run([sys.executable, "-m", "fakepg.launch.fakerun", "--nproc_per_node=2", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "CollectiveHangError" in proc.stderr and "hang.py:5" in proc.stderr


def test_fakerun_runs_modules_with_dash_m_and_passes_script_args(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(textwrap.dedent("""
        import sys, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            print("args", sys.argv[1:], flush=True)
    """))
    proc = subprocess.run([sys.executable, "-m", "fakepg.launch.fakerun", "--nproc-per-node", "2", "-m",
                           "mypkg.job", "--lr", "0.1"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "args ['--lr', '0.1']" in proc.stdout


def test_fakerun_refuses_several_nodes_with_advice():
    from fakepg.launch.fakerun import main

    assert main(["--nnodes", "2", "--nproc-per-node", "2", "x.py"]) == 2


def test_flight_recorder_frames_name_the_library_line_then_the_users_line():
    rec = fakepg.CollectiveRecord(rank=0, group="0", group_ranks=(0, 1), seq=0, op="all_reduce",
                                  shapes=((4,),), dtypes=("float32",), bytes=16,
                                  site="train.py:12 (via lightning/fabric/ddp.py:88)")
    frames = fakepg.flight_recorder_dump([rec], 0)["entries"][0]["frames"]
    assert [(f["filename"], f["line"]) for f in frames] == [("lightning/fabric/ddp.py", 88),
                                                            ("train.py", 12)]
    rec.site = "train.py:7"
    frames = fakepg.flight_recorder_dump([rec], 0)["entries"][0]["frames"]
    assert [(f["filename"], f["line"]) for f in frames] == [("train.py", 7)]
