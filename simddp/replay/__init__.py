"""Trace-driven replay: a captured step (DDP, FSDP2/HSDP, TP, PP), replayed at any world size.

:func:`replay` has the capture's planner (:mod:`simddp.program`) write the step program and
runs it on one of two engines (simpy, vectorised). Captures come from :mod:`simddp.cosim`
(``simddp.capture``, ``capture_fsdp``, ``capture_pp``), sweeps from :func:`simddp.sweep`, the
figures from :mod:`simddp.analysis`.

Two steps::

    import simddp
    from fakepg import zoo
    from simddp import Network, Timing, Compute
    from simddp.replay import replay
    from simddp import capture, sweep

    cap = capture(zoo.get("transformer_block"), nprocs=2,
                  timing=Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100")))
    cap.save("cap.json")                                   # JSON; CapturedIteration.load(...)
    res = replay(cap, 4096, network=Network.preset("ib-ndr", gpus_per_node=8),
                 bucket_cap_mb=5, comm_hook="fp16", rank_speed={17: 0.8})
    res.iteration_time, res.mean_exposed_comm              # seconds (means over iterations)
    res.timeline.plot("replay.png", ranks=range(8))        # the same Timeline as co-simulation
    rows = sweep(cap, world_size=[512, 4096], bucket_cap_mb=[5, 25], comm_hook=[None, "fp16"])
    print(rows.table()); rows.to_pandas()                  # a SweepResult: a list of dict rows
    sweep(cap, world_size=[512, 4096], executor=concurrent.futures.ProcessPoolExecutor())

Capture (:func:`capture`)
-------------------------

The scenario (a ``models.Scenario``, or any object with its attributes) runs under
:func:`simddp.simulate`
on the fake cluster — torch's real DDP and Reducer — for ``iterations`` steps; the last one
(after DDP rebuilt its buckets) is recorded per rank, from virtual time:

* ``forward``: compute from the iteration's start (the previous optimizer step's end) to the
  ``backward()`` call (zero_grad, forward, loss), waits excluded, and the collectives issued in
  it (e.g. DDP's buffer broadcast) at their compute offsets;
* per parameter, its **grad-ready time**: when the Reducer has processed its gradient
  (an autograd post-hook on the parameter's AccumulateGrad node, registered after the
  Reducer's, so the time includes the Reducer's copy into its bucket), relative to the
  ``backward()`` call, and rank 0's grad-ready order;
* ``backward``: backward compute until the Reducer's hidden end-of-backward wait, and
  ``post_backward``: what runs after that wait (the Reducer's finalize: copies from buckets to
  ``.grad``);
* ``optimizer``: the optimizer step;
* the Reducer's layout (``rebuilt_per_bucket_param_indices`` of ``_get_ddp_logging_data()``),
  its bucket caps and flags, the bucket all_reduce sizes from fakepg's trace, parameter shapes
  and dtypes, the co-simulated iteration time and exposed communication, and a roofline
  summary of the compute model (per-op overhead, bytes/s, FLOP/s) to cost comm hooks.

Replay (:func:`replay`)
-----------------------

One global simpy environment (:class:`simddp.core.Fabric`); each rank is a simpy process,
each collective a process on its communicator (see :mod:`simddp.core`). Per iteration a
rank runs:

1. **forward**: its captured forward compute (× 1/rank_speed × jitter), with the captured
   forward collectives (e.g. DDP's buffer broadcast) issued at their compute offsets and
   waited for where the capture's rank waited for them (if it did);
2. **backward**: bucket *k* becomes ready when the last of its parameters is ready
   (``backward start + grad-ready time × 1/speed × jitter``) and is issued when it and all
   buckets before it are ready — the Reducer reduces buckets in order. The layout is
   re-computed with torch's own ``_compute_bucket_assignment_by_size`` from the captured
   parameter sizes/dtypes and rank 0's grad-ready order, with the Reducer's rebuild limits
   ``[first bucket cap, bucket cap]`` (or, with ``find_unused_parameters=True``, where torch
   2.13 does not rebuild, the initial layout: parameter order, reversed);
3. the **end-of-backward wait** for every bucket's collectives and their future callbacks (a
   per-rank side stream, as in co-simulation), then the post-backward compute and the
   **optimizer** step. The iteration ends there.

Knobs (all of :func:`replay`'s keywords are grid axes for :func:`sweep`):

* ``network``: a :class:`~simddp.Network` or preset name; a collective lasts
  ``network.collective_time(op, bytes, group size) × jitter`` on the fabric as the
  communicator's placement sees it (how many of its members share a node; a strided mesh
  dimension: :meth:`simddp.Network.placed`). The network's ``contention``
  (:class:`~simddp.Contention`), if any: a rank's compute segments run at ``1/slowdown`` of
  their rate while one of its own collectives is in flight, and each collective the rank
  issues from its compute stream (forward collectives, buckets — a multi-stage hook's first
  stage —, backward collectives, averaging, Join's) first costs it ``per_collective_us``.
* ``bucket_cap_mb`` / ``first_bucket_mb``: as DDP's (an explicit cap makes the first bucket
  the same size, as in DDP, unless ``first_bucket_mb`` says otherwise).
* ``comm_hook``: ``"fp16"``/``"bf16"``: each bucket is sent as 2-byte elements; the cast
  before the all_reduce runs on the rank (in backward) and the copy back in a callback on the
  side stream, each costed as an op moving its bytes. ``"powersgd"`` (steady state, after
  ``start_powerSGD_iter``, error feedback on): per bucket an all_reduce of the uncompressed
  tensors (1-D ones, and matrices that compression would not shrink by ``2×``: torch's
  ``min_compression_rate``), then, in callbacks, an all_reduce of P (n·r per n×m matrix) and
  one of Q (m·r), as torch's ``powerSGD_hook`` chains them (with NCCL the chain is enqueued
  on the communicator when the bucket is issued, so bucket *k*'s P and Q all_reduces run
  before bucket *k + 1*'s; each is issued when the callback before it ends); its matmuls
  (M·Q, Mᵀ·P, P·Qᵀ: 2·n·m·r FLOPs each), orthogonalisation (2·n·r² FLOPs) and copies are
  costed with the captured roofline (op overhead + max(bytes/bandwidth, FLOPs/peak)). Without
  a roofline summary (a profile-based compute model), compression costs nothing.
* ``rank_speed={rank: factor}`` (stragglers: 0.5 = half speed) and ``jitter`` (relative
  standard deviation of a mean-1 log-normal factor per compute segment — forward, backward,
  post-backward, optimizer — of each rank and iteration, and per collective; co-simulation
  draws one per op, so the same ``jitter`` varies replayed iterations more), from ``seed``.
* ``localsgd_period=p`` (post-localSGD hook + ``PeriodicModelAverager``, after its warm-up):
  gradients are all-reduced only within each node (the hook's default subgroup: the DDP
  group's ranks on one node, ``network.gpus_per_node`` per node; none when it is unset), and
  every p-th iteration (``i % p == 0``, as the averager counts) all parameters are averaged over
  the DDP group: one blocking all_reduce of all parameter bytes plus the flatten/unflatten
  copies, charged to that iteration. ``slowmo_period=p`` (fairscale SlowMo, LocalSGD base
  algorithm): the same, plus the slow-momentum update (about four passes over the parameters)
  at each averaging. The warm-up iterations (plain DDP) are not replayed.
* ``uneven={rank: iterations}``: DDP under ``Join``; a rank runs the listed number of
  iterations (the others ``iterations``) and then shadows the others' iterations as Join's
  DDP hook does: each of its shadow iterations takes part in Join's all_reduce (the count of
  ranks not yet joined) and DDP's requires-grad-sync all_reduce (blocking), then in every
  bucket all_reduce (zeros), waiting for them. Ranks still training issue the same two 4-byte
  all_reduces (asynchronously) at each forward. At the end every rank takes part in the last
  Join all_reduce and DDP's broadcast of the final parameters.
* ``groups`` / ``shared_nic``: the world is split into ``groups`` DDP groups (rank r in group
  r % groups, e.g. one DDP per tensor-parallel shard), each of world_size/groups ranks, each
  with its own communicator. With ``shared_nic=True`` the ranks of a node (``gpus_per_node``)
  share one NIC, a simpy resource: a collective spanning several nodes holds the NIC of every
  node it spans, so the groups' collectives serialise there (contention).
* ``per_rank`` / ``engine`` / ``progress`` (not grid axes of interest; results do not depend
  on them): ranks that nothing above distinguishes (same captured profile, speed, iteration
  count, group, and node where node subgroups communicate; no jitter, which draws per rank)
  form a class, and one representative per class is simulated, arriving at each collective
  for its whole class — bit-for-bit the per-rank result; ``per_rank=True`` simulates every
  rank. With ``jitter`` every rank is distinct, and the vectorised engine
  (:mod:`simddp.replay.vector_engine`: every rank a slot of numpy arrays, each collective a scalar
  per communicator) replays them all — the simpy engine's iteration ends and collectives bit
  for bit, its per-iteration sums to float rounding — except where it does not model an
  option (uneven inputs, NICs shared between groups: then the simpy engine runs).
  ``engine="simpy"`` / ``"vector"`` chooses. ``progress``: a rich bar on stderr (None: when
  stderr is a terminal) or a callback ``(done, total, description)``.
* ``iterations``: how many to replay (default 1; one averaging period with LocalSGD/SlowMo;
  with ``uneven``, one more than the largest count listed, which the other ranks run).

Not modelled: compute that depends on the world size (the captured compute is replayed as
is), the first iterations (DDP's initial single bucket, the rebuild broadcast, warm-ups),
per-op variability inside a segment, PowerSGD's warm start and rank adaptation, other comm
hooks, overlap between iterations (each iteration ends with the optimizer step, after the
end-of-backward wait), memory, CPU/GPU asynchrony beyond the side stream of callbacks,
collectives the workload issues itself outside forward and backward.

Why replay can differ from co-simulation at the captured world size and network: each rank's
bucket is issued at the grad-ready time of its last parameter, measured after the Reducer's
hook returned, which is a few ops after the Reducer issued the all_reduce inside that hook;
and compute is replayed per segment, not per op. The test requires agreement within 5 %.
"""

from ..analysis import ReplayResult, SweepResult, write_csv
from ..program.captured import CapturedIteration, ParamInfo, RankProfile, assign_buckets
from ..program.knobs import COMM_HOOKS
from .conformance import PlannerContractError, check_planner
from .replaying import replay

SweepResult.replayer = replay  # SweepResult.replay(i) re-runs a row on this engine

__all__ = ["replay", "check_planner", "PlannerContractError", "write_csv", "assign_buckets",
           "CapturedIteration", "ParamInfo", "RankProfile", "ReplayResult", "SweepResult",
           "COMM_HOOKS"]
