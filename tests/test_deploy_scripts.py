"""The scripts under deploy/ pass shellcheck, and the golden image's recipe says how it is used."""

from __future__ import annotations

import pathlib
import subprocess

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"


def test_every_deploy_script_passes_shellcheck():
    scripts = sorted(str(p) for p in DEPLOY.rglob("*.sh"))
    assert scripts, "no scripts under deploy/"
    done = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


def test_build_sh_refuses_an_unknown_option_and_has_help():
    build = DEPLOY / "golden-image" / "build.sh"
    helped = subprocess.run(["bash", str(build), "--help"], capture_output=True, text=True, check=True).stdout
    assert "Build and seal a workstation golden image" in helped and "--suite" in helped
    bad = subprocess.run(["bash", str(build), "--colour", "blue"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "unknown option --colour" in bad.stderr
