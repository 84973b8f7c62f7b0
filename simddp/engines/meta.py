"""Running a training step on the meta device: shapes, dtypes and collectives real, no data.

What :func:`~simddp.engines.capture.capture` needs to run torch's real DDP and FSDP2 on meta
tensors on the fake cluster (``capture(..., device="meta")``). fakepg's collectives accept
meta tensors as they are: they are validated and matched as usual, traced with their bytes
from their shapes, and their ``execute`` runs torch's meta kernels, which move no data. What
torch itself does with data on the way is handled here, each for a stated reason:

* **DDP** is built with ``init_sync=False``: its constructor's parameter-shape check reads the
  all-gathered shapes back with ``.item()``, which a meta tensor cannot give. The capture
  records a later iteration, so nothing it records changes.
* **Copies from meta into real tensors are skipped** (:class:`MetaDataMode`): the Reducer's
  bucket rebuild broadcasts its bucket indices through a tensor on the parameters' device
  and copies them back to CPU. On meta nothing arrives, so each rank keeps the indices it
  computed itself — the same on every rank of an SPMD program, which is what rank 0's
  broadcast would have given.
* **FSDP2** (:func:`fsdp_on_meta`): ``fully_shard`` takes its device from the mesh (CPU) and
  refuses to train parameters still on meta. While capturing, FSDP2's device is the meta
  device (its unsharded parameters, all-gather and reduce-scatter buffers are meta; its
  stream and event handles are CPU's no-ops) and its meta-parameter check is off.

Not supported on meta: ``find_unused_parameters`` (the Reducer copies its used-parameter map
to CPU and reads it), and anything the program itself reads from data (``.item()``,
``.tolist()``, printing values).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaDataMode", "fsdp_on_meta", "DEVICES"]

DEVICES = ("cpu", "meta")
_COPY = torch.ops.aten.copy_.default


class MetaDataMode(TorchDispatchMode):
    """On a rank's thread while it runs on meta: a ``copy_`` from a meta tensor into a real
    one leaves the real one as it was (see the module docstring for why)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _COPY and args[1].is_meta and not args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


_FSDP = "torch.distributed.fsdp._fully_shard."


def _meta_device_handle(device_type: str = "cuda") -> Any:
    # FSDP2 asks torch.<device_type> for streams and events; the meta device has none, and
    # CPU's are no-ops: the order of the program is the order of its ops.
    return torch.cpu if device_type in ("meta", "cpu") else getattr(torch, device_type, None)


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """While active, FSDP2 (``fully_shard``) runs on meta parameters: its device is the meta
    device and it does not insist that parameters be materialised. Process-wide (FSDP2's
    module functions are patched), undone on exit."""
    patches: list[tuple[Any, str, Any]] = []
    fully_shard = importlib.import_module(_FSDP + "_fully_shard")
    param_group = importlib.import_module(_FSDP + "_fsdp_param_group")
    patches.append((fully_shard, "_get_device_from_mesh", lambda mesh: torch.device("meta")))
    for name in ("_fsdp_param_group", "_fsdp_collectives", "_fsdp_state"):
        mod = importlib.import_module(_FSDP + name)
        if hasattr(mod, "_get_device_handle"):
            patches.append((mod, "_get_device_handle", _meta_device_handle))
    patches.append((param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
