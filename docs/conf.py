"""Sphinx configuration: the docs site (``./dev docs``; CI builds it in strict mode, warnings fail).

Pages are MyST Markdown. Most of them include sections of the README, so the README and the site
never disagree; the API reference comes from the docstrings (autodoc).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

project = "plexrl"
author = "the plexrl authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "plexrl"
myst_heading_anchors = 3  # README sections link to each other by heading
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
suppress_warnings = ["myst.header"]  # included README sections start below the page's own title level
