"""The JupyterLab extension and the guest server extension ship in the wheel and are enabled where
the package is installed; the TypeScript is built from source, never committed as JavaScript."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kubevirt_spawner

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LABEXTENSION = "@kubevirt-spawner/workstation"


def jupyter(*args: str) -> str:
    """The command's output, without colours, each run of spaces one space."""
    done = subprocess.run([str(BIN / "jupyter"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # (both print to stderr)
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def test_both_extensions_are_enabled_where_the_package_is_installed():
    labextensions = jupyter("labextension", "list")
    version = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    assert version == kubevirt_spawner.__version__  # one version for both halves
    assert f"{LABEXTENSION} v{version} enabled OK (python, kubevirt-spawner)" in labextensions, labextensions
    server = jupyter("server", "extension", "list")
    assert "kubevirt_spawner.guest enabled" in server and "kubevirt_spawner.guest OK" in server, server


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="a source checkout's history (git ls-files)")
def test_no_built_javascript_is_committed():
    tracked = subprocess.run(["git", "ls-files", "labextension"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert "labextension/yarn.lock" in tracked and "labextension/package.json" in tracked
    built = [p for p in tracked if p.endswith(".js") and p != "labextension/style/index.js"]
    assert built == [] and not any(p.startswith(("labextension/lib/", "labextension/dist/")) for p in tracked)


def test_the_wheel_carries_the_lab_extension_and_its_server_config(tmp_path):
    """What `pip install kubevirt-spawner` puts on a workstation: the prebuilt Lab extension under
    share/jupyter/labextensions/ and the server extension's config under etc/jupyter/."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path),
                           str(ROOT)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = tmp_path.glob("kubevirt_spawner-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = next(n.split("/data/")[0] for n in names if ".data/data/" in n) + "/data/"
    lab = f"{data}share/jupyter/labextensions/{LABEXTENSION}/"
    assert f"{lab}package.json" in names and f"{lab}install.json" in names
    assert f"{lab}static/style.js" in names and any(n.startswith(f"{lab}static/remoteEntry.") for n in names)
    assert f"{data}etc/jupyter/jupyter_server_config.d/kubevirt_spawner.guest.json" in names
    for module in ("kubevirt_spawner/guest/__init__.py", "kubevirt_spawner/guest/proxy.py",
                   "kubevirt_spawner/data/demo_config.py", "kubevirt_spawner/service/templates/workstation.html"):
        assert module in names
