"""The documentation site: it builds with warnings as errors (broken links, missing images, pages
outside the table of contents), every setting a site configures has help text, and the pages that
come from the code (docs/generate.py: configuration, failures, metrics, the REST API) are what the
code makes, so they cannot drift (as JupyterHub's docs/test_docs.py keeps its generated pages true)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_help(generate):
    assert generate.missing_help() == []


@pytest.mark.parametrize("page", ["configuration.md", "failures.md", "metrics.md", "api.md"])
def test_the_generated_pages_are_what_the_code_makes(generate, page):
    assert (DOCS / page).read_text() == generate.PAGES[page](), \
        f"docs/{page} differs from the code: run `python docs/generate.py` and commit it"


def test_the_reference_names_every_setting_of_each_class(generate):
    page = generate.configuration()
    for module, name, _, _ in generate.CONFIGURABLES:
        cls = generate._class(module, name)
        for trait in generate.settings_of(cls):
            assert f"### `c.{name}.{trait}`" in page
    # the settings the README's hand table missed (issue 29)
    for setting in ("termination_grace_period", "network_policy_ingress_from", "namespace_resource_quota",
                    "namespace_limit_range"):
        assert f"### `c.KubeVirtSpawner.{setting}`" in page


def test_the_failures_page_lists_every_reason(generate):
    from kubevirt_spawner.reasons import Reason
    page = generate.failures()
    for reason in Reason:
        assert f"| `{reason.value}` | {reason.description} |" in page


def test_the_metrics_page_lists_every_metric_of_the_service_with_its_labels(generate):
    page = generate.metrics()
    registry = generate.service_registry()
    families = {family.name: family for family in registry.collect()}
    assert {"workstations_operations", "workstations_cost", "workstations_held"} <= set(families)
    for name, family in families.items():
        assert f"`{name}{generate.SAMPLES[family.type][0]}`" in page
    assert "| `workstations_operations_total` | counter | `kind`, `result` |" in page
    assert "| `workstations_cost_total` | counter | `user`, `profile` |" in page
    assert "| `workstations_operation_seconds_bucket`, `workstations_operation_seconds_sum`, " \
           "`workstations_operation_seconds_count` | histogram | `kind` |" in page
    assert "| `WorkstationSnapshotsFailing` | warning |" in page  # the alerts, from deploy/guardrails/


def test_the_api_page_shows_every_operation_of_the_document(generate):
    """Each operation, a default server's and a named server's as one `.../{user}[/servers/{server}]/...`."""
    page = generate.api()
    doc = generate.openapi()
    for path, item in doc["paths"].items():
        both = path.replace("/servers/{server}", "[/servers/{server}]") if "/servers/{server}" in path \
            else path.replace("/{user}", "/{user}[/servers/{server}]", 1)
        for method in ("get", "post", "put", "patch", "delete"):
            if method in item:
                assert f"`{method.upper()} {path}`" in page or f"`{method.upper()} {both}`" in page, (method, path)
                assert f"### {item[method]['summary']}" in page


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """What scripts/test.sh runs: Sphinx with MyST (docs/requirements.txt, which scripts/setup.sh
    installs), every warning an error: a broken link or image, a page in no table of contents."""
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
                           str(DOCS), str(tmp_path / "html")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index", "tutorial", "api", "metrics", "configuration", "failures", "deploy/README",
                 "admin/troubleshooting", "user/workstation"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    assert (tmp_path / "html" / "_images" / "workstation-panel.png").is_file()


def test_the_readme_fits_on_one_screen_with_the_two_quick_start_commands():
    """The README says what this is, shows the panel, gives the demo's and the tests' commands and
    points to the docs; everything else lives in docs/ (issue 29)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 120
    assert "Set up and run the local demo (http://127.0.0.1:8000):\n\n```\n./scripts/demo.sh\n```" in readme
    assert "Set up and run every test (this is what `.ci/run` runs):\n\n```\n./scripts/test.sh\n```" in readme
    assert "![The Workstation panel in JupyterLab](docs/workstation-panel.png)" in readme
    assert "python3 -m sphinx -b html docs " in readme
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert "docs/tutorial.md" in local and "docs/api.md" in local
    for link in local:
        assert (REPO / link).exists(), link
    # every page of the site is linked from the README
    pages = {str(p.relative_to(REPO)) for p in DOCS.rglob("*.md")} - {"docs/index.md", "docs/deploy/README.md",
                                                                        "docs/deploy/golden-image/README.md"}
    assert pages <= set(local), sorted(pages - set(local))


def test_every_picture_in_the_docs_is_a_screenshot_a_browser_test_takes(tmp_path, monkeypatch):
    """docs/screenshots.py copies the browser tests' screenshots into docs/: every picture the pages
    show is one of them, by a name that test really takes, and the copy finds test_lab's numbered
    files (and refuses, changing nothing, when a run left none)."""
    spec = importlib.util.spec_from_file_location("docs_screenshots", DOCS / "screenshots.py")
    shots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shots)
    shown = {str((page.parent / ref).resolve().relative_to(DOCS))
             for page in DOCS.rglob("*.md") for ref in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())}
    assert shown == set(shots.SHOTS), "a picture in docs/ that no browser test takes (or one no page shows)"
    for picture, (_folder, name, test) in shots.SHOTS.items():
        source = (REPO / test).read_text()  # test_lab's steps.shot("name"), the others' "name.png"
        assert f'"{name}"' in source or f'"{name}.png"' in source, \
            f"{test} takes no screenshot named {name} (for docs/{picture})"

    monkeypatch.setattr(shots, "ARTIFACTS", tmp_path / "artifacts")
    monkeypatch.setattr(shots, "DOCS", tmp_path / "docs")
    (tmp_path / "docs" / "tutorial").mkdir(parents=True)
    assert shots.main() == 1 and not any((tmp_path / "docs").rglob("*.png"))
    for picture, (folder, name, _) in shots.SHOTS.items():
        (tmp_path / "artifacts" / folder).mkdir(parents=True, exist_ok=True)
        stem = f"07-{name}" if folder == "lab" else name
        (tmp_path / "artifacts" / folder / f"{stem}.png").write_bytes(picture.encode())
    (tmp_path / "artifacts" / "lab" / "08-panel-dark.png").write_bytes(b"not the panel")
    assert shots.main() == 0
    assert (tmp_path / "docs" / "workstation-panel.png").read_bytes() == b"workstation-panel.png"
