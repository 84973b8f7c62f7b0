"""Fidelity: what makes the fake world behave like the backend a program asked for.

Backend personalities and refusals (:mod:`.backends`), NCCL's and gloo's hazards
(:mod:`.nccl_hazards`, :mod:`.gloo_hazards`), DDP's own checks (:mod:`.ddp_checks`),
torch.distributed entry points replaced while a world runs (:mod:`.patches`), stores
(:mod:`.store`), per-rank profilers (:mod:`.profiling`) and CPU shims (:mod:`.compat`).
"""
