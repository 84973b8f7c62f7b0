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

__all__ = ["integer", "real", "listed", "boolean", "hook", "cap", "size", "parallel_spec",
           "ac_policy", "dtype", "MAX_WORLD", "HELP_LISTINGS", "DTYPES"]

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
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def listed(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma-separated list of ``kind`` (one row per item)."""
    def parse(text: str) -> list[Any]:
        parts = [x.strip() for x in text.split(",")]
        if not text.strip() or any(not x for x in parts):
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list without "
                                             f"empty items")
        try:
            return [kind(x) for x in parts]
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return parse


def boolean(text: str) -> bool:
    """true/false, yes/no, on/off, 1/0."""
    t = text.strip().lower()
    if t in ("true", "yes", "on", "1"):
        return True
    if t in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"{text!r} is not a boolean: give true or false")


def hook(text: str) -> str | None:
    """A comm hook's name; none, no or - for none."""
    return None if text.lower() in ("none", "no", "-") else text


def cap(text: str) -> float | None:
    """A bucket cap in MB > 0; none or default for DDP's."""
    if text.lower() in ("none", "default"):
        return None
    return real(positive=True, what=" (MB), or none")(text)


def size(text: str) -> int:
    """Bytes: 4096, 4K, 1M, 1G (1 byte to 1T)."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    mult = _SUFFIX.get(t[-1:], 1)
    try:
        v = float(t[:-1] if t[-1:] in _SUFFIX else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, e.g. 4096, "
                                         f"4K, 1M or 1G") from None
    if not 1 <= v <= 1 << 40:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: give 1 byte to 1T")
    return int(v)



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
