"""The command line's argument types: each value is checked where it is parsed, so a bad one
is a usage error (exit status 2, one line naming the flag, the value and the accepted range),
never a traceback later. Nothing here imports torch: ``simddp --help`` stays fast.

Also the static listings ``whatif --help`` prints (:data:`HELP_LISTINGS`): the zoo and the
presets live in modules that import torch, so help reads these tables;
``tests/test_simddp_cli_light.py`` checks they equal the registries.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

__all__ = ["integer", "real", "parallel_spec", "ac_policy", "dtype", "MAX_WORLD",
           "HELP_LISTINGS", "DTYPES"]

# the largest world simddp replays: 2**24 ranks (the vectorised engine's arrays per rank)
MAX_WORLD = 1 << 24
DTYPES = ("bf16", "fp16", "fp32")


def _fail(text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(text)


def integer(lo: int, hi: int | None = None, what: str = "") -> Callable[[str], int]:
    """An int from ``lo`` to ``hi`` (None: no upper bound)."""
    rng = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise _fail(f"{text!r} is not an integer: give {rng}{what}") from None
        if v < lo or (hi is not None and v > hi):
            raise _fail(f"{v} is out of range: give {rng}{what}")
        return v
    parse.__name__ = "integer"
    return parse


def real(lo: float = 0.0, hi: float | None = None, *, positive: bool = False,
         what: str = "") -> Callable[[str], float]:
    """A finite float, ``> 0`` with ``positive`` else ``>= lo``, at most ``hi``."""
    bound = "> 0" if positive else f">= {_num(lo)}"
    rng = f"a number {bound}" + (f" and <= {_num(hi)}" if hi is not None else "")

    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise _fail(f"{text!r} is not a number: give {rng}{what}") from None
        if not math.isfinite(v) or (v <= 0 if positive else v < lo) or \
                (hi is not None and v > hi):
            raise _fail(f"{text.strip()} is out of range: give {rng}{what}")
        return v
    parse.__name__ = "number"
    return parse


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def parallel_spec(text: str) -> str:
    """A ``--parallel`` spec whose grammar is right (names, sizes, no dimension twice, no
    reserved name); whether it fits a world size is checked against each."""
    from .program.parallel import Parallel

    try:
        Parallel.fixed_world_size(text)
    except ValueError as e:
        raise _fail(str(e)) from None
    return text


def ac_policy(text: str) -> str:
    """``--activation-checkpointing``: full, selective-op, selective-layer:N or none."""
    t = text.strip().lower()
    name, _, every = t.partition(":")
    if t in ("full", "selective-op", "none") or (name == "selective-layer" and every.isdigit()
                                                 and int(every) >= 1):
        return t
    raise _fail(f"{text!r}: give full, selective-op, selective-layer:N (every N-th block, "
                f"N >= 1) or none")


def dtype(text: str) -> str:
    t = text.strip().lower()
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}
    t = aliases.get(t, t)
    if t not in DTYPES:
        raise _fail(f"{text!r}: give one of {', '.join(DTYPES)}")
    return t


# what `whatif --help` lists (tests/test_simddp_cli_light.py checks these equal the registries)
HELP_LISTINGS: dict[str, tuple[str, ...]] = {
    "zoo scenarios": ("mlp", "many_small_few_large", "grad_order_differs",
                      "grad_order_differs_per_rank", "rank_dependent_unused", "tied_weights",
                      "buffers", "sparse_embedding", "mixed_dtypes", "transformer_block",
                      "param_order", "uneven_inputs"),
    "benchmark workloads (--batch-size applies)": (
        "resnet50", "resnet101", "resnext101_32x4d", "vgg16", "alexnet", "inception_v3",
        "bert_base", "bert_large", "gpt2", "gpt2_medium", "llama3-8b", "llama3-70b",
        "llama3-405b", "llama3-tiny"),
    "networks (--network; or a `simddp calibrate --json` file)": (
        "nvlink", "ib-hdr", "ib-ndr", "100gbe", "400gbe", "gloo-loopback", "dgx1-p100",
        "dgx1-v100", "dgx-a100", "dgx-h100", "dgx-b200", "pcie-server", "dgx-superpod",
        "llama3-roce"),
    "compute (--gpu PRESET[,field=value...], the kernel-efficiency model)": (
        "v100", "a100", "a100-40gb", "h100", "h100-pcie", "h200", "b200", "mi300x", "l40s",
        "cpu"),
}
