"""hypothesis strategies for fakepg's controlled choices (needs hypothesis; not loaded by
``import fakepg``)::

    from hypothesis import given
    from fakepg import strategies

    @given(strategies.schedules())
    def test_counter_survives_any_interleaving(schedule):
        fakepg.spawn(counter, nprocs=2, schedule=schedule)

    fakepg.explore(train, nprocs=4, faults=strategies.faults(nprocs=4, max_at=10))
"""

from __future__ import annotations

from hypothesis import strategies as st

from . import faults as _faults
from .schedule import Schedule

__all__ = ["schedules", "faults"]


def _modulo(choices: list[int]):
    it = iter(choices)
    return lambda kind, n: next(it, 0) % n


def schedules(max_choices: int = 64, width: int = 4) -> st.SearchStrategy[Schedule]:
    """Schedules whose first ``max_choices`` choices are drawn (each modulo its number of
    options; later ones take the default). Shrinks towards the default schedule."""
    return st.lists(st.integers(0, width - 1), max_size=max_choices).map(
        lambda xs: Schedule(chooser=_modulo(xs)))


def faults(nprocs: int, max_at: int = 8, max_faults: int = 1,
           kinds: tuple[str, ...] = ("crash",)) -> st.SearchStrategy[list]:
    """Lists of up to ``max_faults`` injected faults: ``crash`` (and ``raise_in``, which raises
    RuntimeError) of any rank at any of its first ``max_at + 1`` collectives. Shrinks towards
    no fault, then rank 0 and the first collective."""
    makers = {"crash": lambda r, k: _faults.crash(r, at=k),
              "raise_in": lambda r, k: _faults.raise_in(r, at=k)}
    unknown = set(kinds) - set(makers)
    if unknown:
        raise ValueError(f"strategies.faults: unknown kinds {sorted(unknown)}; known: {sorted(makers)}")
    one = st.builds(lambda kind, r, k: makers[kind](r, k), st.sampled_from(list(kinds)),
                    st.integers(0, nprocs - 1), st.integers(0, max_at))
    return st.lists(one, max_size=max_faults)
