"""Sphinx configuration of kubejax's documentation (`make docs`; built strictly in `make test`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

from kubejax.version import __version__

project = "kubejax"
author = "the kubejax authors"
copyright = "2026, the kubejax authors"
release = __version__

extensions = ["myst_parser", "kubejax_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
# Headings get anchors, so guides link to each other's sections ([text](llm.md#lora)).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
# Every cross-reference must resolve: a broken one fails the build (-W -n in the Makefile).
nitpicky = True

html_theme = "furo"
html_title = f"kubejax {release}"
