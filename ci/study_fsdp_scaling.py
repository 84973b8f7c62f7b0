"""A scaling study of FSDP2 at a fixed global batch: how per-GPU throughput falls per doubling
of the GPU count, with the α–β network alone and with the defaults (NCCL's tuning model, the
GPU's SM share and launch cost). Llama 3 8B, bf16 parameters, fp32 reductions, full AC, 256
sequences of 8,192 tokens, 128 → 2,048 GPUs; the local batch halves with each doubling (the
batch-2 step's compute scaled by local/2). Not a validation: no published row at these points.

    python ci/study_fsdp_scaling.py [PRESET]      # default dgx-h100; a few minutes here
"""
import sys, time
from fakepg import zoo
from simddp import Compute, Network, Timing
from simddp.cosim.capture_fsdp import capture_fsdp
from simddp.replay import replay

net = Network.preset(sys.argv[1] if len(sys.argv) > 1 else "dgx-h100")
base = Compute.roofline("h100", mem_bandwidth_GBps=2400.0)
GLOBAL = 256  # sequences of 8,192 tokens; local batch 2 at 128 GPUs
rows = {}
for n in (128, 256, 512, 1024, 2048):
    local = GLOBAL / n
    t0 = time.time()
    # a local batch of `local` sequences: the batch-2 step's compute × local/2 (the
    # communication, a function of the parameters, is the same)
    cap = capture_fsdp(zoo.get("llama3-8b", batch_size=2), 2,
                       timing=Timing(network=net, compute=base.scaled(local / 2)),
                       device="meta", param_dtype="bf16", reduce_dtype="fp32",
                       activation_checkpointing=True)
    for label, kw in (("alpha-beta (before)", dict(protocol_latency=False, gpu_contention="off")),
                      ("defaults (after)", {})):
        res = replay(cap, n, network=net, progress=False, **kw)
        tps = local * 8192 / res.iteration_time
        prev = rows.get((label, n // 2))
        rows[(label, n)] = tps
        drop = "" if prev is None else f"{100 * (tps / prev - 1):+.1f} %"
        print(f"{label:20} {n:5} local {local:6.3f} TPS/GPU {tps:8.0f} {drop:>9} exposed "
              f"{res.mean_exposed_comm / res.iteration_time:6.1%} ({res.engine}, "
              f"{time.time() - t0:.0f} s)", flush=True)
