"""Running a training step on the meta device: shapes, dtypes and collectives real, no data.

What :func:`~simddp.cosim.capture.capture` needs to run torch's real DDP and FSDP2 on meta
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
* **Functional collectives** (``torch.ops._c10d_functional``: what DTensor — tensor
  parallelism — issues) on meta tensors run their CPU kernel, which issues the collective on
  the rank's ProcessGroup with the meta tensors as FSDP2's collectives are issued: torch's
  Meta kernels for them (registered for tracing) return an output and issue nothing, and a
  capture would see no TP communication. They are never taken from the metadata cache.
  Their waits too, where this mode does not see them (:func:`functional_waits_on_meta`): an
  op on a pending ``AsyncCollectiveTensor`` (DTensor's async redistributions) waits for it
  inside its own dispatch, beneath the modes, where ``wait_tensor`` would reach its Meta
  kernel, which leaves the work in c10d's registry of the rank (torch warns of "unwaited
  collective calls" at exit). Multi-stage pipelines meet it: an embedding-only stage's output
  is waited for first by the pipeline's send.
* **FSDP2** (:func:`fsdp_on_meta`): ``fully_shard`` takes its device from the mesh (CPU) and
  refuses to train parameters still on meta. While capturing, FSDP2's device is the meta
  device (its unsharded parameters, all-gather and reduce-scatter buffers are meta; its
  stream and event handles are CPU's no-ops) and its meta-parameter check is off.
* **Pipelining** (:func:`pipelining_on_meta`): before its first step a ``PipelineStage`` votes
  with its neighbours on whether shapes must be inferred, in one-element tensors on the stage's
  device, and reads the result with ``.item()``. While capturing, the vote runs on CPU tensors
  (the same sends and receives, with data): it is control, not model data.

* **Fused attention** (:class:`FusedAttentionOnMeta`): ``F.scaled_dot_product_attention``
  on meta tensors would decompose into its math (the ``s × s`` scores in memory, as the
  written-out reference attention); on CPU and on a GPU it runs one fused kernel. On meta it
  runs the kernel CPU dispatches to (``aten._scaled_dot_product_flash_attention_for_cpu``,
  whose meta kernels torch registers), so a capture costs the same op on both devices. A
  torch-function mode is off while it handles ``backward``, so activation checkpointing's
  recomputation enters it again itself
  (:func:`~simddp.cosim.capture_fsdp.checkpoint_blocks`): it must save what the forward saved.

Not supported on meta: ``find_unused_parameters`` (the Reducer copies its used-parameter map
to CPU and reads it), and anything the program itself reads from data (``.item()``,
``.tolist()``, printing values).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from ..compat import (DispatchKey, DispatchKeySet, TorchDispatchMode, fsdp_meta_device_patches,
                      functional_collectives, functional_wait_tensor, len_torch_dispatch_stack,
                      pop_mode, push_mode)

__all__ = ["MetaDataMode", "FusedAttentionOnMeta", "fused_attention", "beneath_clock",
           "fsdp_on_meta", "pipelining_on_meta", "functional_waits_on_meta", "meta_scope",
           "in_meta_scope", "DEVICES"]

DEVICES = ("cpu", "meta")
T = TypeVar("T")
_COPY = torch.ops.aten.copy_.default


_Tensor = torch.Tensor
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_UNCACHED = object()


def _meta_key(func: Any, args: tuple, kwargs: dict) -> Any:
    """What a meta kernel's output metadata depends on: the op, each tensor argument's shape,
    strides, dtype and device, the other arguments. None: not cacheable (tensor subclasses,
    lists of tensors, tensors in kwargs)."""
    key: list[Any] = [func]
    for a in args:
        if isinstance(a, _Tensor):
            if a.__class__ not in _PLAIN:  # a subclass (DTensor) dispatches on its own
                return None
            key.append((a.shape, a.stride(), a.dtype, a.device.type))
        elif isinstance(a, (list, tuple)):  # sizes, dims: hashable as a tuple
            if any(isinstance(x, _Tensor) for x in a):
                return None
            key.append(("seq", *a))
        else:
            key.append(a)
    for k, v in kwargs.items():
        if isinstance(v, _Tensor):
            return None
        key.append((k, v))
    return tuple(key)


def _cacheable(func: Any) -> Any:
    """How an op's result can come from the cache: "new" (one fresh tensor), "self" (an
    in-place op returning its first argument), or None (views, aliases, several outputs,
    ``out=`` forms, ops that change metadata)."""
    schema = func._schema
    if func.namespace in _SIDE_EFFECTS:  # collectives: each call issues one
        return None
    if func.is_view or len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return None
    if func._overloadpacket in _META_CHANGING:
        return None
    alias = schema.returns[0].alias_info
    if alias is None:
        return "new" if not any(a.alias_info is not None and a.alias_info.is_write
                                for a in schema.arguments) else None
    first = schema.arguments[0].alias_info if schema.arguments else None
    if alias.is_write and first is not None and first.is_write \
            and func._overloadpacket.__name__.endswith("_"):
        return "self"
    return None


_aten = torch.ops.aten
# op namespaces whose ops do more than compute an output from their inputs' metadata: torch's
# functional collectives (DTensor's redistributions) issue a collective on every call
_SIDE_EFFECTS = frozenset({"_c10d_functional"})
# their kernel that issues the collective on the rank's ProcessGroup (the Meta kernel torch
# registers for tracing issues nothing)
_COLLECTIVE_KEYS = DispatchKeySet(DispatchKey.CPU)
_META_CHANGING = {_aten.resize_, _aten.set_, _aten.as_strided_, _aten.copy_,
                  _aten._local_scalar_dense, _aten.resize_as_, _aten.squeeze_,
                  _aten.unsqueeze_, _aten.transpose_, _aten.t_, _aten.swapdims_,
                  _aten.swapaxes_, _aten.detach_}


class MetaDataMode(TorchDispatchMode):
    """On a rank's thread while it runs on meta, beneath the rank's clock (which charges each
    op before it gets here):

    * a ``copy_`` from a meta tensor into a real one leaves the real one as it was (see the
      module docstring for why);
    * ops on meta tensors whose meta kernel torch writes in Python (elementwise ops through
      ``torch._refs``: about a millisecond each) get their output's metadata from a cache
      keyed by their inputs' metadata — every rank and iteration repeats the same ops, so
      only the first of each kind runs the kernel. Outputs are fresh meta tensors of the
      cached shape, strides and dtype (in-place ops return their first argument), exactly
      what the kernel returns, since meta kernels see nothing but metadata.

    ``cache`` may be shared by the ranks of one world (they run one at a time).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # no torch._disable_dynamo wrapper per call
        return False

    def __init__(self, cache: dict | None = None) -> None:
        super().__init__()
        self.cache: dict = {} if cache is None else cache
        self.kinds: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _COPY and args[1].is_meta and not args[0].is_meta:
            return args[0]
        if func.namespace in _SIDE_EFFECTS:  # see the module docstring
            return func.redispatch(_COLLECTIVE_KEYS, *args, **kwargs)
        kind = self.kinds.get(func, _UNCACHED)
        if kind is _UNCACHED:
            kind = self.kinds[func] = _cacheable(func)
        if kind is None or not args or not isinstance(args[0], _Tensor) or not args[0].is_meta:
            return func(*args, **kwargs)
        key = _meta_key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        try:
            hit = self.cache.get(key)
        except TypeError:  # an argument that does not hash
            return func(*args, **kwargs)
        if hit is not None:
            if kind == "self":
                return args[0]
            shape, stride, dtype = hit
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        out = func(*args, **kwargs)
        if isinstance(out, _Tensor) and out.is_meta and (kind == "new" or out is args[0]):
            self.cache[key] = (out.shape, out.stride(), out.dtype)
        return out


