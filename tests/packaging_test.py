"""The package as pip and a user see it: metadata, version, license, API.

- pyproject.toml (PEP 621) is the one packaging source (no setup.py), with
  the src layout and the `tf_dpadam_privacy` console script;
- the version has one source, src/tf_dpadam/version.py, which pyproject.toml
  reads, `tf_dpadam.__version__` re-exports, and MODULE.bazel and
  CHANGELOG.md repeat (checked here);
- LICENSE is the Apache License 2.0 the metadata names, and `py.typed` ships;
- every name of the public packages' `__all__` exists and has a docstring;
- the public functions of the modules listed in `TYPED` carry type hints.
"""

import ast
import dataclasses
import importlib
import inspect
import os
import re
import types

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam import version

_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

# The packages whose `__all__` is their public API.
PUBLIC_PACKAGES = (
    "tf_dpadam",
    "tf_dpadam.accounting",
    "tf_dpadam.tools.diagnostics",
    "tf_dpadam.privatizer.ghost_clipping",
    "tf_dpadam.training.independence",
    "tf_dpadam.tools.membership",
)

# (module, names): public functions and classes whose signatures must be
# fully annotated (every parameter but self/cls, and the return of
# functions).
TYPED = (
    ("tf_dpadam.accounting", (
        "calibrate_noise_multiplier", "calibrate_steps", "check_sampling",
        "compute_dp_sgd_privacy", "compute_dp_sgd_privacy_statement",
        "dp_sgd_event", "epsilon_after_steps",
        "epsilon_without_amplification", "steps_for_epochs",
        "training_steps")),
    ("tf_dpadam.data", ("poisson_batches", "poisson_batches_from_source")),
    ("tf_dpadam.data.sharding", ("sharded_poisson_batches",
                            "workers_and_local_replicas")),
    ("tf_dpadam.layers", ("standardize_kernel", "WSConv2D")),
    ("tf_dpadam.training.callbacks", ("PrivacyBudget",)),
    ("tf_dpadam.tools.gradient_norms", ("per_example_gradient_norms",)),
    ("tf_dpadam.optimizers.arguments", ("DPConfig",)),
)


def _read(name):
    with open(os.path.join(_ROOT, name), encoding="utf-8") as f:
        return f.read()


def _pyproject():
    with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def undocumented(package):
    """The names of `package.__all__` that are missing or have no docstring.

    Modules, classes and functions need their own docstring (a class's is
    not inherited); any other value (a constant) must be named in the
    docstring of `package` or of the module that defines it.
    """
    found = []
    for name in package.__all__:
        if not hasattr(package, name):
            found.append(f"{name} (missing)")
            continue
        value = getattr(package, name)
        if isinstance(value, (types.ModuleType, type)) or callable(value):
            doc = value.__doc__ if isinstance(value, type) else (
                inspect.getdoc(value))
            if not (doc or "").strip():
                found.append(name)
        elif name not in (package.__doc__ or ""):
            found.append(f"{name} (a constant not in the docstring)")
    return found


def missing_annotations(value):
    """The parameters (and "return") of `value` that have no annotation;
    for a class, those of its `__init__` (a dataclass: of its fields)."""
    if dataclasses.is_dataclass(value):
        return [f.name for f in dataclasses.fields(value)
                if f.type is inspect.Parameter.empty]
    function = value.__init__ if isinstance(value, type) else value
    signature = inspect.signature(function)
    missing = [
        name for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
        and parameter.annotation is inspect.Parameter.empty
    ]
    if (not isinstance(value, type)
            and signature.return_annotation is inspect.Signature.empty):
        missing.append("return")
    return missing


