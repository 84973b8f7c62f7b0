"""simddp's 2-D and 3-D what-ifs against published LLM training figures.

Every row: a published figure, its source, the setup as stated there, and simddp's prediction
from specs only (never fitted to the table): the zoo's Llama 3 decoder (70B, 405B) captured at
real size on the meta device with torch's real FSDP2, tensor parallelism (torchtitan's plan)
and, for 3-D rows, torch's real pipelining schedules (bf16 parameters, fp32 reductions),
costed by the stated GPU's kernel-efficiency model (``Compute.kernels``: torchtitan's 500 W
cards with torch.compile and Float8), replayed at the stated GPU count and layout on the DGX
H100 fabric (8 GPUs on NVLink, 400 Gb/s per GPU between nodes — both sources' networks).

Pipelines are captured shallow and deepened (:func:`simddp.cosim.deepen.deepen`): the first,
a middle and the last stage of the stated split are captured, the pipeline's other stages are
copies of the middle one (exact: tests/test_pipeline_deepen.py).

    python ci/validate_parallel_published.py          # ~10 minutes here (real-size TP captures)

Prints the table, the median |error| per figure and whether each what-if direction comes out
right. What simddp does not model is listed under each table in docs/validation.md.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time

GIB = 2 ** 30
SEQ = 8192

TT = ("torchtitan docs/performance.md (Dec 2024 revision), Tables 4 and 5: Grand Teton hosts, 8 "
      "H100 (96 GB HBM2e, 2.4 TB/s, 500 W) on NVLink, 400 Gb/s RDMA per GPU; torch.compile, "
      "Float8 (and AsyncTP in Table 5); full activation checkpointing")
L3 = ("The Llama 3 Herd of Models (arXiv 2407.21783), Table 4: Llama 3 405B pre-training, H100 "
      "80 GB HBM3 at 700 W, 400 Gb/s RoCE per GPU; TP 8, CP 1, PP 16, sequence 8,192, 16M tokens "
      "a batch; TFLOPs/GPU of BF16. Activation checkpointing is not stated there; simddp "
      "assumes full AC (without any, one stage's activations alone exceed 80 GB)")

# label, model, GPUs, layout (pp, dp, tp), schedule, stages per rank, microbatches (of one
# sequence), published TPS/GPU or None, published TFLOPs/GPU or None, memory GiB or None,
# GPU memory bandwidth GB/s, source
ROWS = [
    ("70B 2-D, 256 H100", "70b", 256, (1, 32, 8), None, 1, 16, 829, None, 71.9, 2400.0, TT),
    ("405B 3-D 1F1B, 512 H100", "405b", 512, (8, 8, 8), "1F1B", 1, 32, 100, None, 82.5,
     2400.0, TT),
    ("405B 3-D Interleaved, 512 H100", "405b", 512, (8, 8, 8), "Interleaved1F1B", 2, 32, 128,
     None, 72.7, 2400.0, TT),
    ("405B 3-D, 8,192 H100", "405b", 8192, (16, 64, 8), "Interleaved1F1B", 8, 32, None, 430,
     None, 3350.0, L3),
    ("405B 3-D, 16,384 H100", "405b", 16384, (16, 128, 8), "Interleaved1F1B", 8, 16, None, 400,
     None, 3350.0, L3),
]


def model_flops_per_token(args) -> float:
    """6·N + 12·L·d·s: the weights' forward and backward, and attention's scores and values at
    sequence s (PaLM's / Megatron's model-FLOPs count, no causal halving)."""
    return 6 * args.num_params() + 12 * args.n_layers * args.dim * SEQ


def shallow_layers(n_layers: int, num_stages: int, capture_stages: int) -> int:
    """Blocks of the shallow model whose ``capture_stages``-stage split (embedding and head
    weighing one block each) has the deep split's first, middle and last stages."""
    from fakepg.zoo.llama import stage_layers

    counts = [len(stage_layers(n_layers, s, num_stages, input_weight=1, output_weight=1))
              for s in range(num_stages)]
    middle = counts[1]
    return counts[0] + middle * (capture_stages - 2) + counts[-1]


