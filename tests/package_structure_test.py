"""The library's shape: tests beside every module, private APIs only in `compat`.

Rules a contributor can rely on, checked on the source (the arrows between
the stages are `architecture_test.py`'s):
- every module has a test module named after it (or is listed below);
- no module uses a private name (`_name`) of another tf_dpadam module;
- every private Keras or TensorFlow API (`keras.src`, `tensorflow.python`,
  or a `._private` attribute of an object that is not the module's own
  `self`/`cls`) is used in `src/tf_dpadam/common/compat.py` only.
"""

import ast
import pathlib

from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "src" / "tf_dpadam"
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
# Underscored names that are public APIs (namedtuple's, the standard library's).
PUBLIC_UNDERSCORED = ("_replace", "_asdict", "_fields", "_make", "_getframe")

# One test module per library module, in the folder of its stage:
# src/tf_dpadam/<stage>/x.py -> tests/<stage>/x_test.py,
# src/tf_dpadam/<stage>/pkg/y.py -> tests/<stage>/pkg_y_test.py, a package's
# __init__.py -> tests/<stage>/pkg_test.py (an __init__.py that only
# re-exports needs none); src/tf_dpadam/x.py -> tests/x_test.py. The modules
# below are tested elsewhere for now; each names the test modules (paths
# under tests/) that cover it. Remove an entry when its module gets its own
# tests.
TESTED_ELSEWHERE = {
    "accounting/plans.py": ("training/private_fit_test.py",
                            "large_delta_test.py"),
    "privatizer/ghost_clipping/blocks.py": (
        "privatizer/ghost_clipping_embedding_block_test.py",
        "privatizer/ghost_clipping_dense_test.py"),
    "privatizer/ghost_clipping/plan.py": (
        "privatizer/ghost_clipping_gradient_sum_test.py",
        "privatizer/ghost_clipping_fallback_test.py"),
    "privatizer/ghost_clipping/rule.py": (
        "privatizer/ghost_clipping_registry_test.py",
        "privatizer/ghost_clipping_dense_test.py"),
    "training/independence/errors.py": ("sensitivity_zoo_test.py",),
    "training/independence/loss_check.py": ("sensitivity_zoo_test.py",),
    "training/independence/model_check.py": ("sensitivity_zoo_test.py",),
    "training/independence/probe.py": (
        "training/independence_guard_test.py", "guard_misses_test.py"),
    "layers.py": ("privatizer/ghost_clipping_standardized_test.py",
                  "privacy_zoo_test.py"),
    "data/sampling.py": ("data/data_test.py", "data/source_test.py"),
    "version.py": ("packaging_test.py",),
}


def library_files():
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts)
    return name.removesuffix(".__init__")


def imported_modules(path, tree):
    """Local name -> tf_dpadam module name, for `import`/`from` statements."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rsplit(".", 1)[0]
    modules = {module_name(p) for p in library_files()}
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    names[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tf_dpadam") and alias.asname:
                    names[alias.asname] = alias.name
    return names


def is_private(name):
    return name.startswith("_") and not name.startswith("__")


def private_uses(path):
    """(line, text) of each use of another module's private name."""
    tree = ast.parse(path.read_text())
    local = imported_modules(path, tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "tf_dpadam") or isinstance(node, ast.ImportFrom) and node.level:
            for alias in node.names:
                if is_private(alias.name):
                    uses.append((node.lineno, f"import {alias.name}"))
        if (isinstance(node, ast.Attribute) and is_private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in local):
            uses.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return uses


