"""What a what-if's options apply to: each layout's world sizes, the options a layout refuses
(named, with what they apply to: nothing is ignored in silence), activation checkpointing's
policies and the compute options a compute model must model (:func:`simddp.whatif.whatif`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .program.parallel import UsageError

__all__ = ["as_list", "fitting", "refuse_what_does_not_apply", "AC_POLICIES", "ac_policy",
           "with_options"]


def as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple, range)) else [v]


def fitting(spec: Any, worlds: list[int], say: Callable[[str], None]) -> tuple[Any, list[int]]:
    """The layout ``spec`` parses to and the world sizes it fits; a malformed spec raises its
    own reason, a spec no world fits raises every world's reason."""
    from .program.parallel import Parallel

    Parallel.fixed_world_size(spec)  # the grammar: its errors hold for every world size
    fits, reasons, par = [], {}, None
    for n in worlds:
        try:
            p = Parallel.parse(spec, n)
        except ValueError as e:
            say(f"{spec} at {n} ranks left out: {e}")
            reasons[n] = str(e)
            continue
        par = par or p
        fits.append(n)
    if not fits:
        why = "; ".join(f"{n} ranks: {r}" for n, r in reasons.items())
        raise UsageError(f"--parallel {spec}: no world size of {worlds} fits it ({why})")
    return par, fits


def refuse_what_does_not_apply(spec: Any, par: Any, given: Mapping[str, Any]) -> None:
    """Every option given applies to layout ``par``, or this raises naming the option, the
    layout and what it applies to (nothing is ignored in silence)."""
    def no(flag: str, applies: str) -> None:
        raise UsageError(f"--parallel {spec}: {flag} applies to {applies}, not to this layout")

    owner = par.owner().name
    fsdp = par.data in ("fsdp", "hsdp")
    if par.pp == 1:
        for flag in ("pp_schedule", "microbatches", "stages_per_rank"):
            if given.get(flag) is not None:
                no(f"--{flag.replace('_', '-')}", "pipeline layouts (pp:P,...)")
    if not fsdp:
        for flag in ("reshard_after_forward", "reduce_dtype"):
            if given.get(flag) is not None:
                no(f"--{flag.replace('_', '-')}", "FSDP2 layouts (fsdp, hsdp:S, dp, zero1-3, "
                   "distributed-optimizer)" + ("; DDP reduces in its comm hook's dtype "
                                                "(--comm-hook bf16)" if flag == "reduce_dtype"
                                                else ""))
        for flag in ("forward_prefetch", "backward_prefetch"):
            if given.get(flag) not in (None, 1):
                no(f"--{flag.replace('_', '-')}", "FSDP2 layouts")
    if owner != "ddp":
        for flag in ("bucket_cap_mb", "comm_hook"):
            if any(v is not None for v in as_list(given.get(flag))):
                no(f"--{flag.replace('_', '-')}", "DDP layouts (its Reducer's buckets)")
        if given.get("capture_ranks") not in (None, 1):
            no("--capture-ranks", "DDP layouts (the other layouts capture the mesh they need)")
    raf = given.get("reshard_after_forward")
    if par.reshard_after_forward is not None and raf is not None and \
            any(bool(r) != par.reshard_after_forward for r in as_list(raf)):
        raise UsageError(f"--parallel {spec}: {par.flavour} runs FSDP2 with "
                         f"reshard_after_forward={par.reshard_after_forward}; "
                         f"--reshard-after-forward {raf} contradicts it")
    if given.get("param_dtype") is not None and par.pp > 1 and not fsdp:
        no("--param-dtype", "pipelines with FSDP2 inside their stages (pp:P,fsdp:N or "
           "pp:P,dp:N: its MixedPrecisionPolicy)")
    if given.get("sequence_parallel") is False and par.tp == 1:
        no("--no-sequence-parallel", "layouts with tensor parallelism (tp:T)")
    if given.get("async_tp") and par.tp == 1:
        no("--async-tp", "layouts with tensor parallelism (tp:T)")


# activation checkpointing policies (torchtitan's): full, selective-op, selective-layer:N, none
AC_POLICIES = ("full", "selective-op", "selective-layer:N", "none")


def ac_policy(value: Any) -> str | None:
    """``activation_checkpointing`` as a policy name (None: none): True is "full" (the flag
    before policies existed), False/None/"none" none; a bad name lists the policies."""
    if value is None or value is False or value == "none":
        return None
    if value is True or value == "full":
        return "full"
    text = str(value).strip().lower()
    if text == "selective-op":
        return text
    name, _, every = text.partition(":")
    if name == "selective-layer" and every.isdigit() and int(every) >= 1:
        return f"selective-layer:{int(every)}"
    raise UsageError(f"activation checkpointing {value!r}: give one of "
                     f"{', '.join(AC_POLICIES)} (selective-layer:N checkpoints every N-th "
                     f"block, N ≥ 1)")


_OPTION_WORDS = {"compile": "torch.compile", "float8": "Float8 training",
                 "async_tp": "async tensor parallelism"}


def with_options(model: Any, **options: bool) -> Any:
    """``model`` with the options the user switched on (``compile``, ``float8``,
    ``async_tp``) applied through its ``with_options``; a model without one refuses them:
    an option is modelled or refused, never ignored."""
    on = {k: v for k, v in options.items() if v}
    if not on:
        return model
    apply = getattr(model, "with_options", None)
    if apply is None:
        raise UsageError(f"{', '.join('--' + k.replace('_', '-') for k in on)}: the compute model "
                         f"({type(model).__name__}) does not model "
                         f"{' or '.join(_OPTION_WORDS[k] for k in on)} yet, so simddp cannot "
                         f"answer for it")
    return apply(**on)
