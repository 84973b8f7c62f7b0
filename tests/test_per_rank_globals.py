"""Library singletons in thread mode: a module global declared per rank is each rank's own, as
in separate processes; one that is not, and that hands one rank's group to another, fails
with an error that says thread mode cannot isolate it and names ``--isolation process``."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg.errors import RankFailedError, SharedStateError

LIBRARY = textwrap.dedent('''
    import torch.distributed as dist
    _GROUP = None          # as DeepSpeed's groups._WORLD_GROUP: set once, read everywhere
    _SEEN = {}             # mutated in place

    def group():
        global _GROUP
        if _GROUP is None:
            _GROUP = dist.new_group(list(range(dist.get_world_size())))
        return _GROUP

    def note(key, value):
        _SEEN[key] = value
        return dict(_SEEN)
''')


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A fresh module ``statelib_<test>`` on sys.path, not yet imported (a rank imports it)."""
    name = f"statelib_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def train_steps(rank: int, name: str) -> tuple[int, dict, list[float]]:
    lib = importlib.import_module(name)  # imported by a rank, mid-world, as a script would
    g = lib.group()
    seen = lib.note(f"rank{rank}", rank)
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t, group=g)
    return dist.get_global_rank(g, 0), seen, t.tolist()


def test_a_module_global_declared_per_rank_is_each_ranks_own(library):
    fakepg.per_rank_globals(library)
    result = fakepg.spawn(train_steps, args=(library,), nprocs=2)
    for rank, (first, seen, total) in enumerate(result.returns):
        assert first == 0
        assert seen == {f"rank{rank}": rank}  # the dict a fresh import made, not rank 0's
        assert total == [3.0, 3.0]


def test_declared_by_name_only_those_globals_are_per_rank(library):
    fakepg.per_rank_globals(library, "_GROUP")
    result = fakepg.spawn(train_steps, args=(library,), nprocs=2)
    assert [r[2] for r in result.returns] == [[3.0, 3.0], [3.0, 3.0]]
    assert result.returns[1][1] == {"rank0": 0, "rank1": 1}  # _SEEN stayed shared


def test_a_group_shared_through_a_module_global_fails_naming_isolation_process(library):
    with pytest.raises(RankFailedError) as info:
        fakepg.spawn(train_steps, args=(library,), nprocs=2)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError)  # c10d's own refusal, explained
    text = "\n".join([str(cause), *getattr(cause, "__notes__", [])])
    assert "rank 1 used a process group" in text and "that rank 0 created" in text
    assert f"{library}._GROUP, a module global" in text
    assert f"fakepg.per_rank_globals({library!r}, '_GROUP')" in text
    assert "--isolation process" in text and "isolation='process'" in text


def test_the_shared_global_runs_as_processes_without_a_declaration(library):
    result = fakepg.spawn(train_steps, args=(library,), nprocs=2, isolation="process")
    assert [r[2] for r in result.returns] == [[3.0, 3.0], [3.0, 3.0]]


def test_a_call_on_another_ranks_group_is_refused_with_the_same_explanation(library):
    def train(rank: int) -> None:
        lib = importlib.import_module(library)
        lib.group().allreduce([torch.ones(1)]).wait()  # the group object's own API: no c10d check

    with pytest.raises(RankFailedError) as info:
        fakepg.spawn(train, nprocs=2)
    cause = info.value.__cause__
    assert isinstance(cause, SharedStateError)
    assert "rank 1 used a process group (all_reduce at " in str(cause)
    assert "that rank 0 created" in str(cause) and "--isolation process" in str(cause)


@pytest.mark.parametrize("bad", [[5], ["not a name"]])
def test_per_rank_globals_rejects_what_is_not_a_module_and_global_names(bad):
    with pytest.raises(TypeError, match="per_rank_globals"):
        if bad == [5]:
            fakepg.per_rank_globals(5)
        else:
            fakepg.per_rank_globals("mylib", *bad)