def foreign_private_api_uses(path):
    """(line, text) of each private Keras/TF API use outside `compat`."""
    tree = ast.parse(path.read_text())
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith(PRIVATE_MODULES)):
            names = ", ".join(alias.name for alias in node.names)
            uses.append((node.lineno, f"from {node.module} import {names}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PRIVATE_MODULES):
                    uses.append((node.lineno, f"import {alias.name}"))
        elif (isinstance(node, ast.Attribute) and is_private(node.attr)
              and node.attr not in PUBLIC_UNDERSCORED):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(
                    owner.func, ast.Name) and owner.func.id == "super":
                # Overriding a Keras hook and calling the parent's.
                uses.append((node.lineno, f"super().{node.attr}"))
                continue
            uses.append((node.lineno, f"<...>.{node.attr}"))
    return uses


def named_test_module(path):
    """tests/<stage>/<name>_test.py (as a path under tests/) for library
    file `path`; None if it needs none."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                  ast.ClassDef)) for n in tree.body):
            return None  # Re-exports only.
        parts = parts[:-1] or ("tf_dpadam",)
        if len(parts) == 1 and parts[0] != "tf_dpadam":
            parts = parts * 2  # A stage's own package: tests/<stage>/.
    if len(parts) == 1:
        return parts[0] + "_test.py"
    return parts[0] + "/" + "_".join(parts[1:]) + "_test.py"


def modules_without_named_tests(paths, test_names, tested_elsewhere):
    """(library files lacking their test module, stale exceptions)."""
    missing, stale = [], []
    for path in paths:
        name = str(path.relative_to(PACKAGE))
        expected = named_test_module(path)
        if expected in test_names:
            if name in tested_elsewhere:
                stale.append(f"{name} (has {expected})")
        elif expected and name not in tested_elsewhere:
            missing.append(f"{name} -> tests/{expected}")
    files = {str(p.relative_to(PACKAGE)) for p in paths}
    stale += [f"{m} (no such module)" for m in tested_elsewhere
              if m not in files]
    stale += [f"{m}: tests/{t} (no such test)"
              for m, tests in tested_elsewhere.items() for t in tests
              if t not in test_names]
    return missing, stale


class PackageStructureTest(absltest.TestCase):

    def test_finds_the_library(self):
        names = {module_name(p) for p in library_files()}
        self.assertIn("tf_dpadam.common.compat", names)
        self.assertGreater(len(names), 30)

    def test_no_private_name_of_another_module(self):
        found = {str(p.relative_to(PACKAGE.parent)): private_uses(p)
                 for p in library_files()}
        self.assertEqual({k: v for k, v in found.items() if v}, {})

    def test_private_keras_and_tensorflow_apis_only_in_compat(self):
        found = {}
        for path in library_files():
            if path == PACKAGE / "common" / "compat.py":
                continue
            if uses := foreign_private_api_uses(path):
                found[str(path.relative_to(PACKAGE.parent))] = uses
        self.assertEqual(found, {})

    def test_every_module_has_a_test_module_named_after_it(self):
        tests_dir = REPO / "tests"
        tests = {str(p.relative_to(tests_dir))
                 for p in tests_dir.rglob("*_test.py")}
        missing, stale = modules_without_named_tests(
            library_files(), tests, TESTED_ELSEWHERE)
        if missing:
            self.fail(
                "library modules without a test module named after them: add"
                " the test module (src/tf_dpadam/<stage>/x.py ->"
                " tests/<stage>/x_test.py, src/tf_dpadam/<stage>/pkg/y.py ->"
                " tests/<stage>/pkg_y_test.py) or, if other test modules"
                " cover the module, list it with their paths in"
                " TESTED_ELSEWHERE (tests/package_structure_test.py):\n  "
                + "\n  ".join(missing))
        self.assertEqual(stale, [], "TESTED_ELSEWHERE entries to remove")

    def test_the_naming_rule(self):
        self.assertEqual(
            named_test_module(PACKAGE / "privatizer" / "noise.py"),
            "privatizer/noise_test.py")
        self.assertEqual(
            named_test_module(PACKAGE / "privatizer" / "ghost_clipping"
                              / "dense.py"),
            "privatizer/ghost_clipping_dense_test.py")
        self.assertEqual(named_test_module(PACKAGE / "data" / "__init__.py"),
                         "data/data_test.py")
        self.assertEqual(named_test_module(PACKAGE / "layers.py"),
                         "layers_test.py")


if __name__ == "__main__":
    absltest.main()
