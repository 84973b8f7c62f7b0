"""Per-step synchronisation points: the host waiting for the device, and metric all-reduces.

A training loop that reads a value back every step — ``loss.item()`` for logging, a
``torch.cuda.synchronize()``, a metric's ``.cpu()`` — makes the host wait until the device has
run every kernel queued before it. The host normally runs ahead of the device, queueing
kernels; after a synchronisation the queue is empty, and the device idles while the host
launches the next kernel and the copy's completion travels back: one device→host copy and
one launch of exposed latency per point. simddp charges it as compute on the rank's stream,
shown as ``"sync"``: ``sync_points × sync_us``. The default ``sync_us`` is two of the
device's per-op overheads (the roofline presets' ``op_overhead_us``, 5 µs: the copy's
round trip and the relaunch), an order-of-magnitude figure — pass a measured one.

A metric all-reduce (``dist.all_reduce`` of a loss or an accuracy for logging, once per step)
is a real collective: it is added to the step program after the optimizer step and waited
for at once, so its cost is the network's latency-bound time for :data:`METRIC_BYTES`, and
it waits for the slowest rank — a per-step barrier.
"""

from __future__ import annotations

__all__ = ["DEFAULT_SYNC_US", "METRIC_BYTES", "sync_seconds"]

DEFAULT_SYNC_US = 2 * 5.0  # two per-op overheads of the device presets (simddp.models.devices)
METRIC_BYTES = 8  # e.g. a loss and a count in fp32


def sync_seconds(points: int, sync_us: float | None) -> float:
    """Seconds of ``points`` host synchronisations of ``sync_us`` µs each (None: the default)."""
    return points * (DEFAULT_SYNC_US if sync_us is None else sync_us) * 1e-6
