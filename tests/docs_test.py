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
* The built site stands alone and fits its column: every relative link and
  #fragment of every page resolves within it (the research results pages
  the guides cite included), no page loads a script, style sheet, image or
  font from elsewhere (no MathJax from a CDN: the site reads offline), and
  the Python and text blocks of the home page and the guides fit the
  theme's column (shell commands wrap, docs/_static/tf_dpadam.css).
"""

import contextlib
import glob
import html.parser
import io
import os
import re
import shutil
import tempfile
import unicodedata

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest
from sphinx.cmd import build

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = os.path.join(_ROOT, "docs")
_README = os.path.join(_ROOT, "README.md")
_GUIDES = sorted(glob.glob(os.path.join(_DOCS, "guides", "*.md")))
# Furo's 46em column shows about 90 characters of code at the default font
# sizes; 88 (black's line) leaves a margin for fonts a little wider.
COLUMN = 88
# The code blocks that wrap instead of keeping their lines (the shell
# commands: indented blocks are highlight-none), docs/_static/tf_dpadam.css.
WRAPPED = frozenset({"none", "sh", "bash", "shell", "console"})


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


class Page(html.parser.HTMLParser):
    """What the tests read of a built HTML page: its element ids, the URLs
    it links to or loads, and its <pre> blocks with their language."""

    def __init__(self, text):
        super().__init__()
        self.ids = set()
        self.links = []  # (tag, attribute, URL)
        self.loads = []  # URLs of scripts, style sheets, images, fonts...
        self.blocks = []  # (language or None, text)
        self._language = None
        self._pre = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) is not None:
                self.links.append((tag, name, attrs[name]))
        if tag in ("script", "img", "iframe", "source", "video", "audio",
                   "embed") and attrs.get("src"):
            self.loads.append(attrs["src"])
        if tag == "link" and attrs.get("href") and set(
                (attrs.get("rel") or "").split()) & {
                    "stylesheet", "preload", "icon", "modulepreload"}:
            self.loads.append(attrs["href"])
        # Sphinx writes a block as <div class="highlight-LANG ..."><div
        # class="highlight"><pre>.
        languages = [c[len("highlight-"):] for c in
                     (attrs.get("class") or "").split()
                     if c.startswith("highlight-")]
        if tag == "div" and languages:
            self._language = languages[0]
        if tag == "pre":
            self._pre = []

    def handle_endtag(self, tag):
        if tag == "pre" and self._pre is not None:
            self.blocks.append((self._language, "".join(self._pre)))
            self._pre, self._language = None, None

    def handle_data(self, data):
        if self._pre is not None:
            self._pre.append(data)


def external(url):
    """Whether a URL leads off the site (a scheme, or //host/...)."""
    return bool(re.match(r"[A-Za-z][A-Za-z0-9+.-]*:|//", url))


def excerpt(pattern, text):
    """The text around the first match of `pattern`, or "" if none."""
    match = re.search(pattern, text)
    return text[max(match.start() - 40, 0):match.end() + 40] if match else ""


def width(line):
    """The columns a line of code takes (combining marks take none)."""
    return sum(not unicodedata.combining(c) for c in line.expandtabs())


class BuiltSite(absltest.TestCase):
    """The site, built once (strictly) for the tests that read it."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.output = tempfile.mkdtemp()
        cls.status = sphinx_build(_DOCS, cls.output)
        cls.pages = {}
        for parent, folders, names in os.walk(cls.output):
            folders[:] = [f for f in folders if not f.startswith(".")]
            for name in names:
                if name.endswith(".html"):
                    path = os.path.join(parent, name)
                    with open(path, encoding="utf-8") as f:
                        cls.pages[os.path.relpath(path, cls.output)] = Page(
                            f.read())

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.output, ignore_errors=True)
        super().tearDownClass()

    def guide_pages(self):
        """The home page and the guides, as paths in the site."""
        return ["index.html"] + [
            "guides/" + os.path.splitext(os.path.basename(g))[0] + ".html"
            for g in _GUIDES]


@pytest.mark.slow
class SphinxBuildTest(BuiltSite):

    def test_the_docs_build_with_warnings_as_errors(self):
        self.assertEqual(self.status, 0)
        for page in ("index", "api", "guides/optimizers",
                     "guides/layers_and_clipping", "guides/contributing",
                     "research/results/RESULTS"):
            self.assertIn(page + ".html", self.pages)
        with open(os.path.join(self.output, "api.html"), encoding="utf-8") as f:
            api = f.read()
        # The reference is generated from the docstrings.
        for name in ("tf_dpadam.make_private", "tf_dpadam.DPAdamCorrected",
                     "tf_dpadam.data.poisson_batches",
                     "tf_dpadam.data.sharding.sharded_poisson_batches",
                     "tf_dpadam.tools.audit.epsilon_lower_bound",
                     "tf_dpadam.privatizer.ghost_clipping.describe",
                     "tf_dpadam.layers.WSConv2D",
                     "tf_dpadam.tools.diagnostics.MomentDiagnostics",
                     "tf_dpadam.register_ghost_rule",
                     "tf_dpadam.accounting.accountants.register_accountant"):
            self.assertIn(f'id="{name}"', api, name)

    def test_every_relative_link_resolves_in_the_site(self):
        for page, parsed in sorted(self.pages.items()):
            for tag, attribute, url in parsed.links:
                if external(url) or not url.strip():
                    continue
                path, _, fragment = url.partition("#")
                path = path.split("?")[0]
                target = os.path.normpath(os.path.join(
                    os.path.dirname(page), path)) if path else page
                with self.subTest(page=page, tag=tag, url=url):
                    self.assertFalse(target.startswith(".."),
                                     f"{attribute}={url!r} leaves the site")
                    self.assertTrue(os.path.isfile(
                        os.path.join(self.output, target)),
                        f"{attribute}={url!r}: no {target} in the site")
                    if fragment and target in self.pages:
                        self.assertIn(fragment, self.pages[target].ids,
                                      f"{attribute}={url!r}: no #{fragment}"
                                      f" in {target}")

    def test_the_guides_links_to_results_stay_in_the_site(self):
        # ../../research/results/X.md in the Markdown (GitHub's link) is the
        # site's page research/results/X.html.
        links = [url for _, _, url in
                 self.pages["guides/optimizers.html"].links
                 if "research/results/" in url]
        self.assertIn("../research/results/RESULTS.html", links)
        self.assertFalse([u for u in links
                          if not u.startswith("../research/results/")
                          or not u.split("#")[0].endswith(".html")], links)

    def test_nothing_loads_from_elsewhere(self):
        for page, parsed in sorted(self.pages.items()):
            with self.subTest(page=page):
                self.assertEqual([u for u in parsed.loads if external(u)], [])
                self.assertFalse(
                    [u for u in parsed.loads if "mathjax" in u.lower()])
        for sheet in glob.glob(os.path.join(self.output, "_static", "**",
                                            "*.css"), recursive=True):
            with open(sheet, encoding="utf-8") as f:
                css = f.read()
            with self.subTest(sheet=os.path.relpath(sheet, self.output)):
                self.assertEqual(excerpt(
                    r"(?i)url\(\s*['\"]?(https?:)?//|@import\s", css), "")
        # No page falls back to raw LaTeX for a reader without MathJax.
        for page in self.guide_pages():
            with open(os.path.join(self.output, page), encoding="utf-8") as f:
                text = f.read()
            with self.subTest(page=page):
                self.assertEqual(excerpt(
                    r"\$\\[A-Za-z]|\\\(|\\operatorname", text), "")

    def test_code_fits_the_column(self):
        checked = 0
        for page in self.guide_pages():
            for language, block in self.pages[page].blocks:
                if language in WRAPPED:
                    continue
                for line in block.splitlines():
                    checked += 1
                    with self.subTest(page=page, line=line):
                        self.assertLessEqual(width(line), COLUMN)
        self.assertGreater(checked, 100)

    def test_shell_commands_wrap(self):
        with open(os.path.join(self.output, "index.html"),
                  encoding="utf-8") as f:
            self.assertIn("_static/tf_dpadam.css", f.read())
        with open(os.path.join(self.output, "_static", "tf_dpadam.css"),
                  encoding="utf-8") as f:
            css = f.read()
        for language in WRAPPED:
            self.assertIn(f"div.highlight-{language} pre", css)
        self.assertIn("white-space: pre-wrap", css)
        # The long commands are indented blocks (none).
        self.assertIn("none", {language for language, _ in
                               self.pages["guides/optimizers.html"].blocks})


class SphinxProjectTest(absltest.TestCase):

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


class SiteReadingTest(absltest.TestCase):
    """The helpers of the site's tests, on pages written here."""

    def test_the_page_parser(self):
        page = Page(
            '<p id="a">x</p><a href="b.html#c">b</a><img src="i.png">'
            '<link rel="stylesheet" href="https://cdn.example/s.css">'
            '<script src="//cdn.example/m.js"></script>'
            '<div class="highlight-python notranslate"><div class="highlight">'
            '<pre><span>x</span> = 1\ny &lt; 2\n</pre></div></div>'
            '<div class="highlight-none"><div class="highlight"><pre>ls'
            '</pre></div></div><pre>z</pre>')
        self.assertEqual(page.ids, {"a"})
        self.assertIn(("a", "href", "b.html#c"), page.links)
        self.assertEqual(page.loads, ["i.png", "https://cdn.example/s.css",
                                      "//cdn.example/m.js"])
        self.assertEqual(page.blocks, [("python", "x = 1\ny < 2\n"),
                                       ("none", "ls"), (None, "z")])
        self.assertEqual([external(u) for u in page.loads],
                         [False, True, True])

    def test_the_excerpt(self):
        self.assertEqual(excerpt(r"\\\(", "a \\(x\\) b"), "a \\(x\\) b")
        self.assertEqual(excerpt(r"\\\(", "a b"), "")

    def test_the_width(self):
        self.assertEqual(width("g\u0303 = 1"), 5)  # g̃: one column.
        self.assertEqual(width("\tx"), 9)


class CodeBlocksTest(absltest.TestCase):

    def test_the_extraction(self):
        text = ("# T\n\n```python\na = 1\n```\n\n```text\nb = 2\n```\n"
                "````{code-block} python\nc = 3\n````\n```sh\n$ ls\n```\n"
                "```python\nprint(a)\n```\n")
        self.assertEqual(python_blocks(text),
                         [(4, "a = 1\n"), (17, "print(a)\n")])
        with self.assertRaisesRegex(ValueError, "closing"):
            python_blocks("```python\na = 1\n")

    @pytest.mark.slow
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
