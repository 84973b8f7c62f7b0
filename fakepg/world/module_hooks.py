"""torch.nn's process-global module hooks, per rank in thread mode.

``register_module_forward_pre_hook`` and its kin (``torch.nn.modules.module._global_*``) are
process-wide: under torchrun each worker has its own. torch's ``CommDebugMode``, ``ModTracker``
and ``FSDPMemTracker`` install such hooks, so with rank threads sharing them each rank's
tracker saw every rank's modules (3 of torch's 9 tensor-parallel style tests failed in threads
for that alone). Declared per rank (:func:`fakepg.world.isolation.per_rank_globals`), they are
swapped at hand-offs like the RNGs: a rank starts with the hooks the caller had registered,
and sees only its own from then on.
"""

from __future__ import annotations

import torch.nn.modules.module as _module

from .isolation import per_rank_globals

MODULE = _module.__name__
# every one torch has (their set varies across versions): forward, backward, registration
NAMES = tuple(sorted(k for k in vars(_module) if k.startswith("_global_")))


def declare() -> None:
    """Make torch.nn's global module hooks per rank (idempotent)."""
    per_rank_globals(MODULE, *NAMES)
