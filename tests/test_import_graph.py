"""fakepg's imports run one way: no module imports, however indirectly, a module that imports it.

The graph is read from the source with :mod:`ast`: every ``import`` and ``from … import`` in a
module, at module level or inside a function (a late import still closes a circle; it only moves
the failure to run time), except under ``if TYPE_CHECKING:``, which never runs. An edge goes to
the module named: ``from .ops import matching`` is an edge to ``fakepg.ops.matching``,
``from .ops.base import Op`` to ``fakepg.ops.base``. A package's own ``__init__`` running first
is not an edge (else every package importing its children would be a circle).

Across layers: ``simddp → fakepg → torch``, and the zoo (``models/``) imports only torch and the
standard library.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edge:
    target: str
    where: str  # "path:line", for the failure message


def _modules(package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package) for every module under ``package``."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement outside ``if TYPE_CHECKING:`` blocks (their ``else`` runs, so counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if _type_only(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute module names one statement imports (``from P import a``: ``P.a`` if it is a
    module, else ``P``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def import_graph(package: str) -> dict[str, list[Edge]]:
    """Module -> the modules of ``package`` it imports (with where), for every module in it."""
    modules = _modules(package)
    graph: dict[str, list[Edge]] = {}
    for module, (path, is_package) in modules.items():
        edges: dict[str, Edge] = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            names = _imported_names(module, is_package, node)
            if isinstance(node, ast.ImportFrom):  # `from P import a, b`: the submodules named, else P
                submodules = [n for n in names[1:] if n in modules]
                names = submodules if len(submodules) == len(names) - 1 else [names[0]] + submodules
            for name in names:
                if name in modules and name != module and name not in edges:
                    edges[name] = Edge(name, f"{path.relative_to(ROOT)}:{node.lineno}")
        graph[module] = list(edges.values())
    return graph


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[tuple[str, Edge]]]:
    """One concrete circle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in graph[v]:
            if edge.target not in index:
                connect(edge.target)
                low[v] = min(low[v], low[edge.target])
            elif edge.target in on_stack:
                low[v] = min(low[v], index[edge.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, list[Edge]], component: set[str]) -> list[tuple[str, Edge]]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    came_from: dict[str, tuple[str, Edge]] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for edge in graph[v]:
                if edge.target == start:
                    path = [(v, edge)]
                    while v != start:
                        v, via = came_from[v]
                        path.append((v, via))
                    return path[::-1]
                if edge.target in component and edge.target not in came_from:
                    came_from[edge.target] = (v, edge)
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(component)}")  # pragma: no cover


def describe(cycle: list[tuple[str, Edge]]) -> str:
    return "\n".join(f"  {module} imports {edge.target}  ({edge.where})" for module, edge in cycle)


def _top_level_imports(package: str) -> dict[str, str]:
    """Absolute top-level names imported anywhere in ``package`` (relative imports aside) -> where."""
    found: dict[str, str] = {}
    for path, _ in _modules(package).values():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [] if node.level else [node.module or ""])
            for name in names:
                found.setdefault(name.split(".")[0], f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_fakepg_has_no_import_circle() -> None:
    cycles = find_cycles(import_graph("fakepg"))
    assert not cycles, (f"{len(cycles)} import circle(s) in fakepg; turn one import around (a registry, "
                        "a hook or a parameter):\n" + "\n\n".join(describe(c) for c in cycles))


def test_the_cycle_finder_names_each_module_of_a_circle() -> None:
    graph = {"a": [Edge("b", "a.py:1")], "b": [Edge("c", "b.py:2")], "c": [Edge("a", "c.py:3")],
             "d": [Edge("a", "d.py:1")]}
    (cycle,) = find_cycles(graph)
    assert describe(cycle) == ("  a imports b  (a.py:1)\n  b imports c  (b.py:2)\n"
                               "  c imports a  (c.py:3)")
    assert find_cycles({"a": [Edge("b", "a.py:1")], "b": []}) == []


def test_type_checking_imports_and_late_imports_are_told_apart() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from .cluster import Cluster\n"
                     "def f():\n    from .store import FakeStore\n")
    assert [n.module for n in _imports(tree) if isinstance(n, ast.ImportFrom)] == ["typing", "store"]


def test_every_fakepg_import_of_fakepg_names_a_module_that_exists() -> None:
    # A moved module's old path would still import in an old checkout's .pyc, never in a fresh one.
    modules = _modules("fakepg")
    missing = []
    for module, (path, is_package) in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fakepg")):
                source = _imported_names(module, is_package, node)[0]
                if source not in modules and not source.startswith("fakepg.zoo"):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {source}")
    assert not missing, "imports of fakepg modules that do not exist:\n" + "\n".join(missing)


def test_fakepg_never_imports_simddp() -> None:
    imported = _top_level_imports("fakepg")
    assert "simddp" not in imported, f"fakepg imports simddp at {imported.get('simddp')}: imports run simddp → fakepg"


def test_the_zoo_imports_only_torch_and_the_standard_library() -> None:
    imported = _top_level_imports("models")
    foreign = {name: where for name, where in imported.items()
               if name not in sys.stdlib_module_names and name != "torch" and name != "__future__"}
    assert not foreign, f"models/ must import only torch (it runs on real backends too): {foreign}"


