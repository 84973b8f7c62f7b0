"""Bad input to simddp gets one clear line, never a traceback: usage errors exit 2 naming the
flag and the accepted range, a malformed --parallel spec says what is wrong in it, an option
that does not apply to the layout is refused with the reason, and replay validates a capture
(kind, schema version, finite non-negative numbers) naming the file and the field."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simddp.cli import main
from simddp.program.captured import CaptureFileError, capture_from_dict, load_capture


def _run(capsys, *argv):
    """(exit status, stderr) of ``simddp ARGV`` run in this process."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    captured = capsys.readouterr()
    _run.out = captured.out
    return code, captured.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


W = ("whatif", "mlp", "--no-progress")


@pytest.mark.parametrize("argv,words", [
    ((*W, "--world-size", "2", "--batch-size", "0"), "--batch-size: 0 is out of range: give "
                                                      "an integer from 1 to"),
    ((*W, "--world-size", "2", "--workers", "0"), "--workers: 0 is out of range"),
    ((*W, "--world-size", "4,,8"), "without empty items"),
    ((*W, "--world-size", str(2 ** 40)), "out of range: give an integer from 1 to 16777216"),
    ((*W, "--world-size", "2", "--network", ""), "an empty --network"),
    ((*W, "--world-size", "8", "--parallel", "fsdp:0"), "'fsdp:0': a size is a positive"),
    ((*W, "--world-size", "8", "--parallel", "hsdp"), "hsdp needs its shard size"),
    ((*W, "--world-size", "8", "--parallel", "cp:2"), "context parallelism is replayed with FSDP2"),
    ((*W, "--world-size", "8", "--parallel", "fsdp,fsdp"), "names the data dimension twice"),
    ((*W, "--world-size", "8", "--parallel", ""), "an empty --parallel spec"),
    ((*W, "--world-size", "2", "--stages-per-rank", "0"), "--stages-per-rank: 0 is out of range"),
    ((*W, "--world-size", "2", "--jitter", "5"), "--jitter: 5 is out of range: give a number "
                                                  ">= 0 and <= 1"),
    ((*W, "--world-size", "2", "--gpu-memory", "-1"), "--gpu-memory: -1 is out of range"),
    ((*W, "--world-size", "2", "--step-time", "nan"), "--step-time: nan is out of range"),
    ((*W, "--world-size", "2", "--iterations", "0"), "--iterations: 0 is out of range"),
    ((*W, "--world-size", "2", "--seed", "-1"), "--seed: -1 is out of range"),
    ((*W, "--world-size", "2", "--bucket-cap-mb", "0"), "out of range: give a number > 0"),
    ((*W, "--world-size", "2", "--straggler", "3:0"), "SPEED a number > 0"),
    ((*W, "--world-size", "2", "--param-dtype", "int8"), "'int8': give one of bf16, fp16, fp32"),
    ((*W, "--world-size", "2", "--activation-checkpointing", "selective-layer:0"),
     "selective-layer:N (every N-th block, N >= 1)"),
    ((*W, "--world-size", "2", "--host-cores", "-2"), "--host-cores: -2 is out of range"),
    (("calibrate", "--reps", "0"), "--reps: 0 is out of range"),
    (("calibrate", "--world-size", "0"), "out of range: give an integer from 1 to 64"),
    (("calibrate", "--sizes", "4K,zero"), "'zero' is not a size"),
])
def test_a_bad_value_is_a_usage_error_naming_the_flag_and_the_range(capsys, argv, words):
    code, err = _run(capsys, *argv)
    assert code == 2
    assert words in _one_line(err)


