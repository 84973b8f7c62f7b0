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

Then the same from real captures (``--real``): Llama 3 8B and 70B captured by
``simddp.cosim.capture_pp`` on the meta device (torch's real ``PipelineStage``, ``Schedule1F1B``
and FSDP2, no arithmetic) at pp:4 × shard:2, 4 microbatches of 8,192 tokens, H100 roofline
compute, DGX H100 network, bf16 parameters and fp32 reduction — replayed at pp:4 × fsdp:4096 =
16,384 GPUs with 16 microbatches under 1F1B and GPipe. The capture's own time is printed apart
(it is not the replay's).

    python ci/bench_pp_replay.py [--rounds 3] [--microbatches 16] [--mfu 0.4] [--real 8b,70b]
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
    p.add_argument("--real", default="8b,70b",
                   help="real captures to replay: comma-separated of 8b, 70b; 'none' skips")
    args = p.parse_args()
    real = [] if args.real == "none" else args.real.split(",")
    bad = sorted(set(real) - {"8b", "70b"})
    if bad:
        p.error(f"--real: unknown {bad}; give some of 8b,70b or none")

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
    if real:
        _real_captures(real, args.rounds, args.microbatches)


def _real_captures(sizes: list[str], rounds: int, microbatches: int) -> None:
    """Replay real meta-device captures of Llama 3 at 16,384 GPUs (see the module docstring)."""
    from fakepg.zoo import workloads
    from simddp import Compute, Network, Timing
    from simddp.cosim.capture_pp import capture_pp
    from simddp.replay import replay

    timing = Timing(network=Network.preset("dgx-h100"), compute=Compute.roofline("h100"))
    world = 16_384
    print(f"\nreal captures (meta, pp:4 × shard:2, 1F1B, 4 microbatches) replayed at {world:,} "
          f"GPUs, pp:4 × fsdp:{world // 4}, {microbatches} microbatches")
    print(f"{'model':10} {'capture s':>10} {'schedule':9} {'lanes':>6} {'wall s':>8} "
          f"{'goal 10 s':>10} {'iteration s':>12} {'bubble max':>11}")
    for size in sizes:
        t = time.perf_counter()
        cap = capture_pp(getattr(workloads, f"llama3_{size}")(batch_size=4), 4,
                         schedule="1F1B", mesh={"shard": 2}, device="meta", timing=timing,
                         param_dtype="bf16", reduce_dtype="fp32")
        took = time.perf_counter() - t
        for schedule in ("1F1B", "GPipe"):
            best, res = float("inf"), None
            for _ in range(rounds):
                t = time.perf_counter()
                res = replay(cap, world, progress=False, pp_schedule=schedule,
                             microbatches=microbatches)
                best = min(best, time.perf_counter() - t)
            print(f"{'llama3-' + size:10} {took:>10.1f} {schedule:9} "
                  f"{len(res.timeline.classes()):>6} {best:>8.3f} {best / 10:>9.3f}x "
                  f"{res.iteration_time:>12.3f} {max(res.bubble_fraction):>11.3f}")


if __name__ == "__main__":
    main()
