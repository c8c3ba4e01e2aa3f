"""Boundaries that are enforced, not conventions: the import contracts in pyproject.toml (run by
`lint-imports` in ./scripts/test.sh) really fail when production code imports the simulator, and
no production module logs through a logger JupyterHub does not wire."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGE = CHECKOUT / "kubevirt_spawner"
# The simulator, and the two entry points that embed it, are not production modules.
NOT_PRODUCTION = ("sim", "demo.py", "cli.py", "data")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint) if lint.exists() else "lint-imports", "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """The package and its contracts in a directory of their own, to break on purpose."""
    shutil.copytree(PACKAGE, tmp_path / "kubevirt_spawner", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(CHECKOUT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold_on_the_package_as_it_is(package_copy):
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("workstation/lifecycle.py", "import kubevirt_spawner.sim", "Production modules never import the simulator"),
    ("reflector.py", "from .sim.app import SimulatorThread", "Production modules never import the simulator"),
    ("spawner.py", "from . import demo", "Nothing imports the demo or the command line"),
    ("sim/store.py", "from .. import workstation", "The simulator imports nothing of the product"),
    ("quantity.py", "from . import names", "The shared helpers are pure"),
    ("workstation/disks.py", "from .lifecycle import Lifecycle", "A workstation's layers use only those below them"),
    ("spawner_settings.py", "from .spawner_machines import SpawnerMachines", "The spawner's parts use only those below"),
    ("service/drains.py", "from .core import Workstations", "The service's parts use only those below them"),
    ("service/web.py", "from .actions import Actions", "The service's web layer acts through its entry point"),
])
def test_a_forbidden_import_breaks_a_contract(package_copy, module, line, contract):
    path = package_copy / "kubevirt_spawner" / module
    path.write_text(path.read_text() + f"\n{line}  # added by the test\n")
    result = lint_imports(package_copy)
    assert result.returncode != 0, result.stdout
    broken = result.stdout[result.stdout.index("Broken contracts"):]
    assert contract in broken, result.stdout


def production_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in NOT_PRODUCTION]


def test_production_modules_log_through_the_hub_not_a_logger_of_their_own():
    """JupyterHub wires its own loggers only: a `logging.getLogger(__name__)` line would be dropped
    (INFO) or come out without the hub's format (WARNING)."""
    offenders = []
    for path in production_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "getLogger":
                offenders.append(f"{path.relative_to(CHECKOUT)}:{node.lineno}")
    assert len(production_modules()) >= 9
    assert offenders == []