def private_names_across_modules(package: str) -> list[str]:
    """Where a module of ``package`` imports or reads another module's private name."""
    modules = _modules(package)
    found = []
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        module_aliases = set()  # local names bound to the package's modules: `from . import store as _store`
        for node in _imports(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith(package)):
                continue
            source = _imported_names(module, is_package, node)[0]
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    module_aliases.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {source}.{alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: reads {node.value.id}.{node.attr}")
    return found


def test_no_fakepg_module_reaches_for_another_modules_private_names() -> None:
    # `from .cluster import _fresh` or `_store._ACTIVE`: what a module keeps private may change
    # without notice, so a name another module needs is made public where it is defined.
    found = private_names_across_modules("fakepg")
    assert not found, "private names used across fakepg's modules:\n" + "\n".join(found)


# fakepg's rooms, lowest first: a module imports only from its own room and the rooms below
# (type-only imports aside). The world runs checks it is handed (world/checks.py) and never
# names one, so fidelity sits above it; a launcher hands the rank processes what they start.
ROOMS = ("base", "ops", "choices", "world", "fidelity", "process", "launch", "top", "conformance")
_BASE = ("errors", "arguments", "sites", "torch_private", "lazy")


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "pytest_plugin":
        return "top"  # the public API and the pytest plugin's entry point
    return "base" if parts[1] in _BASE else parts[1]


def test_every_fakepg_module_lives_in_a_room() -> None:
    unknown = sorted(m for m in _modules("fakepg") if room_of(m) not in ROOMS)
    assert not unknown, f"modules outside fakepg's rooms {ROOMS}: {unknown} (see docs/fakepg-rooms.md)"


def test_rooms_import_only_their_own_room_and_the_rooms_below() -> None:
    upward = [f"{module} ({room_of(module)}) imports {edge.target} ({room_of(edge.target)})  ({edge.where})"
              for module, edges in sorted(import_graph("fakepg").items()) for edge in edges
              if ROOMS.index(room_of(edge.target)) > ROOMS.index(room_of(module))]
    assert not upward, "imports that go up a room (rooms, lowest first: " + " < ".join(ROOMS) + "):\n" + \
        "\n".join(upward)


# simddp's layers, highest first: a module imports from its own room, from the rooms of lower
# layers, and (drivers only) from other drivers. The engines (cosim, replay) run what the
# program layer writes; the models and the analysis know nothing of either.
SIMDDP_LAYERS = (
    ("simddp", "simddp.__main__", "simddp.cli", "simddp.cli_args", "simddp.cli_plan",
     "simddp.cli_calibrate", "simddp.cli_flags", "simddp.cli_output"),
    ("simddp.whatif", "simddp.whatif_checks", "simddp.plain_step", "simddp.sweep",
     "simddp.measure", "simddp.exploration", "simddp.strategies",
     "simddp.jobs", "simddp.plan", "simddp.cache", "simddp.capture_cache",
     "simddp.parallelisms"),
    ("simddp.cosim", "simddp.replay"),
    ("simddp.program", "simddp.timing"),
    ("simddp.analysis", "simddp.core", "simddp.faults"),
    ("simddp.models", "simddp.errors", "simddp.compat"),
)
_DRIVERS = 1


def simddp_room(module: str) -> str:
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


def simddp_layer(module: str) -> int:
    room = simddp_room(module)
    for i, rooms in enumerate(SIMDDP_LAYERS):
        if room in rooms:
            return i
    raise LookupError(room)


def test_simddp_has_no_import_circle() -> None:
    cycles = find_cycles(import_graph("simddp"))
    assert not cycles, (f"{len(cycles)} import circle(s) in simddp; turn one import around (a registry, "
                        "a hook or a parameter):\n" + "\n\n".join(describe(c) for c in cycles))


def test_every_simddp_module_lives_in_a_layer() -> None:
    unknown = []
    for module in _modules("simddp"):
        try:
            simddp_layer(module)
        except LookupError:
            unknown.append(module)
    assert not unknown, f"simddp modules outside SIMDDP_LAYERS: {unknown} (docs/architecture.md)"


def test_simddp_imports_run_down_its_layers() -> None:
    upward = []
    for module, edges in sorted(import_graph("simddp").items()):
        for edge in edges:
            a, b = simddp_layer(module), simddp_layer(edge.target)
            same_room = simddp_room(module) == simddp_room(edge.target)
            if not (same_room or b > a or (a == b == _DRIVERS) or a == 0):
                upward.append(f"{module} imports {edge.target}  ({edge.where})")
    assert not upward, "simddp imports that do not run down its layers (" + " > ".join(
        "/".join(r.split(".")[-1] for r in rooms) for rooms in SIMDDP_LAYERS) + "):\n" + "\n".join(upward)


def test_no_simddp_module_reaches_for_another_modules_private_names() -> None:
    found = private_names_across_modules("simddp")
    assert not found, "private names used across simddp's modules:\n" + "\n".join(found)
