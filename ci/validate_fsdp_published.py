"""simddp's FSDP2 what-ifs against published FSDP2 training figures (torchtitan).

Every row: the published figure, its source, the setup as stated there; simddp's prediction
from specs only (never fitted to the table): torch's real FSDP2 ``fully_shard`` on the zoo's
Llama 3 decoder captured at real size on the meta device (bf16 parameters, fp32 reductions,
every block under activation checkpointing), costed by the kernel-efficiency model of the stated
GPU (``Compute.kernels``: its power limit and memory bandwidth as stated), replayed
at the stated GPU count on the stated fabric. Tokens/s per GPU = local batch × sequence length
/ predicted iteration time; memory = the largest rank's predicted peak.

    python ci/validate_fsdp_published.py            # ~2-4 minutes here (three real-size captures)

Prints the table, the median |error| per figure and whether each what-if direction (more
GPUs, a larger model) comes out right.
"""

from __future__ import annotations

import statistics
import time

GIB = 2 ** 30

# (label, model, local batch, GPU, peak memory GB/s of the stated card, network preset,
#  world size, published TPS/GPU, published memory GiB or None, source)
TORCHTITAN_H100 = ("torchtitan docs/performance.md, Table 1/3 (Llama 3.1 8B, 1D FSDP, selective "
                   "AC, no torch.compile; Grand Teton: 8 H100 96 GB HBM2e 2.4 TB/s per host, "
                   "NVLink, 400 Gb/s RDMA per GPU)")
TORCHTITAN_A100 = ("torchtitan docs/performance.md (older revision), 'Llama 3 performance "
                   "numbers' (FSDP2 on 64 A100 80 GB; network not stated: DGX A100 assumed)")
ROWS = [
    ("8B, 8 H100", "llama3-8b", 2, "h100,tdp-W=500", 2400.0, "dgx-h100", 8, 5762, 82.4, TORCHTITAN_H100),
    ("8B, 128 H100", "llama3-8b", 2, "h100,tdp-W=500", 2400.0, "dgx-h100", 128, 5605, 67.0,
     TORCHTITAN_H100),
    ("8B, 64 A100", "llama3-8b", 1, "a100", None, "dgx-a100", 64, 2904, None, TORCHTITAN_A100),
    ("70B, 64 A100", "llama3-70b", 1, "a100", None, "dgx-a100", 64, 331, None, TORCHTITAN_A100),
]


def main() -> None:
    from fakepg import zoo
    from simddp import Compute, Network, Timing
    from simddp.cosim.capture_fsdp import capture_fsdp
    from simddp.replay import replay

    caps: dict = {}
    out = []
    for label, model, batch, gpu, bw, net_name, world, tps, mem, source in ROWS:
        net = Network.preset(net_name)
        key = (model, batch, gpu, bw)
        if key not in caps:
            t0 = time.perf_counter()
            compute = Compute.kernels(gpu, mem_bandwidth_GBps=bw)  # the default model
            caps[key] = capture_fsdp(zoo.get(model, batch_size=batch), 2,
                                     timing=Timing(network=net, compute=compute),
                                     device="meta", param_dtype="bf16", reduce_dtype="fp32",
                                     activation_checkpointing=True)
            print(f"captured {model} batch {batch} on {gpu}: {time.perf_counter() - t0:.0f} s",
                  flush=True)
        res = replay(caps[key], world, network=net, progress=False)
        seq = zoo.get(model, batch_size=batch).inputs(0, 1)[0][0].shape[-1]
        pred_tps = batch * seq / res.iteration_time
        out.append((label, world, tps, pred_tps, mem, res.peak_memory_bytes / GIB,
                    res.mean_exposed_comm / res.iteration_time))
    print(f"\n{'row':14} {'GPUs':>5} {'TPS/GPU pub':>11} {'simddp':>8} {'error':>7} "
          f"{'mem GiB pub':>11} {'simddp':>7} {'error':>7} {'exposed':>8}")
    errs_t, errs_m = [], []
    for label, world, tps, ptps, mem, pmem, exposed in out:
        et = (ptps - tps) / tps
        errs_t.append(abs(et))
        em = "" if mem is None else f"{(pmem - mem) / mem:+.1%}"
        if mem is not None:
            errs_m.append(abs((pmem - mem) / mem))
        print(f"{label:14} {world:>5} {tps:>11,} {ptps:>8,.0f} {et:>+7.1%} "
              f"{'-' if mem is None else f'{mem:.1f}':>11} {pmem:>7.1f} {em:>7} {exposed:>8.1%}")
    print(f"\nmedian |error|: TPS/GPU {statistics.median(errs_t):.1%}, memory "
          f"{statistics.median(errs_m):.1%}")
    t8, t128 = out[0][3], out[1][3]
    m8, m128 = out[0][5], out[1][5]
    print("directions (published → simddp):")
    print(f"  8 → 128 H100, TPS/GPU falls (5,762 → 5,605): {'right' if t128 < t8 else 'WRONG'} "
          f"({t8:,.0f} → {t128:,.0f})")
    print(f"  8 → 128 H100, memory falls (82.4 → 67.0 GiB): {'right' if m128 < m8 else 'WRONG'} "
          f"({m8:.1f} → {m128:.1f})")
    r_pub, r_pred = 2904 / 331, out[2][3] / out[3][3]
    print(f"  8B / 70B TPS on 64 A100 ({r_pub:.1f}x published): simddp {r_pred:.1f}x "
          f"({'right' if r_pred > 1 else 'WRONG'} direction)")
    print("\nsources:")
    for src in sorted({r[-1] for r in ROWS}):
        print(f"  {src}")


if __name__ == "__main__":
    main()