@pytest.mark.parametrize("argv,words", [
    ((*W, "--world-size", "2", "--pp-schedule", "1f1b"), "--pp-schedule applies to pipeline "
                                                          "layouts"),
    ((*W, "--world-size", "2", "--microbatches", "4"), "--microbatches applies to pipeline"),
    ((*W, "--world-size", "2", "--reshard-after-forward", "false"),
     "--reshard-after-forward applies to FSDP2 layouts"),
    ((*W, "--world-size", "2", "--reduce-dtype", "bf16"), "DDP reduces in its comm hook's dtype"),
    ((*W, "--world-size", "2", "--forward-prefetch", "2"), "--forward-prefetch applies to FSDP2"),
    ((*W, "--world-size", "2", "--parallel", "fsdp", "--comm-hook", "fp16"),
     "--comm-hook applies to DDP layouts"),
    ((*W, "--world-size", "2", "--parallel", "fsdp", "--capture-ranks", "2"),
     "--capture-ranks applies to DDP layouts"),
    ((*W, "--world-size", "4", "--parallel", "ddp,tp:2"), "dp:N,tp:T for Megatron-style"),
    ((*W, "--world-size", "2", "--no-sequence-parallel"), "applies to layouts with tensor "
                                                          "parallelism"),
    ((*W, "--world-size", "2", "--async-tp"), "--async-tp applies to layouts with tensor"),
    ((*W, "--world-size", "8", "--parallel", "zero3", "--reshard-after-forward", "false"),
     "zero3 runs FSDP2 with reshard_after_forward=True"),
    (("whatif", "llama3-tiny", "--no-progress", "--parallel", "pp:2", "--param-dtype", "bf16"),
     "--param-dtype applies to pipelines with FSDP2 inside their stages"),
    ((*W, "--world-size", "8", "--parallel", "fsdp:3"), "no world size of [8] fits it (8 "
                                                         "ranks: --parallel 'fsdp:3' lays out 3"),
])
def test_an_option_that_does_not_apply_is_refused_with_the_reason(capsys, argv, words):
    code, err = _run(capsys, *argv)
    assert code == 2
    assert words in _one_line(err)


