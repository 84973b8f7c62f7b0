"""Timing models: what a collective and an op cost, and the noise on those costs.

* :class:`NetworkModel` / :class:`ComputeModel`: the protocols both engines accept;
* :class:`Network`: NCCL's α–β model (flat or two-level), with presets and calibration;
* :class:`MeasuredNetwork`: collective times interpolated from this machine's measurements;
* :class:`Compute`: roofline, per-op constant and profile-based compute models;
* :mod:`simddp.models.noise`: the seeded log-normal jitter both engines draw.
"""

from . import noise
from .compute import (DEVICES, Compute, ConstantCompute, DevicePreset, ProfileCompute,
                      RooflineCompute, ScaledCompute)
from .measured import MeasuredNetwork
from .network import PRESETS, Network
from .protocols import ComputeModel, NetworkModel, collective_time

__all__ = ["NetworkModel", "ComputeModel", "collective_time", "Network", "MeasuredNetwork", "PRESETS", "Compute",
           "DevicePreset", "DEVICES", "RooflineCompute", "ConstantCompute", "ProfileCompute",
           "ScaledCompute", "noise"]
