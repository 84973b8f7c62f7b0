"""Scenario zoo: small models plus deterministic per-rank data that exercise DDP's features.

Imports only torch and the standard library, so every harness (fakepg, gloo, NCCL, the
single-process reference) can run the same scenarios::

    import models
    sc = models.get("grad_order_differs", iterations=3)      # or models.SCENARIOS[name]()
    ddp = DistributedDataParallel(sc.build_model(), **sc.ddp_kwargs)
    for batch in sc.inputs(rank, world_size): ...            # zero_grad, step().backward(), step
    expected = models.reference_train(sc, world_size)        # final state_dict, if sc.reference_ok

Scenarios: mlp, many_small_few_large, grad_order_differs, grad_order_differs_per_rank,
rank_dependent_unused, tied_weights, buffers, sparse_embedding, mixed_dtypes, transformer_block,
param_order, uneven_inputs.
"""

from .reference import reference_train
from .scenario import Scenario, SeededBatches, rank_generator
from . import zoo
from .zoo import *  # noqa: F403 - the scenario factories, SCENARIOS and get (see zoo.__all__)

__all__ = ["Scenario", "SeededBatches", "rank_generator", "reference_train", *zoo.__all__]