def test_a_scenario_file_that_defines_no_scenario_object_is_one_line(capsys, tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("scenario = 42\n")
    code, err = _run(capsys, "whatif", str(script), "--world-size", "2", "--no-progress")
    assert code == 1 and "`scenario` is a int (42)" in _one_line(err)
    script.write_text("raise RuntimeError('broken on purpose')\n")
    code, err = _run(capsys, "whatif", str(script), "--world-size", "2", "--no-progress")
    assert code == 1 and "failed: RuntimeError: broken on purpose" in _one_line(err)


def test_calibrate_with_nccl_and_no_gpus_is_one_line(capsys):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    code, err = _run(capsys, "calibrate", "--backend", "nccl")
    assert code == 1 and "--backend nccl needs a GPU per rank" in _one_line(err)


def test_constructors_check_their_ranges():
    from simddp import Network, Timing

    with pytest.raises(ValueError, match="jitter must be a relative standard deviation from 0"):
        Timing(jitter=5)
    with pytest.raises(ValueError, match="network_jitter must be"):
        Timing(network_jitter=2.0)
    with pytest.raises(ValueError, match=r"unknown field\(s\) bogus; the fields are slowdown"):
        Network(50, 5, contention={"bogus": 1})


# -- replay of files that are not captures -----------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from fakepg import zoo
    from simddp import Compute, Timing, capture

    cap = capture(zoo.get("mlp", depth=2), nprocs=2, timing=Timing(compute=Compute.roofline(
        "a100")))
    path = tmp_path_factory.mktemp("cap") / "capture.json"
    cap.save(path)
    return path


def _replay(capsys, path):
    return _run(capsys, "replay", str(path), "--world-size", "4", "--no-progress")


def test_a_saved_capture_names_its_kind_and_schema_and_replays(capsys, saved):
    d = json.loads(saved.read_text())
    assert d["kind"] == "CapturedIteration" and d["schema"] == 1
    code, err = _replay(capsys, saved)
    assert code == 0, err
    assert _run.out.splitlines()[1].split()[0] == "ranks"  # the table's header


@pytest.mark.parametrize("mutate,words", [
    (lambda t: t[: len(t) // 2], "not valid JSON at line"),
    (lambda t: "", "empty, not a capture"),
    (lambda t: json.dumps([{"world_size": 8, "iteration_time_s": 0.1}]), "what-if rows"),
    (lambda t: json.dumps({"traceEvents": []}), "a Chrome trace"),
    (lambda t: json.dumps({"measurements": []}), "a `simddp calibrate --json` file"),
    (lambda t: t.replace('"kind": "CapturedIteration"', '"kind": "CapturedThing"'),
     "field kind is 'CapturedThing'"),
    (lambda t: t.replace('"schema": 1', '"schema": 99'), "written by a newer simddp"),
    (lambda t: t.replace('"world_size": 2', '"world_size": NaN'), "field world_size is nan"),
    (lambda t: t.replace('"bucket_cap_bytes": ', '"bucket_cap_bytes": 1e300, "x": '),
     "field bucket_cap_bytes is 1e+300"),
    (lambda t: t.replace('"iteration": ', '"iteration": -1, "y": '), "field iteration is -1"),
])
def test_replay_names_the_file_and_what_is_wrong_in_it(capsys, saved, tmp_path, mutate, words):
    bad = tmp_path / "bad.json"
    bad.write_text(mutate(saved.read_text()))
    code, err = _replay(capsys, bad)
    line = _one_line(err)
    assert code == 1 and str(bad) in line and words in line, line


def test_replay_of_a_binary_file_and_of_a_missing_one(capsys, tmp_path):
    blob = tmp_path / "model.pt"
    blob.write_bytes(b"PK\x03\x04\x00\x00binary\xff\xfe")
    code, err = _replay(capsys, blob)
    assert code == 1 and "binary data, not a capture" in _one_line(err)
    code, err = _replay(capsys, tmp_path / "nope.json")
    assert code == 1 and "nope.json" in _one_line(err)


def test_replay_refuses_capture_time_flags(capsys, saved):
    code, err = _run(capsys, "replay", str(saved), "--world-size", "4", "--param-dtype", "bf16")
    assert code == 2 and "chosen when capturing" in _one_line(err)


def _numbers(d, path=()):
    """Every (path, number) leaf of a JSON document."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _numbers(v, path + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _numbers(v, path + (i,))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        yield path, d


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bad=st.sampled_from([math.nan, math.inf, -math.inf, -1, -1e-9, 1e300]))
def test_any_number_of_a_capture_out_of_range_is_refused_naming_its_field(saved, data, bad):
    d = json.loads(saved.read_text())
    leaves = [(p, v) for p, v in _numbers(d) if p[0] not in ("logging_data", "schema")]
    path, _ = data.draw(st.sampled_from(leaves))
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = bad
    with pytest.raises(CaptureFileError) as e:
        capture_from_dict(d)
    field = ".".join(str(k) if isinstance(k, str) else f"[{k}]" for k in path)
    assert field.replace(".[", "[") in str(e.value)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_whatever_the_bytes_loading_them_as_a_capture_fails_cleanly(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("raw") / "x.json"
    path.write_bytes(raw)
    with pytest.raises(CaptureFileError, match=str(path).replace("\\", "\\\\")):
        load_capture(path)


def test_compile_and_float8_are_priced_by_the_default_model_and_refused_by_one_that_cannot():
    from simddp import Compute
    from simddp.program.parallel import UsageError
    from simddp.whatif import whatif

    plain = whatif("mlp", world_size=2, gpu="h100")
    fused = whatif("mlp", world_size=2, gpu="h100", compile=True)
    assert fused[0]["compile"] is True
    assert fused[0]["iteration_time_s"] < plain[0]["iteration_time_s"]  # fewer launches, less traffic
    with pytest.raises(UsageError, match="does not model torch.compile yet"):
        whatif("mlp", world_size=2, compute=Compute.constant(1e-5), compile=True)
