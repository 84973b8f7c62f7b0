"""How the project installs and imports: only its own top-level names, layers loaded on demand.

The distribution installs ``fakepg`` and ``simddp`` only; the repository's ``models/`` folder
(the scenario zoo) installs as ``fakepg.zoo`` so that a user's own ``models`` package keeps
its name. ``import fakepg`` loads the core, not the layers above it (conformance, the zoo).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_import_fakepg_loads_neither_the_conformance_harness_nor_the_zoo() -> None:
    result = _python("import sys, fakepg; "
                     "print(sorted(m for m in sys.modules if m.startswith(('fakepg.conformance', 'fakepg.zoo'))))",
                     ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_conformance_api_is_imported_from_its_own_package_not_from_fakepg() -> None:
    import fakepg
    import fakepg.conformance as conformance

    for name in ("run_scenario", "assert_conformant", "compare", "ScenarioOutcome"):
        assert name in conformance.__all__
        assert not hasattr(fakepg, name) and name not in fakepg.__all__


def test_a_user_project_with_its_own_models_package_imports_both_it_and_the_zoo(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("WHOSE = 'the user project'\n")
    result = _python("import models; from fakepg import zoo; "
                     "print(models.WHOSE); print(zoo.__name__, zoo.get('mlp').name, zoo.Scenario.__module__)",
                     tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["the user project", "fakepg.zoo mlp fakepg.zoo.scenario"]


def test_distribution_installs_only_fakepg_and_simddp_as_top_level_names() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert {p.split(".")[0] for p in setuptools["packages"]} == {"fakepg", "simddp"}
    # ... and one private module: the pytest plugin's entry, which must load without torch,
    # so it cannot live inside the fakepg package (whose __init__ imports torch).
    assert setuptools["py-modules"] == ["_fakepg_pytestplugin"]
    assert PYPROJECT["project"]["entry-points"]["pytest11"] == {"fakepg": "_fakepg_pytestplugin"}
    assert setuptools["package-dir"] == {"fakepg.zoo": "models"}


def test_every_package_folder_of_fakepg_and_simddp_is_listed_for_installation() -> None:
    # An explicit list (the zoo's folder is mapped, so no discovery): a new subpackage must be
    # added to it, or a wheel install would lack it.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(ROOT).parts)
               for top in ("fakepg", "simddp") for init in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_hard_dependencies_are_what_the_core_needs_and_plotting_is_an_extra() -> None:
    project = PYPROJECT["project"]
    hard = {d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert hard == {"torch", "simpy", "numpy", "rich"}  # rich: simddp's Timeline.summary()
    assert [d.split(">")[0] for d in project["optional-dependencies"]["plot"]] == ["matplotlib"]
