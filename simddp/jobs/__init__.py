"""The user's configuration as the input (DESIGN point 22): a model from what the user has
(:func:`resolve_model`: a zoo name, a Hugging Face ``config.json``, a torchtitan flavor or a
shape) and a whole job from the config the user trains with (:func:`read_torchtitan`,
:func:`read_megatron`) — a :class:`Job`, with everything simddp does not model listed in
``Job.not_modelled``. See docs/configurations.md."""

from fakepg.lazy import lazy_names

from .job import AC_MODES, KNOBS, Job

# the readers build models with torch and the zoo: imported on first use (PEP 562), so a warm
# ``simddp whatif`` (simddp.jobs.cli with no job file) loads no torch
_LAZY = {"read_megatron": ".megatron", "read_torchtitan": ".torchtitan",
         **dict.fromkeys(("ModelScenario", "canonical_name", "resolve_model"), ".models")}

__all__ = ["Job", "KNOBS", "AC_MODES", "ModelScenario", "resolve_model", "canonical_name",
           "read_torchtitan", "read_megatron"]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
