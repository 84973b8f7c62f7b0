"""Contention between a rank's communication and its compute, and the fixed cost of issuing.

A :class:`Contention` rides on a network model (``Network(..., contention=...)``,
``MeasuredNetwork(..., contention=...)``, or the ``"contention"`` entry of a
``simddp calibrate --json`` file) and says two things the α–β model and the profile miss:

* ``slowdown`` (≥ 1): while one of a rank's collectives is in flight (between its start and its
  end), that rank's compute progresses at ``1 / slowdown`` of its rate: a compute segment of
  ``w`` seconds that overlaps communication for all of its length takes ``w · slowdown``.
  On CPU backends (gloo) the collective's own thread(s) take CPU from the training thread —
  on a machine with fewer cores than ranks × (compute + communication threads) they take turns —
  and ``simddp calibrate`` measures the factor: a compute kernel's time with all ranks computing,
  alone vs while a gloo all_reduce runs between the same processes
  (:func:`simddp.measure.measure_contention`). On GPUs the same form describes NCCL's
  kernels occupying SMs (one CTA per channel) and memory bandwidth while compute kernels run
  (the "overlapped-kernel slowdown" of Echo and Lumos); :meth:`Contention.sm_share` gives the
  SM-count form ``SMs / (SMs − channels)``. There is no default for GPUs: the one figure found,
  an NVIDIA developer-forum report (forums.developer.nvidia.com, "Compute-Communication Overlap
  Causes Severe GEMM Performance Degradation because of Tail Effect": on H100 a GEMM of one
  132-SM wave took ~2× beside an all_gather holding 24 SMs), is a worst case (a second wave),
  not a typical factor; so it is off unless measured.
* ``per_collective_us``: a fixed cost, on the issuing rank's compute stream, of every collective
  it issues (DDP's per-bucket work in the Reducer and the comm hook, the process group's call,
  the backend's enqueue or kernel launch): the rank's compute stops for that long before the
  collective is issued. On gloo ``simddp calibrate`` measures the time an async all_reduce
  call takes on the calling thread. For NCCL, :data:`NCCL_BASE_LATENCY_US` is NCCL's own fixed
  per-collective cost (``baseLat`` in ``src/graph/tuning.cc``).

Replay (:func:`simddp.replay.replay`) applies both. Co-simulation (:func:`simddp.simulate`)
does not apply contention yet: its ranks' clocks advance op by op under the compute model and
ignore the network's ``contention``.

>>> c = Contention(slowdown=2.0, per_collective_us=10.0)
>>> c.stretched(1e-3, overlapped=0.5e-3)      # 0.5 ms alone + 0.5 ms at half rate
0.0015
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from fakepg.arguments import number

__all__ = ["Contention", "NCCL_BASE_LATENCY_US", "as_contention"]

# NCCL src/graph/tuning.cc (2.12–2.2x): baseLat[Ring][Simple] = baseLat[Tree][Simple] = 8.4 µs
# ("Latencies in us"): the fixed part of every collective in NCCL's own cost model, beside the
# per-step hardware latency (hwLat) that simddp's α models. (2.3+ raise it to 17 µs; the
# LL protocols use 6.6–6.8 µs.)
NCCL_BASE_LATENCY_US = 8.4


@dataclass(frozen=True)
class Contention:
    """How a rank's communication slows its compute, and what issuing a collective costs it.

    slowdown: factor (≥ 1) on the duration of compute that overlaps one of the rank's own
        collectives in flight; 1 = no interference.
    per_collective_us: µs of the issuing rank's compute stream per collective it issues.
    source: where the figures come from (a measurement, a citation), shown by ``describe``.
    """

    slowdown: float = 1.0
    per_collective_us: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        number("Contention.slowdown", self.slowdown, minimum=1.0,
               hint="the factor compute slows by while communication runs; 1.0 = none")
        number("Contention.per_collective_us", self.per_collective_us, minimum=0,
               hint="microseconds of the issuing rank's compute per collective; 0 = none")

    @property
    def per_collective_s(self) -> float:
        return self.per_collective_us * 1e-6

    @property
    def active(self) -> bool:
        """Whether it changes anything (a replay with an inactive one is bitwise unchanged)."""
        return self.slowdown != 1.0 or self.per_collective_us != 0.0

    def stretched(self, work: float, overlapped: float) -> float:
        """Seconds that ``work`` seconds of compute take when ``overlapped`` seconds of that
        *work* run while communication is in flight."""
        return work + overlapped * (self.slowdown - 1.0)

    @classmethod
    def sm_share(cls, sms: int, channels: int, **kw: Any) -> "Contention":
        """The GPU form: NCCL runs one CTA per channel, each holding an SM, so compute keeps
        ``sms − channels`` of ``sms`` SMs while a collective runs: slowdown ``sms / (sms −
        channels)`` (an upper bound for kernels that fill every SM; memory-bound kernels lose
        bandwidth instead). E.g. ``Contention.sm_share(80, 8)`` for V100 and 8 channels."""
        if not 0 <= channels < sms:
            raise ValueError(f"Contention.sm_share: need 0 <= channels < sms, got "
                             f"sms={sms}, channels={channels}")
        kw.setdefault("source", f"SM share: {sms} SMs, {channels} NCCL channels")
        return cls(slowdown=sms / (sms - channels), **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Contention":
        """From :meth:`to_dict` or the ``"contention"`` entry of a ``simddp calibrate --json``
        file (extra keys, the raw measurements, are ignored)."""
        return cls(slowdown=float(d.get("slowdown", 1.0)),
                   per_collective_us=float(d.get("per_collective_us", 0.0)),
                   source=str(d.get("source", "")))

    def describe(self) -> dict[str, Any]:
        """Columns for sweep tables."""
        return {"contention_slowdown": self.slowdown,
                "per_collective_us": self.per_collective_us}


def as_contention(value: Any, owner: str) -> Contention | None:
    """``value`` as a :class:`Contention` (a mapping is read with :meth:`Contention.from_dict`),
    None kept; anything else is refused naming ``owner``."""
    if value is None or isinstance(value, Contention):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - {"slowdown", "per_collective_us", "source",
                                                 "measurements"})
        if unknown:
            raise ValueError(f"{owner}.contention: unknown field(s) {', '.join(unknown)}; the "
                             f"fields are slowdown (≥ 1), per_collective_us (≥ 0) and source")
        return Contention.from_dict(value)
    raise TypeError(f"{owner}.contention must be a simddp.models.Contention, a dict of its "
                    f"fields or None, got {value!r}")
