"""DDP replay gives, bit for bit, the figures it gave before the step program: every zoo
scenario's capture under every replay knob, on both engines (reference:
``tests/data/ddp_replay_golden.json``, written by ``tests/ddp_golden.py``)."""

import json

import pytest

import ddp_golden as golden
from simddp.replay import CapturedIteration, replay

with open(golden.PATH) as _f:
    DATA = json.load(_f)

CASES = sorted(DATA["results"])


@pytest.fixture(scope="module")
def captures():
    return {n: CapturedIteration.from_dict(d) for n, d in DATA["captures"].items()}


@pytest.mark.parametrize("case", CASES)
def test_ddp_replay_is_bitwise_what_it_was(captures, case):
    name, cid, engine = case.split("/")
    world, knobs = next((w, k) for c, w, k in DATA["configs"] if c == cid)
    expected = DATA["results"][case]
    if expected.get("error") == "RuntimeError":
        # deadlocked before the step program (a joined rank shadowed neither the buffers'
        # broadcast nor the unused-parameter all_reduce); now every rank finishes
        res = replay(captures[name], world, engine=engine, progress=False,
                     **golden.replay_kwargs(knobs))
        assert len(res.iteration_times) == knobs["iterations"]
        return
    try:
        res = replay(captures[name], world, engine=engine, progress=False,
                     **golden.replay_kwargs(knobs))
    except ValueError as e:
        assert expected.get("error") == "ValueError", f"refused now, replayed before: {e}"
        return
    assert "error" not in expected, f"replayed now, refused before ({expected['error']})"
    assert golden.figures(res) == expected
