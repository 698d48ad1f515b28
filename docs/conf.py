"""Sphinx configuration of the tf_dpadam documentation.

Build it (warnings are errors, as in tests/docs_test.py):

    python -m sphinx -W -b html docs docs/_build/html

The guides are Markdown (MyST); the API reference is generated from the
docstrings (autodoc, Google style through napoleon); the research results
pages the guides cite come from research/results/ (docs/research/results is
a link to it). The theme is Furo, and the built site loads nothing from
elsewhere: it reads offline.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _ROOT)
# Quiet TensorFlow's C++ logging while autodoc imports the package.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

project = "tf_dpadam"
author = "tf_dpadam authors"
copyright = "tf_dpadam authors"  # pylint: disable=redefined-builtin


def _version():
    """The package's version, read without importing TensorFlow."""
    for name in ("version.py", "__init__.py"):
        path = os.path.join(_ROOT, "tf_dpadam", name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("__version__"):
                    return line.split("=", 1)[1].strip().strip("\"'")
    return ""


release = version = _version()

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"


def _fragments(folder):
    """The Markdown files under `folder` (relative to docs/) that start with
    no `# ` title: parts a guide includes (`{include}`), not pages."""
    out = []
    for parent, _, names in os.walk(os.path.join(_HERE, folder),
                                    followlinks=True):
        for name in sorted(names):
            if not name.endswith(".md"):
                continue
            path = os.path.join(parent, name)
            with open(path, encoding="utf-8") as f:
                first = next((line for line in f if line.strip()), "")
            if not first.startswith("# "):
                out.append(os.path.relpath(path, _HERE).replace(os.sep, "/"))
    return out


# docs/research/results is a link to the repository's research/results/:
# its pages (the results tables the guides cite) are pages of the site, and
# the guides' links to them (../../research/results/X.md, which GitHub
# follows) lead there (_link_repository_files).
exclude_patterns = ["_build"] + _fragments("research/results")

myst_heading_anchors = 3

# `name` in a docstring is code, as it is in the Markdown guides.
default_role = "code"

autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes of NamedTuples as fields, not a second description of each.
napoleon_use_ivar = True

# Furo: its 46em column shows about 90 characters of code at the default
# font sizes (alabaster's cut code off at about 75). tests/docs_test.py holds
# the Python and text blocks of the pages to 88 characters a line; shell
# commands wrap instead (_static/tf_dpadam.css).
html_theme = "furo"
html_title = "tf_dpadam"
html_static_path = ["_static"]
html_css_files = ["tf_dpadam.css"]
# Everything a page loads comes with the site: no MathJax (the guides write
# their few formulas in Unicode, and no extension adds math support), no
# web fonts, nothing from a CDN. tests/docs_test.py checks the built pages.


def _link_repository_files(app, doctree):
    """A guide's link to a page of the repository outside docs/ that the site
    also has (../../research/results/X.md: the link GitHub follows) leads to
    that page of the site (research/results/X), which docs/research/results
    brings in. MyST reports any other link out of docs/ as a missing
    document: the site has no page there."""
    from sphinx import addnodes  # pylint: disable=import-outside-toplevel

    source = os.path.abspath(app.srcdir)
    for node in doctree.findall(addnodes.pending_xref):
        if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
            continue
        # MyST names the target as a path relative to docs/ (../research/...).
        target = os.path.normpath(os.path.join(source, node["reftarget"]))
        if target.startswith(source + os.sep) or not target.startswith(
                _ROOT + os.sep):
            continue
        docname = os.path.relpath(target, _ROOT).replace(os.sep, "/")
        if docname in app.env.found_docs:
            node["reftarget"] = docname


def setup(app):
    app.connect("doctree-read", _link_repository_files)
