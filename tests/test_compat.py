"""Private torch names live in one module per package (docs/architecture.md): simddp's in
``simddp/compat.py``. A name used anywhere else fails here with its file and line; every name the
compat module owns is resolved on the running torch, so an upgrade that moves one fails here,
with the name. fakepg's module is ``fakepg/torch_private.py`` (its base room; ``fakepg.compat`` is
the user-facing CPU shims).

A private name is a name or a module-path component starting with ``_`` (dunders aside) reached
from ``torch``: ``import torch._C``, ``from torch.utils._python_dispatch import …``,
``torch._C._current_graph_task_id``, ``dist._world`` (``dist`` bound by an import from torch),
``getattr(torch._C, "_x")``. Aten operator names (``torch.ops.aten._scaled_dot_product…``) are
the operator schema, not Python API, and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPAT = {"simddp": "simddp/compat.py", "fakepg": "fakepg/torch_private.py"}


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_torch_names(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, dotted name) for each private torch name ``source`` uses."""
    tree = ast.parse(source, filename)
    bound: set[str] = set()  # local names bound by an import from torch
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound.add(a.asname or "torch")
                    if any(map(_private, a.name.split("."))):
                        found.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                bound.add(a.asname or a.name)
                if any(map(_private, f"{node.module}.{a.name}".split("."))):
                    found.append((node.lineno, f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        chain = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _chain(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            base = _chain(node.args[0])
            chain = base and [*base, node.args[1].value]
        if chain and chain[0] in bound and chain[1:3] != ["ops", "aten"]:
            found.append((node.lineno, ".".join(chain)))
    return sorted(set(found))


def _uses_outside_compat(package: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {name}"
            for path in sorted((ROOT / package).rglob("*.py"))
            if str(path.relative_to(ROOT)) != COMPAT.get(package)
            for line, name in private_torch_names(path.read_text(), str(path))]


def test_the_scanner_finds_each_form_of_private_name() -> None:
    source = ("import torch\nimport torch.distributed as dist\nfrom torch.utils._python_dispatch import M\n"
              "from torch.distributed import _functional_collectives\n_C = torch._C\n"
              "dist._world\ngetattr(torch._C, '_x')\ntorch.ops.aten._foo\ntorch.__version__\n"
              "x = object()\nx._private\n")
    assert private_torch_names(source) == [
        (3, "torch.utils._python_dispatch.M"), (4, "torch.distributed._functional_collectives"),
        (5, "torch._C"), (6, "dist._world"), (7, "torch._C"), (7, "torch._C._x")]


def test_simddp_uses_private_torch_names_only_in_its_compat_module() -> None:
    found = _uses_outside_compat("simddp")
    assert not found, ("private torch names outside simddp/compat.py (add a public name there and "
                       "import it):\n" + "\n".join(found))


def test_the_zoo_uses_no_private_torch_name() -> None:
    found = _uses_outside_compat("models")
    assert not found, "private torch names in models/ (it runs on real backends):\n" + "\n".join(found)


def test_every_name_simddp_compat_owns_resolves_on_this_torch() -> None:
    import simddp.compat as compat

    missing = [name for name in compat.__all__ if getattr(compat, name, None) is None]
    assert not missing, f"simddp.compat does not provide {missing}"
    lazy = compat.LAZY()
    assert all(value is not None for value in lazy.values()), lazy
    assert {"FakeTensor", "_PipelineScheduleRuntime._prepare_schedule_with_comms",
            "_compute_bucket_assignment_by_size"} <= set(lazy)


# Modules that still read private torch names directly (not yet routed through
# fakepg/torch_private.py: they patch or swap torch objects' private attributes, or hold a
# per-world c10d state that cannot be bound once at import). The list may only shrink: a new
# module with a private torch name fails here.
FAKEPG_NOT_YET_ROUTED = frozenset({
    "fakepg/conformance/torch_suite.py", "fakepg/fidelity/foreign_backends.py",
    "fakepg/fidelity/patches.py", "fakepg/fidelity/profiling.py", "fakepg/launch/suites.py",
    "fakepg/process/remote/entry_points.py", "fakepg/world/isolation.py",
    "fakepg/world/python_group.py", "fakepg/world/work.py"})


def test_fakepg_uses_private_torch_names_only_in_torch_private_and_the_listed_modules() -> None:
    found = _uses_outside_compat("fakepg")
    new = [f for f in found if f.split(":")[0] not in FAKEPG_NOT_YET_ROUTED]
    assert not new, ("private torch names outside fakepg/torch_private.py (add a name there and "
                     "import it):\n" + "\n".join(new))
    routed = FAKEPG_NOT_YET_ROUTED - {f.split(":")[0] for f in found}
    assert not routed, f"no private torch name left in {sorted(routed)}: drop them from the list"


def test_every_name_fakepg_torch_private_owns_resolves_on_this_torch() -> None:
    import fakepg.torch_private as tp

    missing = []
    for name in tp.NAMES:
        try:
            tp.resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, "private torch names fakepg uses that this torch lacks:\n" + "\n".join(missing)
    source = (ROOT / COMPAT["fakepg"]).read_text()
    assert not [n for n in ast.parse(source).body if isinstance(n, ast.ImportFrom) and n.level], \
        "fakepg/torch_private.py imports from fakepg: it is the base room"
