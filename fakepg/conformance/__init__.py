"""Conformance: the same DDP scenario on fakepg and on a real backend, compared.

Step 2 of the verification ladder (fake cluster = real gloo, multi-process) and the NCCL legs of
step 4, in one API. A layer above fakepg's core and the scenario zoo: ``import fakepg`` does not
load it::

    from fakepg import zoo
    from fakepg.conformance import assert_conformant, run_scenario
    sc = zoo.get("grad_order_differs_per_rank")
    fake = run_scenario(sc, 2)                          # fakepg.spawn, 2 rank threads
    gloo = run_scenario(sc, 2, backend="gloo")          # 2 processes, real gloo
    assert_conformant(fake, gloo)       # same collectives, buckets, final parameters

A *scenario* is a :class:`fakepg.zoo.Scenario`, or any object with its attributes (``name``,
``build_model()`` or ``model()`` plus ``seed``, ``inputs(rank, world_size)``, ``step(model,
batch)``, ``optimizer(params)``, ``ddp_kwargs``); each rank trains it with the zoo's loop,
:class:`fakepg.zoo.TrainLoop`, unless ``train=`` says otherwise. For the multi-process backends
it must pickle (zoo scenarios do).

Backends:

* ``"fake"``: :func:`fakepg.spawn`, ranks as threads (tensors on ``device``, CPU by default);
* ``"fake-cuda"``: the same with every rank's tensors on ``cuda:0``;
* ``"gloo"``: one process per rank (``torch.multiprocessing``, spawn start method), rendezvous
  through a ``FileStore`` in a temporary directory;
* ``"nccl"``: the same with NCCL, rank r on ``cuda:r`` (torchrun-style environment); needs
  ``world_size`` GPUs.

On the real backends the default process group is a recording wrapper
(:class:`RecordingProcessGroup`), so both sides' collective sequences are observed at the same
interface. Modules: ``runner`` (:func:`run_scenario`), ``recording`` (the wrapper),
``programs`` (:class:`CollectiveTour`), ``compare`` (:func:`compare`,
:func:`assert_conformant`), ``outcome`` (:class:`ScenarioOutcome`, :class:`RecordedCollective`).
"""

from .compare import assert_conformant, compare, default_tolerance
from .outcome import RecordedCollective, ScenarioOutcome
from .programs import CollectiveTour
from .recording import RecordingProcessGroup
from .runner import BACKENDS, run_scenario

__all__ = [
    "run_scenario",
    "ScenarioOutcome",
    "RecordedCollective",
    "CollectiveTour",
    "compare",
    "assert_conformant",
    "default_tolerance",
    "RecordingProcessGroup",
    "BACKENDS",
]
