"""Compute cost models: how long one aten op takes on a rank, in seconds.

A per-rank ``TorchDispatchMode`` calls ``model.op_time(func, args, kwargs, out)`` for every aten
op it sees (after autograd, after composite ops such as ``linear`` were decomposed into ``t`` +
``addmm``). Three models::

    >>> import torch
    >>> a = torch.ones(256, 256)
    >>> mm = torch.ops.aten.mm.default
    >>> Compute.constant(1e-5).op_time(mm, (a, a), {}, a @ a)
    1e-05
    >>> h100 = Compute.roofline("h100")             # max(FLOPs/peak, bytes/bandwidth) + overhead
    >>> h100.op_time(mm, (a, a), {}, a @ a) > 0
    True
    >>> Compute.from_profile({"aten::mm": 2e-4}).op_time(mm, (a, a), {}, a @ a)
    0.0002

``op_time`` runs for every op on every rank, so each model caches what it can per ``func``.
Thread-safe for concurrent readers (caches only ever gain entries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.utils.flop_counter import (flop_registry, sdpa_backward_flop_count, sdpa_flop_count,
                                      shape_wrapper)

from fakepg.arguments import number

from .devices import ALIASES, DEVICES, GPU_FIELDS, DevicePreset, gpu_spec
from .kernels import Kernels, attention_flops, moves_no_data, op_kind

# the GPU presets (DevicePreset, DEVICES, GPU_FIELDS, gpu_spec) are simddp.models.devices';
# named here too, as before they had a module of their own
__all__ = ["Compute", "DevicePreset", "DEVICES", "RooflineCompute", "ConstantCompute",
           "ProfileCompute", "ScaledCompute", "gpu_spec", "GPU_FIELDS", "op_kind"]

_Tensor = torch.Tensor
_aten = torch.ops.aten


_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: 0).__code__


def _shapes(x: Any) -> Any:
    if isinstance(x, _Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x) if type(x) in (list, tuple) else x
    return x


def _causal(flops: int, causal: bool) -> float:
    return flops / 2 if causal else flops  # a fused causal kernel skips the masked half


# CPU's fused attention kernels (what F.scaled_dot_product_attention runs on CPU, and on the
# meta device in a capture: simddp.cosim.meta), costed as torch's formulas cost the GPU's
_EXTRA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda args, kwargs, out: _causal(sdpa_flop_count(
            args[0].shape, args[1].shape, args[2].shape),
            bool(args[4] if len(args) > 4 else kwargs.get("is_causal", False))),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda args, kwargs, out: _causal(sdpa_backward_flop_count(
            args[0].shape, args[1].shape, args[2].shape, args[3].shape),
            bool(args[7] if len(args) > 7 else kwargs.get("is_causal", False))),
}


def _flop_formula(func: Any) -> Any:
    """FlopCounterMode's formula for func as f(args, kwargs, out) -> FLOPs, or None.

    Most formulas are wrapped by flop_counter.shape_wrapper, whose pytree walk costs ~10 µs a
    call; we call the formula underneath with shapes we extract ourselves (~1 µs).
    """
    packet = getattr(func, "_overloadpacket", None)
    extra = _EXTRA_FORMULAS.get(packet)
    if extra is not None:
        return extra
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    raw = getattr(formula, "__wrapped__", None)
    if raw is not None and getattr(formula, "__code__", None) is _SHAPE_WRAPPER_CODE:
        return lambda args, kwargs, out: raw(
            *[_shapes(a) for a in args], out_shape=_shapes(out),
            **{k: _shapes(v) for k, v in kwargs.items()})
    return lambda args, kwargs, out: formula(*args, **kwargs, out_val=out)


def _op_name(func: Any) -> str:
    """'aten::mm' for aten.mm.default: the name torch.profiler records."""
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


def _nbytes(t: _Tensor) -> int:
    """Bytes a tensor occupies: for sparse layouts, what it stores (values and indices)."""
    if t.layout is torch.strided:
        return t.nbytes
    if t.layout is torch.sparse_coo:
        return t._values().nbytes + t._indices().nbytes
    return t.values().nbytes


def _bytes_and_dtype(args: Any, kwargs: Mapping[str, Any], out: Any) -> tuple[int, Any]:
    """Sum of bytes of tensor inputs (one level of lists) and outputs; dtype of the first."""
    total, dtype = 0, None
    for a in args:
        if isinstance(a, _Tensor):
            total += _nbytes(a)
            if dtype is None:
                dtype = a.dtype
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, _Tensor):
                    total += _nbytes(x)
                    if dtype is None:
                        dtype = x.dtype
    for k, a in kwargs.items():
        if isinstance(a, _Tensor) and k != "out":  # out= is counted once, as the output
            total += _nbytes(a)
            if dtype is None:
                dtype = a.dtype
    if isinstance(out, _Tensor):
        total += _nbytes(out)
        if dtype is None:
            dtype = out.dtype
    elif isinstance(out, (list, tuple)):
        for x in out:
            if isinstance(x, _Tensor):
                total += _nbytes(x)
    return total, dtype


class Compute:
    """A compute cost model. Build one with :meth:`roofline`, :meth:`constant` or
    :meth:`from_profile`; the simulator calls :meth:`op_time` for every aten op."""

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        """Seconds that op ``func`` (an ``torch._ops.OpOverload``) takes on these inputs/output."""
        raise NotImplementedError

    @staticmethod
    def roofline(device: str | DevicePreset = "cpu", *, peak_tflops: float | None = None,
                 mem_bandwidth_GBps: float | None = None, efficiency: float = 1.0,
                 op_overhead_us: float | None = None) -> RooflineCompute:
        """time = max(FLOPs / (peak·efficiency), bytes / (bandwidth·efficiency)) + overhead.

        FLOPs come from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
        attention; every other op counts 0 FLOPs), bytes are the nbytes of all tensor inputs and
        outputs, the peak is picked by the dtype of the op's first tensor. Views and other ops
        that move no data cost only the overhead: they still go through the dispatcher.
        ``device`` is "cpu", "v100", "a100", "h100", "b200" or a :class:`DevicePreset`; ``peak_tflops``
        (all dtypes), ``mem_bandwidth_GBps`` and ``op_overhead_us`` override the preset.
        """
        return RooflineCompute(device, peak_tflops=peak_tflops,
                               mem_bandwidth_GBps=mem_bandwidth_GBps, efficiency=efficiency,
                               op_overhead_us=op_overhead_us)

    @staticmethod
    def kernels(device: str | DevicePreset = "a100", *, compile: bool = False,
                float8: bool = False, attention: str | None = None,
                efficiency: str = "kernels", peak_tflops: float | None = None,
                mem_bandwidth_GBps: float | None = None,
                op_overhead_us: float | None = None) -> RooflineCompute:
        """The default compute model: each op at the fraction of peak that real kernels reach
        on ``device`` (:mod:`simddp.models.kernels`): GEMMs by shape, fused attention by
        sequence length and head dimension, memory-bound ops at achieved bandwidth, a launch
        cost per kernel and a host cost per op (the larger of device and host time), tensor
        clocks under the card's power limit.

        ``device``: a preset name or a :func:`gpu_spec` string (``"h100,tdp-W=500"``) or a
        :class:`DevicePreset`. ``compile``: torch.compile fuses pointwise chains (a third of
        their traffic and launches remain); ``float8``: GEMMs on the FP8 tensor cores with
        torchao's casts; ``attention``: "fa2" (PyTorch's flash backend, default) or "cudnn";
        ``efficiency="peak"``: every fraction 1 and no launch cost (a study's datasheet bound).
        ``peak_tflops``, ``mem_bandwidth_GBps`` and ``op_overhead_us`` override the preset.

        >>> Compute.kernels("h100,tdp-W=500", compile=True)
        Compute.kernels('h100,tdp-W=500', compile=True)
        """
        return RooflineCompute(gpu_spec(device), peak_tflops=peak_tflops,
                               mem_bandwidth_GBps=mem_bandwidth_GBps,
                               op_overhead_us=op_overhead_us,
                               kernels=dict(compile=compile, float8=float8,
                                            attention=attention, efficiency=efficiency))

    @staticmethod
    def constant(seconds_per_op: float) -> ConstantCompute:
        """Every op, views included, costs ``seconds_per_op``: the simplest model, for tests."""
        return ConstantCompute(seconds_per_op)

    @staticmethod
    def from_profile(profile: Any, *, fallback: Compute | None = None) -> ProfileCompute:
        """Measured mean time per call of each op, from a real run.

        ``profile`` is a finished ``torch.profiler.profile``, its ``key_averages()``, or a mapping
        {"aten::mm": seconds per call}. Ops missing from it cost what ``fallback`` says
        (default ``Compute.roofline("cpu")``). See :class:`ProfileCompute` for which time is used.
        """
        return ProfileCompute(profile, fallback=fallback)

    def scaled(self, factor: float) -> ScaledCompute:
        """This model with every op's time multiplied by ``factor``: how a model is calibrated
        to one measured step time (``simddp whatif --step-time``).

        >>> Compute.constant(1e-5).scaled(2.0).op_time(None, (), {}, None)
        2e-05
        """
        return ScaledCompute(self, factor)


class ConstantCompute(Compute):
    def __init__(self, seconds_per_op: float) -> None:
        self.seconds_per_op = number("seconds_per_op", seconds_per_op, minimum=0,
                                    hint="give the cost of one op in seconds, e.g. 1e-5")

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        return self.seconds_per_op

    def __repr__(self) -> str:
        return f"Compute.constant({self.seconds_per_op!r})"


class ScaledCompute(Compute):
    """``inner``'s op times × ``factor`` (see :meth:`Compute.scaled`)."""

    def __init__(self, inner: Any, factor: float) -> None:
        self.inner = inner
        self.factor = number("factor", factor, positive=True,
                             hint="give the ratio of wanted to modelled time, e.g. 1.5")

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        return self.factor * self.inner.op_time(func, args, kwargs, out)

    def __repr__(self) -> str:
        return f"{self.inner!r}.scaled({self.factor!r})"


class RooflineCompute(Compute):
    """:meth:`Compute.roofline` (``kernels`` None) and :meth:`Compute.kernels` (``kernels``: the
    :class:`~simddp.models.kernels.Kernels` options). One class, so the simulator's per-op memo
    (costs keyed by shapes, dtypes and scalars) serves both."""

    def __init__(self, device: str | DevicePreset = "cpu", *, peak_tflops: float | None = None,
                 mem_bandwidth_GBps: float | None = None, efficiency: float = 1.0,
                 op_overhead_us: float | None = None,
                 kernels: Mapping[str, Any] | None = None) -> None:
        if isinstance(device, str):
            try:
                device = DEVICES[ALIASES.get(device.lower(), device.lower())]
            except KeyError:
                raise ValueError(f"unknown device preset {device!r}; known: "
                                 f"{', '.join(DEVICES)}, or pass a DevicePreset(...)") from None
        self.device = device
        self.peak_tflops = None if peak_tflops is None else number(
            "peak_tflops", peak_tflops, positive=True,
            hint="give the device's peak in TFLOP/s, e.g. 19.5")
        self.mem_bandwidth_GBps = number(
            "mem_bandwidth_GBps",
            device.mem_bandwidth_GBps if mem_bandwidth_GBps is None else mem_bandwidth_GBps,
            positive=True, hint="give the memory bandwidth in GB/s, e.g. 2039")
        self.efficiency = number("efficiency", efficiency, positive=True,
                                 hint="give the achieved fraction of peak, in (0, 1]")
        if self.efficiency > 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}: it is the "
                             "fraction of peak FLOP/s and bandwidth that ops achieve")
        self.op_overhead_us = number(
            "op_overhead_us", device.op_overhead_us if op_overhead_us is None else op_overhead_us,
            minimum=0, hint="give the fixed cost per op in microseconds, e.g. 5")
        self._overhead_s = self.op_overhead_us * 1e-6
        self._s_per_byte = 1.0 / (self.mem_bandwidth_GBps * 1e9 * self.efficiency)
        self._flops_per_s: dict[Any, float] = {}
        self._ops: dict[Any, tuple[bool, Any]] = {}  # func -> (moves no data, FLOP formula)
        self.kernel_options = dict(kernels) if kernels is not None else None
        self._kernels: Kernels | None = None
        if kernels is not None:
            if self.efficiency != 1.0:
                raise ValueError("Compute.kernels takes efficiency='kernels' or 'peak', not a "
                                 "number: the fractions come from the kernel tables")
            k_device = device
            overrides = {}
            if mem_bandwidth_GBps is not None:
                overrides["mem_bandwidth_GBps"] = self.mem_bandwidth_GBps
            if op_overhead_us is not None:
                overrides["op_overhead_us"] = self.op_overhead_us
            if overrides:
                k_device = replace(device, **overrides)
            self._kernels = Kernels(k_device, **kernels)
            self._kops: dict[Any, tuple[str, Any]] = {}  # func -> (kind, FLOP formula)

    def flops_per_second(self, dtype: torch.dtype | None) -> float:
        rate = self._flops_per_s.get(dtype)
        if rate is None:
            tflops = self.peak_tflops if self.peak_tflops is not None else \
                self.device.peak_tflops(dtype if dtype is not None else torch.float32)
            rate = self._flops_per_s[dtype] = tflops * 1e12 * self.efficiency
        return rate

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        if self._kernels is not None:
            return self._kernel_time(func, args, kwargs, out)
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = (
                moves_no_data(func), _flop_formula(func))
        no_data, formula = info
        if no_data:
            return self._overhead_s
        nbytes, dtype = _bytes_and_dtype(args, kwargs, out)
        seconds = nbytes * self._s_per_byte
        if formula is not None:
            try:
                flops = formula(args, kwargs, out)
            except Exception:  # a formula that cannot read these args: count no FLOPs
                flops = 0
            seconds = max(seconds, flops / self.flops_per_second(dtype))
        return seconds + self._overhead_s

    def _kernel_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        info = self._kops.get(func)
        if info is None:
            kind = op_kind(func)
            formula = (lambda a, kw, o, f=func: attention_flops(f, a, kw)) \
                if kind == "attention" else _flop_formula(func)
            info = self._kops[func] = (kind, formula)
        kind, formula = info
        if kind == "view":
            return self._kernels.view_s
        nbytes, dtype = _bytes_and_dtype(args, kwargs, out)
        flops = 0
        if formula is not None:
            try:
                flops = formula(args, kwargs, out)
            except Exception:  # a formula that cannot read these args: count no FLOPs
                flops = 0
        peak = self.flops_per_second(dtype)
        return self._kernels.op_time(func, args, kwargs, out, kind, flops, nbytes, dtype, peak)

    def __repr__(self) -> str:
        if self._kernels is not None:
            name = self.device.name
            dev = repr(name) if self.device is DEVICES.get(name) or "," in name \
                else repr(self.device)
            opts = "".join(f", {k}={v!r}" for k, v in self.kernel_options.items()
                           if v != {"compile": False, "float8": False, "attention": None,
                                    "efficiency": "kernels"}[k])
            for k in ("peak_tflops", "mem_bandwidth_GBps", "op_overhead_us"):
                if k == "peak_tflops" and self.peak_tflops is not None:
                    opts += f", peak_tflops={self.peak_tflops!r}"
                elif k == "mem_bandwidth_GBps" and \
                        self.mem_bandwidth_GBps != self.device.mem_bandwidth_GBps:
                    opts += f", mem_bandwidth_GBps={self.mem_bandwidth_GBps!r}"
                elif k == "op_overhead_us" and self.op_overhead_us != self.device.op_overhead_us:
                    opts += f", op_overhead_us={self.op_overhead_us!r}"
            return f"Compute.kernels({dev}{opts})"
        dev = repr(self.device.name) if self.device is DEVICES.get(self.device.name) \
            else repr(self.device)
        peak = "" if self.peak_tflops is None else f", peak_tflops={self.peak_tflops!r}"
        return (f"Compute.roofline({dev}{peak}, mem_bandwidth_GBps={self.mem_bandwidth_GBps!r}, "
                f"efficiency={self.efficiency!r}, op_overhead_us={self.op_overhead_us!r})")


