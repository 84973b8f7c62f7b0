"""Benchmark: a 16,384-GPU 3-D pipeline replay (goal: ≤ 10 s).

pp:16 × fsdp:128 × tp:8 on DGX H100s, Llama 3 70B-like stages: 80 layers / 16 = 5 per stage
(parameters from the zoo's ``LLAMA3_70B``), one 8,192-token sequence per microbatch, compute at
an H100's bf16 peak × ``--mfu``: forward 2 FLOPs per parameter and token, backward 4, split over
tp. In each stage per layer and microbatch 2 tensor-parallel all-reduces of the activations in
forward and 2 in backward (Megatron's column/row split), FSDP's all-gather of the stage's bf16
parameters before the first forward and reduce-scatter of fp32 gradients after the last
backward, and the activations (bf16, tp-split) sent between stages. Replayed with
``simddp.program.pipeline.uniform_pipeline`` — a stand-in for a capture — under 1F1B and
Interleaved1F1B (2 stages per rank), best of ``--rounds``. Prints wall seconds, the lanes the
simpy engine ran (classes of identical ranks) and the ratio to the 10 s goal.

    python ci/bench_pp_replay.py [--rounds 3] [--microbatches 16] [--mfu 0.4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # models/


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--mfu", type=float, default=0.4)
    args = p.parse_args()

    from models.llama import LLAMA3_70B
    from simddp import Network
    from simddp.program.pipeline import uniform_pipeline
    from simddp.replay import replay

    pp, fsdp, tp, tokens = 16, 128, 8, 8192
    world = pp * fsdp * tp
    a = LLAMA3_70B
    layer_params = (a.num_params() - 2 * a.vocab_size * a.dim) / a.n_layers
    layers = a.n_layers // pp
    flops_per_s = 989e12 * args.mfu  # H100 SXM bf16 dense peak × MFU
    act = tokens * a.dim * 2  # one microbatch's activations, bf16
    net = Network.preset("dgx-h100")
    print(f"{world:,} GPUs: pp:{pp} × fsdp:{fsdp} × tp:{tp}, {args.microbatches} microbatches, "
          f"{layers} Llama-3-70B layers per stage")
    print(f"{'schedule':16} {'lanes':>6} {'wall s':>8} {'goal 10 s':>10} {'iteration s':>12} "
          f"{'bubble max':>11} {'peak GB':>8}")
    for schedule, v in (("1F1B", 1), ("Interleaved1F1B", 2)):
        n = layers / v  # layers per virtual stage
        fwd = 2 * layer_params * n * tokens / tp / flops_per_s
        cap = uniform_pipeline(
            pp, args.microbatches, fwd, 2 * fwd, schedule=schedule, stages_per_rank=v,
            send_bytes=act // tp, param_bytes=int(layer_params * n * 2),
            activation_bytes=int(n * 34 * tokens * a.dim / tp),  # Korthikanti et al., bf16
            optimizer_s=1e-3, optimizer_state_bytes=int(layer_params * n * 12 / tp / fsdp),
            tp=tp, tp_allreduces=int(2 * n), tp_bytes=act, shard=fsdp, name="llama3-70b-like")
        best, res = float("inf"), None
        for _ in range(args.rounds):
            t = time.perf_counter()
            res = replay(cap, world, network=net, progress=False)
            best = min(best, time.perf_counter() - t)
        lanes = len(res.timeline.classes())
        print(f"{schedule:16} {lanes:>6} {best:>8.3f} {best / 10:>9.3f}x "
              f"{res.iteration_time:>12.3f} {max(res.bubble_fraction):>11.3f} "
              f"{res.peak_memory_bytes / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
