"""DDP's own work at the device's cost, not at the calibrated model's.

``simddp whatif --step-time S`` scales the compute model by ``f = S / modelled`` so that one
rank's step *without DDP* takes S: the factor says how far the roofline is from the real
device on *this model's* kernels. DDP adds work of its own — the Reducer's copies of
gradients into and out of its buckets, the per-bucket division by the world size, its forward
bookkeeping — which the same capture charges with the same scaled model. That work is
proportional to the parameters (and to the number of buckets), not to the batch's compute,
so scaling it by ``f`` is wrong: at a small batch ``f`` is large (the roofline's per-op
overhead and bandwidth terms are tiny beside a slow measured step), and ResNet-50's 1-rank
DDP iteration came out 31 % above its no-DDP step at batch 8 (published DDP overhead on one
GPU: ~3 %, PyTorch's DDP benchmark, 0.097 s → 0.100 s).

:func:`device_cost` splits each phase of the captured DDP step into the plain step's part
(the model's compute: kept at the calibrated scale, so the 1-rank no-DDP step stays S) and
DDP's extra (everything the DDP step does beyond it: divided by ``f``, i.e. charged at the
uncalibrated device model — a copy at the device's memory bandwidth, a kernel at its launch
overhead). Phases: forward (DDP's pre-forward work), backward until the Reducer's
end-of-backward wait (bucket copy-in, division; interleaved with the model's backward, so the
segment's time axis is compressed linearly), after it (copy-out of the buckets: all DDP's),
before the optimizer step (all DDP's) and the step itself.

>>> device_cost(ddp=12.0, plain=10.0, factor=4.0)  # 10 s of the model + 2 s of DDP at ×4
10.5
"""

from __future__ import annotations

__all__ = ["device_cost", "split"]


def split(ddp: float, plain: float) -> tuple[float, float]:
    """(the plain step's part, DDP's extra) of a phase that took ``ddp`` seconds with DDP and
    ``plain`` without; the extra is never negative."""
    extra = max(0.0, ddp - plain)
    return ddp - extra, extra


def device_cost(ddp: float, plain: float, factor: float) -> float:
    """The phase's seconds with DDP's extra charged at the device's cost (÷ ``factor``)."""
    kept, extra = split(ddp, plain)
    return kept + extra / factor
