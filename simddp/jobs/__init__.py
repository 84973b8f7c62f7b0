"""The user's configuration as the input (DESIGN point 22): a model from what the user has
(:func:`resolve_model`: a zoo name, a Hugging Face ``config.json``, a torchtitan flavor or a
shape) and a whole job from the config the user trains with (:func:`read_torchtitan`,
:func:`read_megatron`) — a :class:`Job`, with everything simddp does not model listed in
``Job.not_modelled``. See docs/configurations.md."""

from .job import AC_MODES, KNOBS, Job
from .megatron import read_megatron
from .models import ModelScenario, canonical_name, resolve_model
from .torchtitan import read_torchtitan

__all__ = ["Job", "KNOBS", "AC_MODES", "ModelScenario", "resolve_model", "canonical_name",
           "read_torchtitan", "read_megatron"]
