"""Copies the browser tests' screenshots into docs/, so the pictures in the docs are what the tests
saw. The tests write them under test-artifacts/ (tests/e2e/test_lab.py numbers its steps:
`NN-name.png`); after a run of the e2e tests, `python docs/screenshots.py` refreshes every picture
below. tests/test_docs.py fails when a picture in the docs has no test that takes it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ARTIFACTS = DOCS.parent / "test-artifacts"

# picture in docs/ -> (the test's artifacts folder, the screenshot's name there, the test that takes it)
SHOTS = {
    "tutorial/start.png": ("lab", "profiles", "tests/e2e/test_lab.py"),
    "tutorial/snapshot-form.png": ("lab", "snapshot-form", "tests/e2e/test_lab.py"),
    "tutorial/snapshot-ready.png": ("lab", "snapshot-ready", "tests/e2e/test_lab.py"),
    "tutorial/restore-confirm.png": ("lab", "restore-confirm", "tests/e2e/test_lab.py"),
    "tutorial/restore-steps.png": ("lab", "restore-steps", "tests/e2e/test_lab.py"),
    "workstation-panel.png": ("lab", "panel", "tests/e2e/test_lab.py"),
    "profiles-form.png": ("profiles", "profiles-form", "tests/e2e/test_hub_profiles.py"),
    "vscode-launcher.png": ("qemu", "vscode-launcher", "tests/e2e/test_qemu.py"),
    "acceptance-report.png": ("acceptance", "acceptance-report", "tests/e2e/test_acceptance.py"),
}


def taken(folder: str, name: str) -> Path | None:
    """The test's screenshot of that name (test_lab's carry a step number in front), if a run left it."""
    found = [p for p in (ARTIFACTS / folder).glob("*.png")
             if p.stem == name or (p.stem[:2].isdigit() and p.stem[2:] == f"-{name}")]
    return found[0] if len(found) == 1 else None


def main() -> int:
    missing = []
    for picture, (folder, name, test) in SHOTS.items():
        source = taken(folder, name)
        if source is None:
            missing.append(f"{picture} (run {test})")
            continue
        shutil.copyfile(source, DOCS / picture)
        print(f"{DOCS / picture} <- {source}")
    if missing:
        print("no screenshot to copy for: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