def predict(row, caps: dict) -> tuple[float, float, float, float]:
    from fakepg import zoo
    from fakepg.zoo.llama import LLAMA3_CONFIGS, Llama
    from simddp import Compute, Network, Timing
    from simddp.cosim.capture_fsdp import capture_fsdp
    from simddp.cosim.capture_pp import capture_pp
    from simddp.cosim.deepen import deepen
    from simddp.replay import replay

    label, size, world, (pp, dp, tp), schedule, v, m, *_rest = row
    bw = row[10]
    net = Network.preset("dgx-h100")
    tt = row[-1] is TT  # torchtitan's rows: 500 W cards, torch.compile and Float8
    compute = Compute.kernels("h100,tdp-W=500" if tt else "h100", mem_bandwidth_GBps=bw,
                              compile=tt, float8=tt)
    timing = Timing(network=net, compute=compute)
    args = LLAMA3_CONFIGS[size]
    t0 = time.perf_counter()
    if pp == 1:
        key = (size, m, bw, "2d")
        if key not in caps:
            sc = zoo.get(f"llama3-{size}", batch_size=m)
            caps[key] = capture_fsdp(sc, 2 * tp, timing=timing, mesh={"shard": 2, "tp": tp},
                                     device="meta", param_dtype="bf16", reduce_dtype="fp32",
                                     activation_checkpointing=True)
        res = replay(caps[key], world, network=net, parallel=f"fsdp:{dp},tp:{tp}",
                     progress=False)
        tokens = m * SEQ * dp
    else:
        cap_pp = 3 if v == 1 else 2  # enough stages for a first, a middle and a last
        cap_m = cap_pp  # the fewest microbatches torch's schedules take at that depth
        key = (size, schedule, v, bw)
        if key not in caps:
            n = shallow_layers(args.n_layers, pp * v, cap_pp * v)
            sc = zoo.get(f"llama3-{size}", batch_size=cap_m)
            shape = sc.model.args[0]  # the workload's LlamaArgs (its fused attention included)
            sc = sc.with_(model=functools.partial(Llama, dataclasses.replace(shape, n_layers=n)))
            shallow = capture_pp(sc, cap_pp, schedule=schedule, stages_per_rank=v,
                                 microbatches=cap_m, mesh={"shard": 2, "tp": tp},
                                 timing=timing, device="meta", param_dtype="bf16",
                                 reduce_dtype="fp32", input_weight=1, output_weight=1,
                                 activation_checkpointing=True)  # the sources' full AC
            caps[key] = deepen(shallow, pp, v, n_layers=args.n_layers)
        res = replay(caps[key], world, network=net, parallel=f"pp:{pp},fsdp:{dp},tp:{tp}",
                     pp_schedule=schedule, microbatches=m, progress=False)
        tokens = m * SEQ * dp
    tps = tokens / res.iteration_time / world
    print(f"  {label}: captured and replayed in {time.perf_counter() - t0:.0f} s "
          f"(iteration {res.iteration_time:.2f} s, bubble "
          f"{max(res.bubble_fraction) if res.bubble_fraction else 0:.3f})", flush=True)
    return tps, tps * model_flops_per_token(args) / 1e12, res.peak_memory_bytes / GIB, \
        res.mean_exposed_comm / res.iteration_time


def main() -> None:
    only = sys.argv[1:]
    caps: dict = {}
    out = []
    for row in ROWS:
        if only and not any(o in row[0] for o in only):
            continue
        out.append((row, predict(row, caps)))
    print(f"\n{'row':31} {'figure':>10} {'published':>9} {'simddp':>8} {'error':>7} "
          f"{'mem GiB pub':>11} {'simddp':>7} {'exposed':>8}")
    errs, errs_m = [], []
    for row, (tps, tflops, mem, exposed) in out:
        pub_tps, pub_tf, pub_mem = row[7], row[8], row[9]
        fig, pub, pred = (("TPS/GPU", pub_tps, tps) if pub_tps is not None
                          else ("TFLOPs/GPU", pub_tf, tflops))
        err = (pred - pub) / pub
        errs.append(abs(err))
        em = "-" if pub_mem is None else f"{pub_mem:.1f}"
        if pub_mem is not None:
            errs_m.append(abs((mem - pub_mem) / pub_mem))
        print(f"{row[0]:31} {fig:>10} {pub:>9,} {pred:>8,.0f} {err:>+7.1%} {em:>11} "
              f"{mem:>7.1f} {exposed:>8.1%}")
    print(f"\nmedian |error|: throughput {statistics.median(errs):.1%}"
          + (f", memory {statistics.median(errs_m):.1%}" if errs_m else ""))
    got = {row[0]: vals for row, vals in out}
    checks = [("405B 3-D 1F1B, 512 H100", "405B 3-D Interleaved, 512 H100", 0,
               "interleaved 1F1B is faster than 1F1B (100 → 128 TPS/GPU)", +1),
              ("405B 3-D 1F1B, 512 H100", "405B 3-D Interleaved, 512 H100", 2,
               "interleaved 1F1B needs less memory (82.5 → 72.7 GiB)", -1),
              ("405B 3-D, 8,192 H100", "405B 3-D, 16,384 H100", 1,
               "8,192 → 16,384 GPUs at 16M tokens: TFLOPs/GPU fall (430 → 400)", -1)]
    print("directions (published → simddp):")
    for a, b, i, what, sign in checks:
        if a in got and b in got:
            x, y = got[a][i], got[b][i]
            ok = (y - x) * sign > 0
            print(f"  {what}: {'right' if ok else 'WRONG'} ({x:,.1f} → {y:,.1f})")
    print("\nsources:")
    for src in sorted({row[-1] for row, _ in out}):
        print(f"  {src}")


if __name__ == "__main__":
    main()
