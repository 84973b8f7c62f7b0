"""Backends the program brings: registered creators run as registered, inside a fake world.

``dist.Backend.register_backend("mine", creator)`` then ``init_process_group("mine")`` (or
``new_group(backend="mine")``) inside a world goes through torch's own code: c10d calls the
program's ``creator`` with the world's store (prefixed as torch prefixes it), the group rank
and size, and the timeout (or, with ``extended_api=True``, torch's ``_DistributedBackendOptions``
and the ``pg_options``), and the group is whatever the creator returns — ``get_backend()`` and
``pg.name()`` are its own. A name torch knows but this build lacks (``"mpi"``, ``"ucc"``) fails
as torch fails without it.

A creator usually forwards to a real backend it builds: ``dist.ProcessGroupGloo(store, rank,
size, timeout)``. Between ranks that are threads of one scheduler a real gloo group would
block in C++ (its rendezvous and every collective wait for peers that cannot run), so inside a
world that constructor builds a fakepg group with gloo's personality on the same members
(:class:`GlooConstructor`): its collectives are matched, checked and reported as fakepg's, and
it answers as a bare ``ProcessGroupGloo`` does (gloo's own argument checks, ``options``,
``_set_default_timeout``).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any, Callable, Iterator

import torch.distributed as dist

from ..world.binding import current_cluster
from ..world.process_group import FakeProcessGroup
from ..world.python_group import BACKEND_NAME, requested_backend

# The names fakepg's own groups stand in for (their personalities), and c10d's "undefined".
_OWN = {"gloo", "nccl", BACKEND_NAME, "undefined"}


def foreign(backend: object) -> bool:
    """Whether a backend request names a backend that is not one of fakepg's personalities
    (a registered plugin, ``"mpi"``, ``"ucc"``, a typo): torch's own code handles it."""
    if backend is None:
        return False
    names = [part.split(":")[-1].strip() for part in str(backend).lower().split(",")]
    return any(name and name not in _OWN for name in names)


_members = threading.local()  # the group c10d is creating on this rank thread


@contextlib.contextmanager
def creating_group(global_ranks: list[int] | tuple[int, ...], name: str) -> Iterator[None]:
    """Groups a registered creator constructs in this block (``ProcessGroupGloo(...)``) span
    ``global_ranks`` (c10d's list; empty means the whole world) and are named after c10d's
    group ``name``."""
    saved = getattr(_members, "group", None)
    _members.group = [tuple(global_ranks), name, 0]
    try:
        yield
    finally:
        _members.group = saved


def torch_creates(helper: Callable[..., Any], group_size: int, group_rank: int,
                  global_ranks_in_group: list[int], backend: Any, *args: Any, **kwargs: Any) -> Any:
    """c10d's ``_new_process_group_helper`` (``helper``) creating a group of the program's own
    backend, as torch does; a ``ProcessGroupGloo`` its creator builds spans the same members."""
    name = args[1] if len(args) > 1 else kwargs.get("group_name", "")
    with creating_group(global_ranks_in_group, str(name)):
        return helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)


def membership(nprocs: int, me: int, counts: dict[int, int], rank: int,
               size: int) -> tuple[tuple[int, ...], str]:
    """The global ranks and fakepg group name of a ``ProcessGroupGloo(store, rank, size)``
    constructed on global rank ``me`` of a world of ``nprocs`` (``counts``: this world's count
    of direct constructions per rank, which names them alike on every member)."""
    where = getattr(_members, "group", None)
    if where is not None:  # inside a registered creator: c10d knows the members
        ranks, name, count = where
        ranks = ranks or tuple(range(nprocs))
        where[2] += 1
        label = f"{name}/gloo" + (f"#{count}" if count else "")
    else:  # constructed directly by the program, as torch's own c10d tests do
        ranks = tuple(range(nprocs))
        count = counts.get(me, 0)
        counts[me] = count + 1
        label = f"ProcessGroupGloo#{count}"
    if len(ranks) != size or not 0 <= rank < size or ranks[rank] != me:
        raise ValueError(
            f"rank {me}: ProcessGroupGloo(store, rank={rank}, size={size}) inside a fake world "
            f"of {nprocs} ranks: fakepg maps a directly constructed gloo group onto the "
            f"world's ranks {list(ranks)}, so it needs size={len(ranks)} and rank = this "
            f"rank's place in it; build other subgroups with dist.new_group(ranks)")
    return ranks, label


def _timeout_of(args: tuple, kwargs: dict) -> tuple[datetime.timedelta, Any]:
    """(timeout, options) from ProcessGroupGloo's 4th argument: a timedelta or an _Options."""
    arg = args[3] if len(args) > 3 else kwargs.get("options", kwargs.get("timeout"))
    if isinstance(arg, dist.ProcessGroupGloo._Options):
        return arg._timeout, arg
    if arg is None:
        return datetime.timedelta(minutes=30), None
    return arg, None


# make(rank, size, timeout) -> the fake gloo group of this rank, or None outside a world
Maker = Callable[[int, int, datetime.timedelta], Any]


class GlooConstructor:
    """Stands in for ``dist.ProcessGroupGloo`` while a world runs: in a rank a group of more
    than one rank is a fakepg group with gloo's personality (``make``: thread mode's or a
    rank process's); elsewhere, and for one rank (which waits for nobody), the real class.
    ``isinstance`` and the class's attributes (``_Options``, ``create_device``) are the real
    class's."""

    def __init__(self, original: type, make: Maker):
        self._original, self._make = original, make

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        size = args[2] if len(args) > 2 else kwargs.get("size")
        if size is None or int(size) <= 1:
            return self._original(*args, **kwargs)
        rank = int(args[1] if len(args) > 1 else kwargs["rank"])
        timeout, options = _timeout_of(args, kwargs)
        with requested_backend("gloo"):
            pg = self._make(rank, int(size), timeout)
        if pg is None:
            return self._original(*args, **kwargs)
        pg._bare_backend = True
        pg._gloo_options = options
        return pg

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self._original)

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self._original)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def make_thread_group(rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """Thread mode's fake gloo group (None outside a rank thread)."""
    binding = current_cluster()
    if binding is None:
        return None

    cluster, me = binding
    ranks, name = membership(cluster.nprocs, me, cluster.direct_groups, rank, size)
    pg = FakeProcessGroup(cluster, me, rank, size, timeout)
    pg._fixed_membership = (ranks, name)
    return pg


__all__ = ["foreign", "creating_group", "torch_creates", "GlooConstructor", "membership", "make_thread_group"]
