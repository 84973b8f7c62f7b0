"""A deep pipeline from a shallow capture (simddp.cosim.deepen) and the uneven stage split it
relies on (models.llama.stage_layers with torchtitan's embedding / head weights)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakepg import zoo
from fakepg.zoo.llama import LLAMA3_TINY, Llama, stage_layers
from simddp.cosim.capture_pp import capture_pp
from simddp.cosim.deepen import deepen
from simddp.replay import replay


def _counts(n_layers: int, num_stages: int, w: int = 1) -> list[int]:
    return [len(stage_layers(n_layers, s, num_stages, input_weight=w, output_weight=w))
            for s in range(num_stages)]


def test_weighted_split_follows_torchtitans_rule():
    # generate_llm_fqn_per_model_part(8, 32): 34 effective blocks, the first two stages +1
    assert _counts(32, 8) == [4, 5, 4, 4, 4, 4, 4, 3]
    # Llama 3 405B, torchtitan's pp 8 and pp 8 × 2 virtual stages
    assert _counts(126, 8) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert _counts(126, 16) == [7] + [8] * 14 + [7]
    # the Llama 3 paper's layout: one block a stage, the first only the embedding, the last
    # only the head
    assert _counts(126, 128) == [0] + [1] * 126 + [0]


@settings(max_examples=60, deadline=None)
@given(n_layers=st.integers(1, 200), num_stages=st.integers(1, 40),
       w_in=st.integers(0, 2), w_out=st.integers(0, 2))
def test_every_split_cuts_the_blocks_into_consecutive_stages(n_layers, num_stages, w_in, w_out):
    try:
        parts = [stage_layers(n_layers, s, num_stages, input_weight=w_in, output_weight=w_out)
                 for s in range(num_stages)]
    except ValueError:
        return  # refused with a reason (too many stages, or an even split that does not divide)
    assert [i for p in parts for i in p] == list(range(n_layers))


def _tiny(n_layers: int):
    args = dataclasses.replace(LLAMA3_TINY, n_layers=n_layers)
    return zoo.get("llama3-tiny", batch_size=4).with_(model=functools.partial(Llama, args))


@pytest.fixture(scope="module")
def shallow():
    # [embedding] [block 0] [block 1] [head] on 2 ranks, 2 stages each
    return capture_pp(_tiny(2), 2, schedule="Interleaved1F1B", stages_per_rank=2,
                      microbatches=4, input_weight=1, output_weight=1)


def test_deepening_to_the_captured_depth_replays_the_capture(shallow):
    same = deepen(shallow, 2, 2, n_layers=2)
    a = replay(shallow, network="dgx-h100", progress=False)
    b = replay(same, network="dgx-h100", progress=False)
    assert b.iteration_time == a.iteration_time
    assert b.bubble_fraction == a.bubble_fraction


def test_a_deepened_capture_replays_as_a_real_capture_of_the_deep_pipeline(shallow):
    # the real thing: 4 blocks on 6 stages, [emb] 4 × [block] [head], captured as is
    real = capture_pp(_tiny(4), 2, schedule="Interleaved1F1B", stages_per_rank=3,
                      microbatches=4, input_weight=1, output_weight=1)
    deep = deepen(shallow, 2, 3, n_layers=4)
    assert [s["layers"] for s in deep.stages] == [s["layers"] for s in real.stages]
    assert [s["param_bytes"] for s in deep.stages] == [s["param_bytes"] for s in real.stages]
    a = replay(real, network="dgx-h100", progress=False).iteration_time
    b = replay(deep, network="dgx-h100", progress=False).iteration_time
    assert b == pytest.approx(a, rel=1e-9)  # equal to rounding: same actions, same costs


def test_deepening_refuses_a_model_the_stages_do_not_add_up_to(shallow):
    with pytest.raises(ValueError, match=r"hold 14 blocks, the model 13 \(15 stages would\)"):
        deepen(shallow, 4, 4, n_layers=13)


def test_deepening_needs_a_middle_stage_to_copy():
    two = capture_pp(_tiny(2), 2, schedule="1F1B", microbatches=2)
    with pytest.raises(ValueError, match="needs a first, at least one middle and a last stage"):
        deepen(two, 4, 1, n_layers=4)
