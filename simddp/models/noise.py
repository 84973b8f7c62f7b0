"""Seeded timing noise: mean-1 log-normal factors, the one jitter both engines draw.

A factor with relative standard deviation ``jitter`` multiplies a cost; its mean is 1, so
jitter spreads times without biasing them. Every stream comes from a numpy ``Generator``
seeded by a ``SeedSequence`` (seed, spawn key), so reruns with one seed are identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["generator", "lognormal", "Stream", "BLOCK"]

BLOCK = 4096  # factors drawn at a time by a Stream


def generator(seed: int, *key: int) -> np.random.Generator:
    """The generator of stream ``key`` under ``seed`` (a SeedSequence spawn key)."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def lognormal(rng: np.random.Generator, jitter: float, size: Any) -> np.ndarray:
    """Mean-1 log-normal factors with relative standard deviation ``jitter``."""
    s2 = float(np.log1p(jitter * jitter))
    return rng.lognormal(-s2 / 2.0, np.sqrt(s2), size)


class Stream:
    """Factors one at a time, in draw order (drawn in blocks of :data:`BLOCK`): one per
    collective, in the order the engine decides their durations."""

    __slots__ = ("rng", "jitter", "block", "i")

    def __init__(self, rng: np.random.Generator, jitter: float) -> None:
        self.rng, self.jitter = rng, jitter
        self.block: list[float] = lognormal(rng, jitter, BLOCK).tolist()
        self.i = 0

    def next(self) -> float:
        i = self.i
        if i == BLOCK:
            self.block = lognormal(self.rng, self.jitter, BLOCK).tolist()
            i = 0
        self.i = i + 1
        return self.block[i]
