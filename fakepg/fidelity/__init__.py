"""Fidelity: what makes the fake world behave like the backend a program asked for.

Backend personalities and their refusals (:mod:`.backends`), NCCL's and gloo's hazards
(:mod:`.nccl_hazards`, :mod:`.gloo_hazards`) — each check a
:class:`~fakepg.world.checks.Checker` the world runs from its list — DDP's own checks
(:mod:`.ddp_checks`), torch.distributed entry points replaced while a world runs
(:mod:`.patches`; torch's own, captured once: :mod:`.originals`), stores (:mod:`.store`),
per-rank profiler sessions (:mod:`.profiling`) and CPU shims (:mod:`.compat`).
"""
