"""Per-rank values stored per class of identical ranks: a compact, read-only sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PerRank"]


class PerRank(Sequence):
    """``values[rank_class[r]]`` for every rank ``r``, without a Python object per rank.

    Replay simulates one representative per class of identical ranks (see
    :func:`simddp.replay.replay`); its per-rank figures (``rank_collectives``, a timeline's
    ``boundaries`` …) are this: a sequence of ``len(rank_class)`` items that indexes,
    slices, iterates and compares (``==``) like the list it stands for. ``list(x)``
    materialises it; ``values`` and ``rank_class`` (a numpy integer array) are the compact
    form; :meth:`counts` gives how many ranks each class has.
    """

    __slots__ = ("values", "rank_class")

    def __init__(self, values: Sequence[Any], rank_class: Any) -> None:
        self.values = values
        self.rank_class = rank_class

    def __len__(self) -> int:
        return len(self.rank_class)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            v = self.values
            return [v[c] for c in self.rank_class[i].tolist()]
        return self.values[int(self.rank_class[i])]

    def __iter__(self):
        v = self.values
        n = len(self.rank_class)
        for lo in range(0, n, 65536):  # in chunks: no million-item list at once
            for c in self.rank_class[lo:lo + 65536].tolist():
                yield v[c]

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, PerRank):
            import numpy as np

            return len(self) == len(other) and (
                (self.rank_class is other.rank_class or
                 bool(np.array_equal(self.rank_class, other.rank_class)))
                and list(self.values) == list(other.values) or list(self) == list(other))
        if isinstance(other, (list, tuple, range)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __ne__(self, other: Any) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"PerRank({len(self)} ranks, {len(self.values)} classes: "
                f"{list(self[:4])}{' …' if len(self) > 4 else ''})")

    def counts(self) -> list[int]:
        """Per class (index of ``values``): how many ranks it has."""
        import numpy as np

        return np.bincount(self.rank_class, minlength=len(self.values)).tolist()

    def tolist(self) -> list[Any]:
        return list(self)

    def __reduce__(self) -> Any:
        return (PerRank, (list(self.values), self.rank_class))
