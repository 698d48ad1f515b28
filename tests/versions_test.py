"""The TensorFlow and Keras versions pyproject.toml accepts are the tested ones.

tf_dpadam relies on private APIs of TensorFlow 2.21 and Keras 3.15 (the
oneDNN workaround in src/tf_dpadam/privatizer/vectorization.py, src/tf_dpadam/common/compat.py),
and CI runs on one pinned environment (requirements_lock.txt). So the range
pyproject.toml declares (`[project] dependencies`; setup.py reads it) must
contain the versions installed here and pinned in the lock, and no other
minor version, which nothing tests.
"""

import os
import tempfile

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import keras
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized
from packaging import requirements
from packaging import version

_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def dependencies(pyproject):
    """The `[project] dependencies` list of the file `pyproject`."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f).get("project", {})
    if "dependencies" not in project:
        raise ValueError(f"No [project] dependencies in {pyproject}.")
    return project["dependencies"]


def declared_specifiers(pyproject):
    """{normalized name: SpecifierSet} of pyproject.toml's dependencies."""
    out = {}
    for line in dependencies(pyproject):
        req = requirements.Requirement(line)
        out[req.name.lower().replace("_", "-")] = req.specifier
    return out


def locked_versions(lock_file):
    """{normalized name: Version} of the `name==version` lines of a lock."""
    out = {}
    with open(lock_file, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if "==" in line:
                name, pinned = line.split("==", 1)
                out[name.strip().lower().replace("_", "-")] = version.Version(
                    pinned.split(";")[0].strip())
    return out


_INSTALLED = {"tensorflow": tf.__version__, "keras": keras.__version__}


class VersionsTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.declared = declared_specifiers(
            os.path.join(_ROOT, "pyproject.toml"))
        self.locked = locked_versions(
            os.path.join(_ROOT, "requirements_lock.txt"))

    def test_parser_reads_a_known_range(self):
        # The helpers themselves, on a pyproject.toml written here.
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "pyproject.toml")
            with open(path, "w", encoding="utf-8") as f:
                f.write('[project]\nname = "x"\ndependencies = ['
                        '"tensorflow>=2.21,<2.22", "numpy"]\n')
            got = declared_specifiers(path)
            with open(path, "w", encoding="utf-8") as f:
                f.write('[project]\nname = "x"\n')
            with self.assertRaisesRegex(ValueError, "No \\[project\\]"):
                declared_specifiers(path)
        self.assertIn("2.21.3", got["tensorflow"])
        self.assertNotIn("2.22.0", got["tensorflow"])
        self.assertNotIn("2.16.0", got["tensorflow"])
        self.assertEqual(str(got["numpy"]), "")

    @parameterized.parameters("tensorflow", "keras")
    def test_installed_version_is_in_the_declared_range(self, name):
        specifier = self.declared[name]
        installed = version.Version(_INSTALLED[name])
        self.assertTrue(
            specifier.contains(installed, prereleases=True),
            f"{name} {installed} is installed but pyproject.toml declares"
            f" {name}{specifier}")

    @parameterized.parameters("tensorflow", "keras")
    def test_locked_version_is_in_the_declared_range(self, name):
        self.assertIn(name, self.locked)
        self.assertIn(self.locked[name], self.declared[name],
                      f"requirements_lock.txt pins {name}=="
                      f"{self.locked[name]} outside pyproject.toml's"
                      f" {name}{self.declared[name]}")

    @parameterized.parameters("tensorflow", "keras")
    def test_range_excludes_untested_minor_versions(self, name):
        # Only the tested major.minor: the neighbouring minors (and the old
        # floor of `tensorflow>=2.16` / `keras>=3.0`) are outside.
        specifier = self.declared[name]
        tested = self.locked[name]
        major, minor = tested.release[:2]
        self.assertNotIn(f"{major}.{minor + 1}.0", specifier)
        self.assertNotIn(f"{major + 1}.0.0", specifier)
        if minor > 0:
            self.assertNotIn(f"{major}.{minor - 1}.0", specifier)
        self.assertNotIn("2.16.0" if name == "tensorflow" else "3.0.0",
                         specifier)
        self.assertIn(f"{major}.{minor}.0", specifier)


if __name__ == "__main__":
    absltest.main()
