"""The docs that come from the code (docs/generate.py): every setting a site configures has help
text, and the committed configuration reference and list of failures are what the code makes, so
they cannot drift (as JupyterHub's docs/test_docs.py keeps its generated pages true)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_help(generate):
    assert generate.missing_help() == []


@pytest.mark.parametrize("page", ["configuration.md", "failures.md"])
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
