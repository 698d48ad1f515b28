"""Sphinx configuration of the tf_dpadam documentation.

Build it (warnings are errors, as in tests/docs_test.py):

    python -m sphinx -W -b html docs docs/_build/html

The guides are Markdown (MyST); the API reference is generated from the
docstrings (autodoc, Google style through napoleon).
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
# The research results pages (moving to research/results/) and the build
# output are not part of the site.
exclude_patterns = [
    "_build",
    "RESULTS*",
    "ABLATIONS*",
    "BEST_RECIPE*",
    "DIAGNOSTICS*",
    "FINETUNE*",
    "REGIME_MAP*",
]

myst_enable_extensions = ["dollarmath"]
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

html_theme = "alabaster"
html_title = "tf_dpadam"


def _link_repository_files(app, doctree):
    """Links from a guide to a Markdown file of the repository outside docs/
    (research/README.md, research/results/...) point at that file in the
    checkout, relative to the built page, as they do on GitHub; MyST would
    look for a page of the site. A missing file is left to MyST to report."""
    from docutils import nodes  # pylint: disable=import-outside-toplevel
    from sphinx import addnodes  # pylint: disable=import-outside-toplevel

    source = os.path.abspath(app.srcdir)
    page_dir = os.path.join(os.path.abspath(app.outdir),
                            os.path.dirname(app.env.docname))
    for node in list(doctree.findall(addnodes.pending_xref)):
        target = os.path.normpath(os.path.join(source,
                                               node.get("reftarget", "")))
        if node.get("reftype") != "myst" or target.startswith(source + os.sep):
            continue
        path = target if os.path.isfile(target) else target + ".md"
        if not os.path.isfile(path):
            continue
        anchor = node.get("reftargetid")
        uri = os.path.relpath(path, page_dir) + (f"#{anchor}" if anchor else "")
        reference = nodes.reference("", "", internal=False, refuri=uri)
        reference += [child.deepcopy() for child in node.children]
        node.replace_self(reference)


def setup(app):
    app.connect("doctree-read", _link_repository_files)
