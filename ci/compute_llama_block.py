"""One Llama 3 8B block's forward + backward, costed per op kind by simddp's compute models.

The zoo's llama3-8b block (dim 4,096, 32 heads, 8 KV heads, SwiGLU 14,336, fused attention) on
the meta device at torchtitan's shapes (local batch 2 × 8,192 tokens, bf16), every aten op
charged by ``Compute.kernels`` (the default) and by the datasheet roofline at 100 %, summed by
kernel family (GEMM, attention, pointwise, other, views). This is the table a real H100 profile
of the same block is compared with (``torch.profiler``, kernel time grouped the same way).

    python ci/compute_llama_block.py                  # a few seconds
    python ci/compute_llama_block.py --gpu 'h100,tdp-W=500' --batch 2 --seq 8192
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


VERBOSE = False  # print every op (debugging)


class Tally(TorchDispatchMode):
    """Charges every aten op through each model and sums seconds per (model, phase, kind)."""

    def __init__(self, models: dict) -> None:
        super().__init__()
        self.models, self.phase = models, "forward"
        self.seconds: dict = collections.defaultdict(float)
        self.counts: dict = collections.defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from simddp.models.kernels import op_kind

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = op_kind(func)
        self.counts[(self.phase, kind)] += 1
        for name, model in self.models.items():
            t = model.op_time(func, args, kwargs, out)
            self.seconds[(name, self.phase, kind)] += t
            if VERBOSE and name == "kernels":
                print(f"  {self.phase} {func} {t * 1e3:.3f} ms",
                      [tuple(x.shape) for x in args if isinstance(x, torch.Tensor)])
        return out


def main(argv: list[str] | None = None) -> int:
    from fakepg.zoo.llama import LLAMA3_CONFIGS, TransformerBlock, rope_tables
    from simddp.models.compute import Compute
    from simddp.models.devices import gpu_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    a = p.parse_args(argv)
    import dataclasses

    args = dataclasses.replace(LLAMA3_CONFIGS["8b"], attention="sdpa")
    device = gpu_spec(a.gpu)
    models = {"kernels": Compute.kernels(device),
              "compile": Compute.kernels(device, compile=True),
              "roofline": Compute.roofline(device)}
    if device.fp8_tflops:
        models["compile+fp8"] = Compute.kernels(device, compile=True, float8=True)
    with torch.device("meta"):
        block = TransformerBlock(args).to(torch.bfloat16)
        x = torch.empty(a.batch, a.seq, args.dim, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rope_tables(args)
        cos, sin = cos[:a.seq], sin[:a.seq]
    from simddp.cosim.meta import fused_attention

    tally = Tally(models)
    with fused_attention("meta"), tally:  # SDPA as the flash kernel it is on a GPU
        y = block(x, cos, sin, None)
        tally.phase = "backward"
        y.backward(torch.empty_like(y))
    kinds = ["gemm", "attention", "pointwise", "other", "view"]
    print(f"Llama 3 8B block, {a.batch} × {a.seq} tokens, bf16, on {device.name} "
          f"(ms per block)")
    head = f"{'phase':9} {'kind':10} {'ops':>5} " + " ".join(f"{n:>12}" for n in models)
    print(head)
    for phase in ("forward", "backward"):
        for kind in kinds:
            n = tally.counts[(phase, kind)]
            if not n:
                continue
            row = " ".join(f"{tally.seconds[(m, phase, kind)] * 1e3:>12.3f}" for m in models)
            print(f"{phase:9} {kind:10} {n:>5} {row}")
    totals = {m: sum(v for (mm, _, _), v in tally.seconds.items() if mm == m) for m in models}
    print(f"{'total':9} {'':10} {sum(tally.counts.values()):>5} "
          + " ".join(f"{totals[m] * 1e3:>12.3f}" for m in models))
    # model FLOPs of the block (6 · params · tokens + attention's 12 · s · dim · tokens / 2)
    params = sum(p.numel() for p in block.parameters())
    tokens = a.batch * a.seq
    flops = 6 * params * tokens + 6 * a.seq * args.dim * tokens  # causal: half of 12·s·d
    print("MFU of the block (model FLOPs / time / dense bf16 peak): " + ", ".join(
        f"{m} {flops / totals[m] / (device.fp16_tflops * 1e12):.1%}" for m in models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