class PackagingTest(parameterized.TestCase):

    def test_pyproject_metadata(self):
        project = _pyproject()["project"]
        self.assertEqual(project["name"], "tf_dpadam")
        self.assertEqual(project["dynamic"], ["version"])
        self.assertEqual(project["requires-python"], ">=3.10")
        self.assertEqual(project["license"], "Apache-2.0")
        self.assertEqual(project["readme"], "README.md")
        extras = project["optional-dependencies"]
        self.assertContainsSubset({"tests", "examples", "docs"}, extras)
        self.assertContainsSubset({"pytest"}, extras["tests"])
        docs = {re.split(r"[<>=!~ ;\[]", r)[0].lower()
                for r in extras["docs"]}
        self.assertContainsSubset({"sphinx", "myst-parser"}, docs)
        self.assertEqual(
            _pyproject()["tool"]["setuptools"]["package-data"]["tf_dpadam"],
            ["py.typed"])

    def test_pyproject_is_the_one_packaging_source(self):
        self.assertFalse(os.path.exists(os.path.join(_ROOT, "setup.py")))
        self.assertFalse(os.path.exists(os.path.join(_ROOT, "setup.cfg")))
        text = _read("pyproject.toml")
        # The src layout, and the accounting command line's console script.
        self.assertIn('where = ["src"]', text)
        self.assertIn('tf_dpadam_privacy = "tf_dpadam.accounting.cli:'
                      'console_main"', text)
    def test_one_version_source(self):
        self.assertRegex(version.__version__, r"^\d+\.\d+\.\d+")
        self.assertEqual(tf_dpadam.__version__, version.__version__)
        self.assertEqual(
            _pyproject()["tool"]["setuptools"]["dynamic"]["version"],
            {"attr": "tf_dpadam.version.__version__"})
        # Bazel's module and the changelog repeat it.
        self.assertRegex(
            _read("MODULE.bazel"),
            r'module\(name = "tf_dpadam", version = "'
            + re.escape(version.__version__) + '"\\)')
        self.assertIn(f"## [{version.__version__}]", _read("CHANGELOG.md"))
        # No other module of the package spells a version.
        for folder, _, files in os.walk(os.path.join(_ROOT, "tf_dpadam")):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and name != "version.py":
                    with open(path, encoding="utf-8") as f:
                        self.assertNotRegex(
                            f.read(), r"(?m)^__version__\s*=", msg=path)

    def test_changelog_keeps_an_unreleased_section(self):
        changelog = _read("CHANGELOG.md")
        self.assertIn("## [Unreleased]", changelog)
        self.assertLess(changelog.index("## [Unreleased]"),
                        changelog.index(f"## [{version.__version__}]"))

    def test_license_is_the_apache_license(self):
        text = _read("LICENSE")
        self.assertIn("Apache License\n", text)
        self.assertIn("Version 2.0, January 2004", text)
        self.assertIn("END OF TERMS AND CONDITIONS", text)
        self.assertGreater(len(text.splitlines()), 170)  # the full text

    def test_py_typed_ships(self):
        self.assertTrue(os.path.isfile(
            os.path.join(_ROOT, "src", "tf_dpadam", "py.typed")))

    @parameterized.parameters(*PUBLIC_PACKAGES)
    def test_all_names_exist_and_are_documented(self, name):
        package = importlib.import_module(name)
        self.assertTrue(hasattr(package, "__all__"), name)
        self.assertNotEmpty(package.__all__)
        self.assertLen(set(package.__all__), len(package.__all__))
        self.assertEqual(undocumented(package), [])

    def test_the_top_level_all_lists_what_it_imports(self):
        # Every name `src/tf_dpadam/__init__.py` imports from tf_dpadam (on first
        # use: its imports are in functions and `if` blocks) is public API.
        tree = ast.parse(_read("src/tf_dpadam/__init__.py"))
        imported = {alias.asname or alias.name
                    for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom)
                    and node.module.split(".")[0] == "tf_dpadam"
                    for alias in node.names}
        self.assertEqual(imported - {"__version__"}, set(tf_dpadam.__all__))

    def test_the_documentation_check_can_fail(self):
        package = types.ModuleType("sample", "A sample; names KNOWN.")

        def documented():
            """Has a docstring."""

        def bare():
            pass

        class Bare:
            pass

        class Child(tf_dpadam.PrivacyBudget):  # Not the parent's docstring.
            pass

        package.documented, package.bare = documented, bare
        package.Bare, package.Child = Bare, Child
        package.KNOWN, package.OTHER = 1, 2
        package.__all__ = ["documented", "bare", "Bare", "Child", "KNOWN",
                           "OTHER", "absent"]
        self.assertEqual(undocumented(package), [
            "bare", "Bare", "Child", "OTHER (a constant not in the docstring)",
            "absent (missing)"])

    @parameterized.parameters(*TYPED)
    def test_public_api_has_type_hints(self, module, names):
        module = importlib.import_module(module)
        missing = {name: missing_annotations(getattr(module, name))
                   for name in names}
        self.assertEqual({k: v for k, v in missing.items() if v}, {})

    def test_the_type_hint_check_can_fail(self):
        def partly(a: int, b, *, c=1) -> int:
            return a + b + c

        def no_return(a: int):
            return a

        self.assertEqual(missing_annotations(partly), ["b", "c"])
        self.assertEqual(missing_annotations(no_return), ["return"])


if __name__ == "__main__":
    absltest.main()
