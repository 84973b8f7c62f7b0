"""Shims that let GPU-minded distributed code run on a CPU-only fake cluster.

fairscale's ``SlowMoDistributedDataParallel`` (0.4.13) calls ``torch.cuda.synchronize()``
unconditionally, after creating each process group and after every LocalSGD average; on a
machine without CUDA that raises ``AssertionError: Torch not compiled with CUDA enabled``
(or "No CUDA GPUs are available")::

    from fakepg.compat import cuda_synchronize_noop

    with cuda_synchronize_noop():
        result = fakepg.spawn(train_with_slowmo, nprocs=4)

The shim changes nothing when CUDA is available: there a real synchronize is meaningful.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["cuda_synchronize_noop"]

_lock = threading.Lock()
_depth = 0
_saved = None


def _noop_synchronize(device: object = None) -> None:  # noqa: ARG001 - torch's signature
    """Stands in for ``torch.cuda.synchronize`` without CUDA: CPU work is already synchronous."""


@contextlib.contextmanager
def cuda_synchronize_noop() -> Iterator[None]:
    """Make ``torch.cuda.synchronize`` a no-op while inside, when CUDA is unavailable.

    Re-entrant and thread-safe (rank threads of one world may each enter it): the original
    function comes back when the outermost ``with`` exits.
    """
    global _depth, _saved
    if torch.cuda.is_available():
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = torch.cuda.synchronize
            torch.cuda.synchronize = _noop_synchronize
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.synchronize = _saved
                _saved = None
