"""Sphinx configuration of the documentation site: MyST Markdown pages, the PyData theme (as the
Jupyter projects' sites), built with warnings as errors by scripts/test.sh and tests/test_docs.py.
The pages generated from the code (configuration, failures, metrics, the REST API) are written by
generate.py and committed; the build only reads them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the version of this checkout

from kubevirt_spawner import __version__

project = "kubevirt-spawner"
author = "the kubevirt-spawner authors"
copyright = "the kubevirt-spawner authors"
version = release = __version__

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Not pages: the generator, the build's requirements, the API document (rendered into api.md) and
# a local build's output.
exclude_patterns = ["_build", "generate.py", "requirements.txt", "openapi.yaml", "**/.*"]
myst_heading_anchors = 3  # `page.md#a-heading` links, as GitHub makes them
myst_enable_extensions = ["deflist"]

html_theme = "pydata_sphinx_theme"
html_title = f"kubevirt-spawner {version}"
html_theme_options = {"navigation_depth": 2, "show_toc_level": 2}
