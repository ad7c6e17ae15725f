"""Sphinx configuration of the amir-verl documentation: MyST markdown pages, an API reference from docstrings.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (tests/test_docs.py builds it so, with
warnings as errors, in the test suite).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# autodoc imports the modules it documents; the CPU switch must stay off so that nothing registers a platform
os.environ.pop("AMIR_VERL_CPU", None)

import amir_verl  # noqa: E402

project = "amir-verl"
author = "the amir-verl developers"
release = version = amir_verl.__version__
copyright = "2026, the amir-verl developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# results/ holds the tables the measuring scripts write; pages include them, so they are not pages themselves
exclude_patterns = ["_build", "results", "eval_examples"]
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3  # `page.md#a-heading` links resolve, and a broken one is a warning
suppress_warnings = []
nitpicky = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"amir-verl {release}"
html_theme_options = {"description": "AMIR-GRPO and AMIR-GSPO for verl 0.9.1", "page_width": "1180px",
                      "sidebar_width": "240px"}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
