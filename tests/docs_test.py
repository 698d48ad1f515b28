"""The documentation builds strictly, and its Python code runs.

* The Sphinx site (docs/: MyST guides and the API reference from the
  docstrings) builds with warnings as errors, as CI builds it; a tiny project
  with a broken reference shows that such a build does fail.
* Every ```python block of README.md and docs/guides/*.md runs: the blocks of
  one file in order, in one namespace (as a reader pastes them into one
  session), from a scratch directory. Blocks not meant to run use another
  info string (```text, or ```{code-block} python), which should stay rare.
  The README's Quickstart is in the fast tier, the guides in the slow one.
* The relative links of README.md and of the guides point to files that exist.
"""

import contextlib
import glob
import io
import os
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest
from sphinx.cmd import build

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = os.path.join(_ROOT, "docs")
_README = os.path.join(_ROOT, "README.md")
_GUIDES = sorted(glob.glob(os.path.join(_DOCS, "guides", "*.md")))


def python_blocks(text):
    """The ```python fenced blocks of a Markdown text, as (first line number,
    code) pairs; other info strings (```text, ```sh, ```{code-block} python)
    are not Python to run."""
    blocks = []
    fence, info, start, lines = None, None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            match = re.match(r"(`{3,}|~{3,})\s*(.*)$", stripped)
            if match:
                fence, info, start, lines = match.group(1), match.group(2), number + 1, []
            continue
        if stripped.startswith(fence) and not stripped[len(fence):].strip():
            if info == "python":
                blocks.append((start, "\n".join(lines) + "\n"))
            fence = None
            continue
        lines.append(line)
    if fence is not None:
        raise ValueError(f"Expected a closing {fence} for the block at line"
                         f" {start - 1}.")
    return blocks


def run_blocks(path, text=None):
    """Runs a Markdown file's Python blocks in order in one namespace, from a
    scratch directory; an exception names the file and the block's line."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    namespace = {"__name__": "__main__"}
    keras.backend.clear_session()
    with tempfile.TemporaryDirectory() as scratch, _chdir(scratch), \
            contextlib.redirect_stdout(io.StringIO()) as out:
        for start, code in python_blocks(text):
            # Line numbers in tracebacks are the Markdown file's.
            exec(compile("\n" * (start - 1) + code, path, "exec"), namespace)  # pylint: disable=exec-used
    return out.getvalue()


@contextlib.contextmanager
def _chdir(path):
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def sphinx_build(source, output):
    """The strict build of tests and CI: warnings are errors, all reported."""
    return build.build_main(
        ["-W", "--keep-going", "-E", "-b", "html", "-q", source, output])


def relative_links(text):
    """The targets of a Markdown text's relative links and images, without
    their #fragments (web and mail links, and pure fragments, left out)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


class SphinxBuildTest(absltest.TestCase):

    @pytest.mark.slow
    def test_the_docs_build_with_warnings_as_errors(self):
        with tempfile.TemporaryDirectory() as output:
            self.assertEqual(sphinx_build(_DOCS, output), 0)
            for page in ("index", "api", "guides/optimizers",
                         "guides/layers_and_clipping", "guides/contributing"):
                self.assertTrue(
                    os.path.exists(os.path.join(output, page + ".html")), page)
            with open(os.path.join(output, "api.html"), encoding="utf-8") as f:
                api = f.read()
            # The reference is generated from the docstrings.
            for name in ("tf_dpadam.make_private", "tf_dpadam.DPAdamCorrected",
                         "tf_dpadam.data.poisson_batches",
                         "tf_dpadam.sharding.sharded_poisson_batches",
                         "tf_dpadam.audit.epsilon_lower_bound",
                         "tf_dpadam.ghost_clipping.describe",
                         "tf_dpadam.layers.WSConv2D",
                         "tf_dpadam.diagnostics.MomentDiagnostics"):
                self.assertIn(f'id="{name}"', api, name)

    def test_a_broken_reference_fails_the_build(self):
        with tempfile.TemporaryDirectory() as project:
            with open(os.path.join(project, "conf.py"), "w",
                      encoding="utf-8") as f:
                f.write('extensions = ["myst_parser"]\n')
            with open(os.path.join(project, "index.md"), "w",
                      encoding="utf-8") as f:
                f.write("# Title\n\nSee [the guide](guides/missing.md).\n")
            output = os.path.join(project, "_build")
            with contextlib.redirect_stderr(io.StringIO()):
                self.assertNotEqual(sphinx_build(project, output), 0)

    def test_every_guide_is_in_the_table_of_contents(self):
        with open(os.path.join(_DOCS, "index.md"), encoding="utf-8") as f:
            index = f.read()
        self.assertGreaterEqual(len(_GUIDES), 11)
        for guide in _GUIDES:
            name = os.path.splitext(os.path.basename(guide))[0]
            self.assertIn(f"guides/{name}\n", index)


class CodeBlocksTest(absltest.TestCase):

    def test_the_extraction(self):
        text = ("# T\n\n```python\na = 1\n```\n\n```text\nb = 2\n```\n"
                "````{code-block} python\nc = 3\n````\n```sh\n$ ls\n```\n"
                "```python\nprint(a)\n```\n")
        self.assertEqual(python_blocks(text),
                         [(4, "a = 1\n"), (17, "print(a)\n")])
        with self.assertRaisesRegex(ValueError, "closing"):
            python_blocks("```python\na = 1\n")

    def test_a_failing_block_fails_with_its_file_and_line(self):
        text = "Intro.\n\n```python\nx = 1\n```\n\n```python\nx / 0\n```\n"
        try:
            run_blocks("guide.md", text)
        except ZeroDivisionError as error:
            frame = error.__traceback__
        else:
            self.fail("the failing block did not raise")
        while frame.tb_next is not None:
            frame = frame.tb_next
        self.assertEqual(frame.tb_frame.f_code.co_filename, "guide.md")
        self.assertEqual(frame.tb_lineno, 8)

    @pytest.mark.slow
    def test_the_readme_quickstart_runs(self):
        with open(_README, encoding="utf-8") as f:
            blocks = python_blocks(f.read())
        self.assertTrue(blocks, "README.md has no ```python block")
        out = run_blocks(_README)
        self.assertRegex(out, r"spent epsilon \d+\.\d\d at delta 1e-5")


# 5-30 s each (they train small models; fine-tuning builds a keras-hub BERT).
@pytest.mark.slow
class GuideBlocksTest(parameterized.TestCase):

    @parameterized.named_parameters(
        (os.path.splitext(os.path.basename(g))[0], g) for g in _GUIDES)
    def test_the_guide_runs(self, path):
        run_blocks(path)


class LinksTest(absltest.TestCase):

    def test_relative_links_point_to_files(self):
        for path in [_README, os.path.join(_DOCS, "index.md"),
                     os.path.join(_DOCS, "api.md")] + _GUIDES:
            with open(path, encoding="utf-8") as f:
                targets = relative_links(f.read())
            for target in targets:
                with self.subTest(page=os.path.relpath(path, _ROOT),
                                  target=target):
                    self.assertTrue(os.path.exists(os.path.join(
                        os.path.dirname(path), target)))

    def test_the_link_extraction(self):
        self.assertEqual(
            relative_links("[a](docs/x.md#y) [b](https://e.org) [c](#z)"
                           " ![d](img.png)"),
            ["docs/x.md", "img.png"])


if __name__ == "__main__":
    absltest.main()
