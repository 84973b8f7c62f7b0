"""Per-rank process state, swapped in and out at the hand-offs between rank threads.

Ranks run one at a time, so a rank's "process-global" state (torch's default CPU
generator, Python's and numpy's RNGs, the torch.distributed world, the launcher's
environment variables) can live in the real globals while the rank runs and be saved
when it yields. Hand-offs are rare (a rank runs until it blocks), so this costs far
less than intercepting every random op.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The module globals behind torch.distributed's notion of "this process's world".
_C10D_GLOBALS = ("_world", "_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config",
                 "_group_count", "_tags_to_pg", "_pg_to_tag", "_backend",
                 "_default_pg_init_method")


def derive_seed(seed: int, rank: int, stream: str = "torch") -> int:
    """A 63-bit seed that is a fixed function of (spawn seed, rank, stream)."""
    digest = hashlib.sha256(f"fakepg:{seed}:{rank}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def fresh_c10d_globals() -> dict[str, Any]:
    return {"_world": c10d._World(), "_pg_map": {}, "_pg_names": {}, "_pg_group_ranks": {},
            "_pg_backend_config": {}, "_group_count": 0, "_tags_to_pg": {}, "_pg_to_tag": {},
            "_backend": None, "_default_pg_init_method": None}


def capture_c10d_globals() -> dict[str, Any]:
    g = vars(c10d)
    return {k: g[k] for k in _C10D_GLOBALS if k in g}


def install_c10d_globals(values: dict[str, Any]) -> None:
    vars(c10d).update(values)


class ProcessState:
    """Everything a separate process would own, for one rank (or for the host)."""

    __slots__ = ("torch_rng", "py_rng", "np_rng", "env", "c10d")

    def __init__(self) -> None:
        self.torch_rng: torch.Tensor | None = None
        self.py_rng: Any = None
        self.np_rng: Any = None
        self.env: dict[str, str | None] = {}
        self.c10d: dict[str, Any] = {}

    @classmethod
    def for_rank(cls, rank: int, nprocs: int, seed: int, env: dict[str, str]) -> "ProcessState":
        st = cls()
        st.torch_rng = torch.Generator().manual_seed(derive_seed(seed, rank)).get_state()
        st.py_rng = random.Random(derive_seed(seed, rank, "python")).getstate()
        np = sys.modules.get("numpy")
        if np is not None:
            st.np_rng = np.random.RandomState(derive_seed(seed, rank, "numpy") % (1 << 32)).get_state()
        st.env = dict(env)
        st.c10d = fresh_c10d_globals()
        return st

    def save(self) -> None:
        """Copy the live globals into this state (the owner is about to yield)."""
        self.torch_rng = torch.default_generator.get_state()
        self.py_rng = random.getstate()
        np = sys.modules.get("numpy")
        if np is not None:
            self.np_rng = np.random.get_state()
        environ = os.environ
        self.env = {k: environ.get(k) for k in (self.env or ENV_KEYS)}  # the keys it swaps
        self.c10d = capture_c10d_globals()

    def install(self) -> None:
        """Make this state the live one (the owner is about to run)."""
        if self.torch_rng is not None:
            torch.default_generator.set_state(self.torch_rng)
        if self.py_rng is not None:
            random.setstate(self.py_rng)
        np = sys.modules.get("numpy")
        if np is not None and self.np_rng is not None:
            np.random.set_state(self.np_rng)
        environ = os.environ
        for k, v in self.env.items():
            if v is None:
                environ.pop(k, None)
            elif environ.get(k) != v:
                environ[k] = v
        if self.c10d:
            install_c10d_globals(self.c10d)
