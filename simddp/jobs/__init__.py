"""The user's configuration as the input (DESIGN point 22): a model from what the user has
(:func:`resolve_model`: a zoo name, a Hugging Face ``config.json``, a torchtitan flavor or a
shape) and a whole job from the config the user trains with (:func:`read_torchtitan`,
:func:`read_megatron`) — a :class:`Job`, with everything simddp does not model listed in
``Job.not_modelled``. See docs/configurations.md."""

import importlib as _importlib
from typing import Any as _Any

from .job import AC_MODES, KNOBS, Job

# the readers build models with torch and the zoo: imported on first use (PEP 562), so a warm
# ``simddp whatif`` (simddp.jobs.cli with no job file) loads no torch
_LAZY = {"read_megatron": ".megatron", "read_torchtitan": ".torchtitan",
         **dict.fromkeys(("ModelScenario", "canonical_name", "resolve_model"), ".models")}

__all__ = ["Job", "KNOBS", "AC_MODES", "ModelScenario", "resolve_model", "canonical_name",
           "read_torchtitan", "read_megatron"]


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'simddp.jobs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