class FusedAttentionOnMeta(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on plain meta tensors (no mask, no dropout) as the
    fused kernel CPU runs, with its autograd (see the module docstring); elsewhere as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and \
                _fusable(*args, **kwargs):
            q, k, v = args[:3]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, bool(kwargs.get("is_causal", False)),
                scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def fused_attention(device: str) -> contextlib.AbstractContextManager:
    """:class:`FusedAttentionOnMeta` on the meta device (for code that runs a model outside
    :func:`meta_scope`, e.g. counting saved activations), nothing elsewhere."""
    return FusedAttentionOnMeta() if device == "meta" else contextlib.nullcontext()


def _fusable(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> bool:
    return (attn_mask is None and not dropout_p and not enable_gqa
            and all(type(t) in _PLAIN and t.is_meta for t in (q, k, v))
            and q.shape[1] == k.shape[1])


@contextlib.contextmanager
def beneath_clock(mode: TorchDispatchMode) -> Iterator[None]:
    """Enter ``mode`` under the dispatch mode on top of this thread's stack (the rank's
    clock, pushed when the rank started), so that the clock sees — and charges — every op
    before ``mode`` handles it."""
    if not len_torch_dispatch_stack():
        with mode:
            yield
        return
    top = pop_mode()
    try:
        with mode:
            push_mode(top)
            try:
                yield
            finally:
                pop_mode()
    finally:
        push_mode(top)


class _MetaStream(torch.cpu.Stream):
    """CPU's no-op stream whose ``record_event`` gives a (no-op) event, as a device stream's
    does: FSDP2 expects one on a non-CPU device (HSDP's all-reduce event)."""

    def record_event(self, event: Any = None) -> Any:  # type: ignore[override]
        return torch.cpu.Event() if event is None else event


class _MetaDeviceHandle:
    """``torch.cpu`` with :class:`_MetaStream` streams: what FSDP2 uses as the meta device's
    ``torch.<device_type>`` module."""

    Stream = _MetaStream

    def __init__(self) -> None:
        self._stream = _MetaStream()

    def current_stream(self, device: Any = None) -> _MetaStream:
        return self._stream

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


_META_HANDLE = _MetaDeviceHandle()


def _meta_device_handle(device_type: str = "cuda") -> Any:
    # FSDP2 asks torch.<device_type> for streams and events; the meta device has none, and
    # CPU's are no-ops: the order of the program is the order of its ops.
    if device_type == "meta":
        return _META_HANDLE
    return torch.cpu if device_type == "cpu" else getattr(torch, device_type, None)


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """While active, FSDP2 (``fully_shard``) runs on meta parameters: its device is the meta
    device and it does not insist that parameters be materialised. Process-wide (FSDP2's
    module functions are patched), undone on exit."""
    patches = fsdp_meta_device_patches(lambda mesh: torch.device("meta"), _meta_device_handle)
    with _patched(patches):
        yield


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """``setattr`` each (object, name, value) while active; undone on exit."""
    patches = [(obj, name, value) for obj, name, value in patches if hasattr(obj, name)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


@contextlib.contextmanager
def functional_waits_on_meta() -> Iterator[None]:
    """While active, the wait ``AsyncCollectiveTensor`` issues for a meta tensor runs
    ``wait_tensor``'s CPU kernel, as the collective ran its own (see the module docstring):
    it unregisters the rank's work wherever it is dispatched. Process-wide (torch's
    ``_functional_collectives.wait_tensor``, which ``AsyncCollectiveTensor`` calls, is
    patched), undone on exit."""
    funcol = functional_collectives()

    wait = funcol.wait_tensor

    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:
            return _WAIT.redispatch(_COLLECTIVE_KEYS, tensor)
        return wait(tensor)
    with _patched([(funcol, "wait_tensor", wait_tensor)]):
        yield


_WAIT = functional_wait_tensor


def _on_cpu(method: Any) -> Any:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        device, self.device = self.device, torch.device("cpu")
        try:
            return method(self, *args, **kwargs)
        finally:
            self.device = device
    return run


@contextlib.contextmanager
def pipelining_on_meta() -> Iterator[None]:
    """While active, a meta-device ``PipelineStage``'s warm-up vote runs on CPU tensors (see
    the module docstring). Process-wide (the stage class is patched), undone on exit."""
    from torch.distributed.pipelining.stage import PipelineStage

    with _patched([(PipelineStage, name, _on_cpu(getattr(PipelineStage, name)))
                   for name in ("_warmup_forward_vote", "_warmup_backward_result")
                   if hasattr(PipelineStage, name)]):
        yield


def in_meta_scope(device: str, fn: Callable[[int], T]) -> Callable[[int], T]:
    """``fn`` as each rank of one world runs it: under :func:`meta_scope` on ``device``, the
    ranks sharing one cache."""
    cache: dict = {}

    def run(rank: int) -> T:
        with meta_scope(device, cache):
            return fn(rank)
    return run


def meta_scope(device: str, cache: dict) -> contextlib.AbstractContextManager:
    """What a rank of a capture on ``device`` runs under: on the meta device, meta kernels'
    output metadata cached beneath its clock (:class:`MetaDataMode`, ``cache`` shared by the
    ranks); elsewhere nothing."""
    if device == "meta":
        stack = contextlib.ExitStack()
        stack.enter_context(FusedAttentionOnMeta())
        stack.enter_context(beneath_clock(MetaDataMode(cache)))
        return stack
    return contextlib.nullcontext()
