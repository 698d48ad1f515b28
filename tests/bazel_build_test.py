"""The top-level Bazel BUILD file covers the library and is the only one.

Nothing in CI runs Bazel: the hand-written BUILD is kept for users who
vendor the package into a Bazel monorepo (its comment says so). Checked
here from its text: its one py_library, //:tf_dpadam, globs every module of
src/tf_dpadam (a new subpackage included), puts src/ on the import path and
ships py.typed; and no other BUILD file in the repository cuts a folder out
of that glob (Bazel's glob stops at a subpackage). Where a `bazel` binary is
installed, it also builds //:tf_dpadam, in a copy of the library in a
temporary directory, so no bazel-* folders land in the checkout.
"""

import ast
import os
import re
import shutil
import subprocess
import tempfile

import pytest
from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
_PACKAGE = "src/tf_dpadam"
_BUILD_NAMES = ("BUILD", "BUILD.bazel")


def _glob_regex(pattern):
    """A regex for one Bazel glob pattern: `**` is zero or more folders,
    `*` any characters but `/`."""
    segments = pattern.split("/")
    parts = []
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == "**":
            parts.append("(?:[^/]+/)*" + ("[^/]+" if last else ""))
        else:
            parts.append(re.escape(segment).replace(r"\*", "[^/]*")
                         + ("" if last else "/"))
    return re.compile("".join(parts) + r"\Z")


def _globbed(path, include, exclude=()):
    def matches(patterns):
        return any(_glob_regex(p).match(path) for p in patterns)
    return matches(include) and not matches(exclude)


def _library_rule():
    """The keyword arguments of the BUILD file's py_library `tf_dpadam`."""
    with open(os.path.join(_ROOT, "BUILD"), encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename="BUILD")
    rules = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "py_library"):
            rules.append({k.arg: k.value for k in node.keywords})
    named = [r for r in rules
             if ast.literal_eval(r.get("name")) == "tf_dpadam"]
    assert len(named) == 1, f"{len(named)} py_library named tf_dpadam"
    return named[0]


def _srcs_glob(rule):
    """(include, exclude) of the rule's `srcs = glob([...], exclude=...)`."""
    srcs = rule["srcs"]
    assert (isinstance(srcs, ast.Call)
            and getattr(srcs.func, "id", None) == "glob"), (
                "srcs is not a glob(...)")
    keywords = {k.arg: ast.literal_eval(k.value) for k in srcs.keywords}
    include = ast.literal_eval(srcs.args[0]) if srcs.args else (
        keywords["include"])
    return include, keywords.get("exclude", [])


def _library_modules():
    modules = []
    for folder, dirs, files in os.walk(os.path.join(_ROOT, _PACKAGE)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), _ROOT)
                modules.append(path.replace(os.sep, "/"))
    return sorted(modules)


class GlobTest(absltest.TestCase):
    """The glob matcher the other tests rely on behaves as Bazel's."""

    def test_star_stays_in_its_folder_and_double_star_spans_any(self):
        self.assertTrue(_globbed("a/x.py", ["a/*.py"]))
        self.assertFalse(_globbed("a/b/x.py", ["a/*.py"]))
        self.assertFalse(_globbed("a/x.pyc", ["a/*.py"]))
        for path in ("a/x.py", "a/b/x.py", "a/b/c/x.py"):
            self.assertTrue(_globbed(path, ["a/**/*.py"]), path)
        self.assertFalse(_globbed("b/a/x.py", ["a/**/*.py"]))
        self.assertTrue(_globbed("a/b/c", ["a/**"]))
        self.assertFalse(_globbed("a/b/x.py", ["a/**/*.py"], ["a/b/*"]))

    def test_a_one_folder_glob_misses_the_subpackages(self):
        modules = _library_modules()
        missed = [m for m in modules
                  if not _globbed(m, [_PACKAGE + "/*.py"])]
        self.assertNotEmpty(missed)


class TopLevelBuildTest(absltest.TestCase):

    def test_the_glob_covers_every_library_module(self):
        include, exclude = _srcs_glob(_library_rule())
        modules = _library_modules()
        self.assertIn(_PACKAGE + "/__init__.py", modules)
        self.assertEqual(
            [], [m for m in modules if not _globbed(m, include, exclude)],
            "library modules the BUILD file's srcs glob misses")
        for pattern in include:
            # Tests, research or tools would become library code.
            self.assertStartsWith(pattern, _PACKAGE + "/")

    def test_src_is_on_the_import_path(self):
        rule = _library_rule()
        self.assertEqual(["src"], ast.literal_eval(rule["imports"]))

    def test_data_files_exist_and_include_py_typed(self):
        data = ast.literal_eval(_library_rule()["data"])
        self.assertIn(_PACKAGE + "/py.typed", data)
        for path in data:
            self.assertTrue(os.path.isfile(os.path.join(_ROOT, path)), path)

    def test_no_build_file_below_the_top_level(self):
        found = []
        for folder, dirs, files in os.walk(_ROOT):
            # Not the repository's: git, virtualenvs, Bazel's and
            # setuptools' outputs, caches.
            dirs[:] = [
                d for d in dirs
                if not d.startswith((".", "bazel-"))
                and d not in ("__pycache__", "build", "_build", "venv")
                and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg"))]
            found += [os.path.relpath(os.path.join(folder, name), _ROOT)
                      for name in files if name in _BUILD_NAMES]
        self.assertEqual(["BUILD"], found)


@pytest.mark.slow  # 5-10 s: a cold Bazel in batch mode.
@absltest.skipIf(shutil.which("bazel") is None, "bazel is not installed")
class BazelBuildsTest(absltest.TestCase):

    def test_bazel_builds_the_library(self):
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            workspace = os.path.join(tmp, "workspace")
            shutil.copytree(
                os.path.join(_ROOT, _PACKAGE),
                os.path.join(workspace, _PACKAGE),
                ignore=shutil.ignore_patterns("__pycache__"))
            for name in ("BUILD", "MODULE.bazel"):
                shutil.copy(os.path.join(_ROOT, name), workspace)
            # Bazel before 6 finds the workspace root by this file only.
            open(os.path.join(workspace, "WORKSPACE"), "w").close()
            result = subprocess.run(
                ["bazel", "--batch", "--output_user_root="
                 + os.path.join(tmp, "bazel_root"),
                 "build", "//:tf_dpadam"],
                cwd=workspace, capture_output=True, text=True, timeout=600,
                check=False)
            self.assertEqual(0, result.returncode,
                             result.stdout + result.stderr)


if __name__ == "__main__":
    absltest.main()
