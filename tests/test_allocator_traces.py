"""simddp.cosim.memtrace: the temporaries of a plain forward and backward, on closed forms."""

from __future__ import annotations

import torch

from simddp.cosim.capture import saved_bytes


def test_temporaries_are_what_is_live_beyond_saved_tensors_parameters_and_gradients() -> None:
    n = 1 << 16
    w = torch.nn.Parameter(torch.zeros(n))
    # w + 1 and its × 3 are live together (neither is saved: add and mul by a number save
    # nothing); backward's grad × 3 is one more of n floats, the gradient itself is w.grad
    r = saved_bytes(lambda: ((w + 1) * 3).sum(), params=[w], temporaries=True)
    assert tuple(r) == (0, 0)
    assert 2 * n * 4 <= r.temporary <= 2 * n * 4 + 64  # + the scalars (loss, its gradient)
    assert w.grad is None  # the measurement leaves no gradient behind


def test_saved_activations_are_not_temporaries() -> None:
    n = 1 << 16
    w = torch.nn.Parameter(torch.ones(n))
    # exp saves its output (n floats): counted as saved, not as a temporary
    r = saved_bytes(lambda: w.exp().sum(), params=[w], temporaries=True)
    assert r[0] == n * 4 and r.sizes == (n * 4,)
    assert r.temporary <= n * 4 + 64  # exp's backward: grad × result, n floats