class ProfileCompute(Compute):
    """Per-op mean time per call measured by torch.profiler, keyed by op name ("aten::mm").

    The time of an op is its *inclusive* time (``device_time_total`` where the profile has
    device time for it, else ``cpu_time_total``) divided by its call count — not its self time:
    the dispatch mode sees only top-level ops (``aten::relu``, never the ``aten::clamp_min``
    it calls), so an op's charge must include the children the mode never sees.
    Warm up before profiling: first calls are slow.
    """

    def __init__(self, profile: Any, *, fallback: Compute | None = None) -> None:
        self.table: dict[str, float] = _mean_times(profile)
        self.fallback: Compute = Compute.roofline("cpu") if fallback is None else fallback
        self._ops: dict[Any, float | None] = {}

    def op_time(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> float:
        try:
            seconds = self._ops[func]
        except KeyError:
            seconds = self._ops[func] = self.table.get(_op_name(func))
        if seconds is None:
            return self.fallback.op_time(func, args, kwargs, out)
        return seconds

    def __repr__(self) -> str:
        top = sorted(self.table.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{k!r}: {v:.3g}" for k, v in top)
        more = ", ..." if len(self.table) > len(top) else ""
        return (f"Compute.from_profile({{{shown}{more}}} ({len(self.table)} ops, s/call), "
                f"fallback={self.fallback!r})")


def _mean_times(profile: Any) -> dict[str, float]:
    if isinstance(profile, Mapping):
        table = {}
        for name, seconds in profile.items():
            table[str(name)] = number(f"profile[{name!r}]", seconds, minimum=0,
                                        hint="give seconds per call")
        return table
    # a profile object averages itself; an EventList (key_averages() or events()) is used as is
    events = profile if isinstance(profile, list) or not hasattr(profile, "key_averages") \
        else profile.key_averages()
    try:
        events = list(events)
    except TypeError:
        raise TypeError(f"from_profile needs a torch.profiler.profile, its key_averages() or a "
                        f"{{op name: seconds}} mapping, got {type(profile).__name__}") from None
    if events and not hasattr(events[0], "cpu_time_total"):
        raise TypeError(f"from_profile: entries of type {type(events[0]).__name__} are not "
                        "profiler events; pass profile.key_averages()")
    totals: dict[str, list[float]] = {}  # name -> [total µs, calls]
    for e in events:
        device_us = getattr(e, "device_time_total", 0) or 0
        us = device_us if device_us > 0 else e.cpu_time_total
        acc = totals.setdefault(e.key, [0.0, 0])
        acc[0] += us
        acc[1] += getattr(e, "count", 1)
    return {name: us * 1e-6 / calls for name, (us, calls) in totals.items() if calls > 0}
