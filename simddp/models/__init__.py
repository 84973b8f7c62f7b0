"""Timing models: what a collective and an op cost, and the noise on those costs.

* :class:`NetworkModel` / :class:`ComputeModel`: the protocols both engines accept;
* :class:`Network`: NCCL's α–β model (flat or two-level), with calibration; its formulas in
  :mod:`~simddp.models.algorithms`, its named fabrics in :mod:`~simddp.models.presets`;
* :class:`Placement` / :class:`Tier`: where a communicator sits on a tiered fabric
  (:mod:`~simddp.models.placement`, one computation for every engine);
* :class:`Contention`: how a rank's communication slows its compute, and the fixed cost of
  issuing a collective (carried by a network model; replay applies it);
* :class:`MeasuredNetwork`: collective times interpolated from this machine's measurements;
* :class:`Compute`: kernel-efficiency (the default), roofline, per-op constant and
  profile-based compute models (:mod:`~simddp.models.compute`) on a GPU preset
  (:mod:`~simddp.models.devices`; :func:`gpu_spec` reads ``PRESET[,field=value...]``);
* :mod:`simddp.models.noise`: the seeded log-normal jitter both engines draw.
"""

from importlib import import_module as _import_module
from typing import Any as _Any

from . import noise
from .contention import Contention
from .measured import MeasuredNetwork
from .netspec import load_network_spec, parse_network
from .network import Network
from .placement import Placement, Tier
from .presets import PRESETS
from .protocols import ComputeModel, NetworkModel, collective_time

# the compute models and GPU presets import torch: loaded when first named, so replaying a
# capture (network models only) loads none of it
_LAZY = {
    **dict.fromkeys(("Compute", "ConstantCompute", "ProfileCompute", "RooflineCompute",
                     "ScaledCompute"), ".compute"),
    **dict.fromkeys(("DEVICES", "GPU_FIELDS", "DevicePreset", "gpu_spec"), ".devices"),
}

__all__ = ["NetworkModel", "ComputeModel", "collective_time", "Network", "MeasuredNetwork", "PRESETS",
           "parse_network", "load_network_spec", "Contention", "Compute",
           "DevicePreset", "DEVICES", "RooflineCompute", "ConstantCompute", "ProfileCompute",
           "ScaledCompute", "gpu_spec", "GPU_FIELDS", "noise", "Placement", "Tier"]


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
