"""Scenario zoo: small models plus deterministic per-rank data that exercise DDP's features.

Installed as ``fakepg.zoo`` (the repository's ``models/`` folder, mapped by the packaging); it
imports only torch and the standard library, so every harness (fakepg, gloo, NCCL, the
single-process reference) can run the same scenarios::

    from fakepg import zoo
    sc = zoo.get("grad_order_differs", iterations=3)         # or zoo.SCENARIOS[name]()
    model = zoo.TrainLoop()(sc, rank, world_size)            # the one training loop, on any world
    expected = zoo.reference_train(sc, world_size)           # final state_dict, if sc.reference_ok

Scenarios: mlp, many_small_few_large, grad_order_differs, grad_order_differs_per_rank,
rank_dependent_unused, tied_weights, buffers, sparse_embedding, mixed_dtypes, transformer_block,
param_order, uneven_inputs. Benchmark workloads (``WORKLOADS``, also reached by ``get``; the
feature suite does not train them): resnet50, resnet101, resnext101_32x4d (:mod:`.resnet`), vgg16,
alexnet, inception_v3 (:mod:`.vision`), all torchvision-equal; bert_base, bert_large, gpt2,
gpt2_medium (transformers-equal, :mod:`.language`); llama3-8b, llama3-70b, llama3-405b, llama3-tiny (a
Llama-3-style decoder, :mod:`.llama`).
"""

from .reference import reference_train
from .scenario import Scenario, SeededBatches, rank_generator
from .training import TrainEvent, TrainLoop, run_iterations
from . import catalog, language, llama, resnet, vision
from .catalog import *  # noqa: F403 - the scenario factories, SCENARIOS and get (see catalog.__all__)

__all__ = ["Scenario", "SeededBatches", "rank_generator", "reference_train",
           "TrainLoop", "TrainEvent", "run_iterations", *catalog.__all__]
