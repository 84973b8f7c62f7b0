"""`simddp --help` and `simddp whatif --help` load no torch: the command line module and the
package import nothing heavy, and help reads light tables (checked against the registries in
tests/test_simddp_cli.py)."""

import subprocess
import sys

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_importing_simddp_and_its_cli_loads_neither_torch_nor_fakepg():
    proc = _python("import sys, simddp, simddp.cli, simddp.program.parallel\n"
                   "heavy = [m for m in ('torch', 'fakepg', 'numpy', 'simpy') if m in sys.modules]\n"
                   "assert not heavy, heavy\n")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["whatif", "--help"], ["replay", "--help"],
                                  ["calibrate", "--help"]])
def test_help_prints_without_importing_torch(argv):
    proc = _python("import sys\nfrom simddp.cli import main\n"
                   f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
                   "assert code == 0, code\n"
                   "assert 'torch' not in sys.modules, 'torch imported'\n")
    assert proc.returncode == 0, proc.stderr
    assert "usage: simddp" in proc.stdout


def test_the_package_still_hands_out_its_names_on_first_use():
    import simddp

    assert simddp.Compute.__name__ == "Compute" and callable(simddp.simulate)
    assert callable(simddp.sweep) and simddp.replay.__name__ == "simddp.replay"
    import simddp.sweep  # noqa: F401  (importing the submodule keeps the function)

    assert callable(simddp.sweep) and not isinstance(simddp.sweep, type(simddp))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        simddp.nope
