"""The Bazel BUILD files are the ones tools/build_files.py derives.

The committed BUILD files must equal what `python -m tools.build_files`
writes from the imports (so a moved or split module, a new import or a new
test file shows up here until the BUILD files are regenerated); the
generator itself is tested on small trees in a temporary directory.
"""

import os
import pathlib
import tempfile
import textwrap
from unittest import mock

from absl.testing import absltest

from tools import build_files

_LOCK = textwrap.dedent("""\
    absl-py==2.1.0 \\
        --hash=sha256:00
    numpy==2.0.0
    # via keras
    PyYAML==6.0
""")


def _repo_root():
    # The real path: under `bazel test` this file is a runfiles symlink.
    return str(pathlib.Path(os.path.realpath(__file__)).parent.parent)


class CommittedBuildFilesTest(absltest.TestCase):

    def test_build_files_match_the_imports(self):
        diffs = build_files.differences(_repo_root())
        self.assertEqual(
            {}, diffs,
            "BUILD files differ from the imports; run `python -m"
            " tools.build_files` (and, if a data file or EXTRAS key moved,"
            " update EXTRAS in tools/build_files.py):\n"
            + "".join(diffs.values()))


class GeneratorTest(absltest.TestCase):

    def workspace(self, files):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        root = tmp.name
        files = {"requirements_lock.txt": _LOCK, **files}
        for path, text in files.items():
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(textwrap.dedent(text))
        return root

    def generate(self, root, extras=None):
        return build_files.generate(root, roots=("lib", "tests"),
                                    extras=extras or {})

    def test_targets_and_deps_from_the_imports(self):
        root = self.workspace({
            "lib/__init__.py": "from lib import core\n",
            "lib/core.py": """\
                import os
                import numpy as np
                from lib import util
                from lib.sub import rule
                try:
                    import matplotlib  # Optional: not a dep.
                except ImportError:
                    matplotlib = None
                try:
                    import tomllib
                except ModuleNotFoundError:
                    import tomli as tomllib  # A fallback: not a dep.
            """,
            "lib/util.py": "import yaml\nfrom absl import flags\n",
            "lib/cli.py": """\
                from . import util
                if __name__ == "__main__":
                    pass
            """,
            "lib/sub/rule.py": """\
                from typing import TYPE_CHECKING
                from ..util import flags
                if TYPE_CHECKING:
                    from lib import core
            """,
        })
        out = self.generate(root)
        self.assertEqual(["lib/BUILD", "lib/sub/BUILD"], sorted(out))
        self.assertEqual(build_files._HEADER + "\n" + textwrap.dedent("""\
            load("@rules_python//python:defs.bzl", "py_binary", "py_library")

            package(default_visibility = ["//visibility:public"])

            py_library(
                name = "lib",
                srcs = ["__init__.py"],
                deps = [":core"],
            )

            py_binary(
                name = "cli",
                srcs = ["cli.py"],
                deps = [":util"],
            )

            py_library(
                name = "core",
                srcs = ["core.py"],
                deps = [":util", "//lib/sub:rule", "@pypi//numpy"],
            )

            py_library(
                name = "util",
                srcs = ["util.py"],
                deps = ["@pypi//absl_py", "@pypi//pyyaml"],
            )
        """), out["lib/BUILD"])
        self.assertIn(textwrap.dedent("""\
            py_library(
                name = "rule",
                srcs = ["rule.py"],
                deps = ["//lib:util"],
            )
        """), out["lib/sub/BUILD"])

    def test_tests_sizes_helpers_and_subprocess_scripts(self):
        root = self.workspace({
            "lib/core.py": "X = 1\n",
            "tests/conftest.py": "import os\n",
            "tests/helpers.py": "from lib import core\n",
            "tests/run_check.py": "if __name__ == '__main__':\n  pass\n",
            "tests/core_test.py": """\
                import os
                import helpers
                import pytest
                pytestmark = pytest.mark.slow
                SCRIPT = os.path.join(os.path.dirname(__file__),
                                      "run_check.py")
            """,
            "tests/fast_test.py": "from lib import core\n"
                                  "TEXT = 'pytestmark = pytest.mark.slow'\n",
            "tests/testdata/sample.py": "import not_a_dep\n",
        })
        lock = os.path.join(root, "requirements_lock.txt")
        with open(lock, "a", encoding="utf-8") as f:
            f.write("pytest==8.0\n")
        text = self.generate(root, extras={
            "tests/fast_test.py": {"data": ["testdata/*.py"],
                                   "tags": ["external"],
                                   "comment": "Why it is special."},
        })["tests/BUILD"]
        self.assertIn(textwrap.dedent("""\
            py_test(
                name = "core_test",
                size = "large",
                srcs = ["core_test.py"],
                data = [":run_check"],
                env = _ENV,
                deps = [":helpers", "@pypi//pytest"],
            )
        """), text)
        self.assertIn(textwrap.dedent("""\
            # Why it is special.
            py_test(
                name = "fast_test",
                size = "medium",
                srcs = ["fast_test.py"],
                data = glob(["testdata/*.py"]),
                env = _ENV,
                tags = ["external"],
                deps = ["//lib:core"],
            )
        """), text)
        self.assertIn('py_binary(\n    name = "run_check",', text)
        self.assertNotIn('srcs = ["conftest.py"]', text)
        self.assertNotIn("sample.py\"]", text)

    def test_a_conftest_marking_slow_makes_its_tests_large(self):
        root = self.workspace({
            "tests/conftest.py": "item.add_marker(pytest.mark.slow)\n",
            "tests/a_test.py": "import os\n",
        })
        self.assertIn('size = "large"', self.generate(root)["tests/BUILD"])

    def test_data_labels_export_files_of_other_packages(self):
        root = self.workspace({
            "README.md": "# hi\n",
            "lib/core.py": "X = 1\n",
            "lib/notes.txt": "x\n",
            "tests/a_test.py": "import os\n",
            "MODULE.bazel":
                'pip.parse(requirements_lock = "//:requirements_lock.txt")\n',
        })
        out = self.generate(root, extras={"tests/a_test.py": {"data": [
            "//:README.md", "//lib:notes.txt", "//lib:core"]}})
        self.assertIn(
            'data = ["//:README.md", "//lib:core", "//lib:notes.txt"]',
            out["tests/BUILD"])
        self.assertIn('exports_files([\n    "notes.txt",\n])',
                      out["lib/BUILD"])
        self.assertEqual(build_files._HEADER + textwrap.dedent("""
            exports_files([
                "README.md",
                "requirements_lock.txt",
            ])
        """), out["BUILD"])

    def test_mistakes_fail_with_the_place_to_fix(self):
        cases = [
            ({"lib/a.py": "import not_in_the_lock\n"},
             {}, "lib/a.py:1: `not_in_the_lock` is neither"),
            ({"lib/a.py": "import os\nfrom lib.b import y\n"},
             {}, "lib/a.py:2: no module lib.b"),
            ({"lib/a.py": "from .. import x\n"}, {},
             "lib/a.py: line 1: relative import beyond the top package"),
            ({"lib/a.py": "x = (\n"}, {}, "lib/a.py:1: cannot parse"),
            ({"lib/a.py": "x = 1\n", "lib/sub/moved.py": ""},
             {"lib/moved.py": {}, "lib/gone.py": {}},
             "EXTRAS names modules that are gone (moved? update the keys,"
             " and data paths relative to them): lib/gone.py, lib/moved.py"
             " (now lib/sub/moved.py?)"),
            ({"lib/a.py": "x = 1\n"}, {"lib/a.py": {"data": ["gone.txt"]}},
             "lib/a.py: data file 'gone.txt' does not exist"),
            ({"lib/a.py": "x = 1\n"}, {"lib/a.py": {"data": ["*.csv"]}},
             "lib/a.py: data glob '*.csv' matches no file"),
            ({"lib/a.py": "x = 1\n"}, {"lib/a.py": {"data": ["//:gone.md"]}},
             "lib/a.py: data //:gone.md is neither a target nor a file"),
            ({"lib/a.py": "from lib import b\n",
              "lib/b.py": "def f():\n    from lib import a\n"}, {},
             "import cycle (Bazel forbids one; move what both need to a third"
             " module): lib/a.py -> lib/b.py -> lib/a.py"),
        ]
        for files, extras, message in cases:
            with self.subTest(message):
                root = self.workspace(files)
                with self.assertRaises(build_files.BuildFilesError) as e:
                    self.generate(root, extras)
                self.assertIn(message, str(e.exception))

    def test_write_then_check_and_every_drift_is_caught(self):
        root = self.workspace({
            "lib/a.py": "import numpy\nfrom lib import b\n",
            "lib/b.py": "x = 1\n",
            "lib/old/c.py": "x = 1\n",
        })
        kw = dict(roots=("lib", "tests"), extras={})
        self.assertEqual(["lib/BUILD", "lib/old/BUILD"],
                         build_files.write(root, **kw))
        self.assertEqual({}, build_files.differences(root, **kw))
        build = os.path.join(root, "lib/BUILD")
        committed = pathlib.Path(build).read_text()

        # A dep deleted by hand.
        pathlib.Path(build).write_text(committed.replace(
            '":b", ', ""))
        self.assertEqual(["lib/BUILD"],
                         list(build_files.differences(root, **kw)))
        pathlib.Path(build).write_text(committed)

        # A new import, a new module and a package that moved away.
        with open(os.path.join(root, "lib/b.py"), "a") as f:
            f.write("import absl\n")
        os.rename(os.path.join(root, "lib/old/c.py"),
                  os.path.join(root, "lib/c.py"))
        diffs = build_files.differences(root, **kw)
        self.assertEqual(["lib/BUILD", "lib/old/BUILD"], sorted(diffs))
        self.assertIn('+    deps = ["@pypi//absl_py"],', diffs["lib/BUILD"])
        self.assertIn('+    name = "c",', diffs["lib/BUILD"])
        self.assertEqual(["lib/BUILD", "lib/old/BUILD"],
                         sorted(build_files.write(root, **kw)))
        self.assertFalse(os.path.exists(os.path.join(root, "lib/old/BUILD")))
        self.assertEqual({}, build_files.differences(root, **kw))

    @mock.patch.object(build_files, "EXTRAS", {})
    def test_command_line(self):
        root = self.workspace({"tests/a_test.py": "import os\n"})
        with open(os.path.join(root, "tests/BUILD"), "w") as f:
            f.write("# stale\n")
        self.assertEqual(1, build_files.main(["--check", "--root", root]))
        self.assertEqual(0, build_files.main(["--root", root]))
        self.assertEqual(0, build_files.main(["--check", "--root", root]))
        with open(os.path.join(root, "tests/a_test.py"), "a") as f:
            f.write("import unknown_package\n")
        self.assertEqual(2, build_files.main(["--check", "--root", root]))


if __name__ == "__main__":
    absltest.main()
