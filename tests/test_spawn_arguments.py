"""fakepg.spawn checks its numeric arguments the way every fakepg entry point does."""

from __future__ import annotations

import numpy as np
import pytest

import fakepg


def test_numpy_integers_are_accepted_for_nprocs_and_seed():
    result = fakepg.spawn(lambda rank: rank, nprocs=np.int64(3), seed=np.int32(7))
    assert result.returns == [0, 1, 2]
    assert (type(result.nprocs), type(result.seed)) == (int, int)


@pytest.mark.parametrize("seed", [1.5, "0", True, None])
def test_seed_must_be_an_integer(seed):
    with pytest.raises(ValueError, match="seed must be an integer"):
        fakepg.spawn(lambda rank: None, nprocs=2, seed=seed)


@pytest.mark.parametrize("hang_timeout", [0, -1.0, float("nan"), "1", True])
def test_hang_timeout_must_be_a_positive_number_of_seconds(hang_timeout):
    with pytest.raises(ValueError, match="hang_timeout must be a finite number > 0"):
        fakepg.spawn(lambda rank: None, nprocs=2, hang_timeout=hang_timeout)


def test_a_number_of_ranks_given_as_args_says_to_write_nprocs():
    # spawn(train, 4): the 4 lands in ``args``; it used to fail with "'int' object is not iterable"
    with pytest.raises(TypeError, match=r"args must be a tuple of fn's arguments after the rank, "
                                        r"got 4 \(int\); to run 4 ranks, write "
                                        r"fakepg.spawn\(fn, nprocs=4\)"):
        fakepg.spawn(lambda rank: rank, 4)
