"""The stages of src/tf_dpadam import one way.

    common -> accounting -> data ---------------------------.
    common -> privatizer -> optimizers -> training -> tools
                                              ^--- data, accounting

A module may import its own stage and the stages that `ALLOWED` lists for
it, nothing else: the privatizer (value in, value out) reads no optimizer
and no model; the optimizers consume its output and reach for nothing of
the Keras glue (`training`); accounting only knows the ledger; the tools
sit on top. The top-level `tf_dpadam/__init__.py` (the public names) may
import anything; `layers.py` and `version.py` count as `common`. Every
import counts, also one inside a function: a lazy upward import is still an
arrow the wrong way.
"""

import ast
import pathlib
import tempfile

from absl.testing import absltest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "tf_dpadam"

# Stage -> the stages it may import (besides itself).
ALLOWED = {
    "common": set(),
    "accounting": {"common"},
    "data": {"common", "accounting"},
    "privatizer": {"common"},
    "optimizers": {"common", "privatizer"},
    "training": {"common", "accounting", "data", "privatizer", "optimizers"},
    "tools": {"common", "accounting", "data", "privatizer", "optimizers",
              "training"},
}
# Top-level modules that belong to a stage.
TOP_LEVEL_MODULES = {"layers": "common", "version": "common"}


def stage_of(module: str):
    """The stage of a dotted module name, or None for the package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return TOP_LEVEL_MODULES.get(parts[1], parts[1])


def imported_modules(tree: ast.AST):
    """`(line, dotted name)` of every tf_dpadam import in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise ValueError(f"line {node.lineno}: a relative import")
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def wrong_way_imports(package: pathlib.Path) -> list:
    """`module (stage) -> imported (stage), line N` for every import that
    goes against the arrows, in the package at `package`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts).removesuffix(".__init__")
        stage = stage_of(module)
        if stage is None:
            continue
        if stage not in ALLOWED:
            found.append(f"{module}: not in a stage of ALLOWED")
            continue
        for line, name in imported_modules(ast.parse(path.read_text())):
            if not name.startswith("tf_dpadam"):
                continue
            target = stage_of(name)
            if target != stage and target not in ALLOWED[stage]:
                found.append(f"{module} ({stage}) -> {name} ({target}),"
                             f" line {line}")
    return found


class ArchitectureTest(absltest.TestCase):

    def test_every_import_goes_the_way_of_the_arrows(self):
        self.assertEqual(wrong_way_imports(PACKAGE), [])

    def test_finds_the_stages(self):
        stages = {p.name for p in PACKAGE.iterdir() if p.is_dir()
                  and (p / "__init__.py").exists()}
        self.assertEqual(stages, set(ALLOWED))

    def test_a_planted_upward_import_fails(self):
        with tempfile.TemporaryDirectory() as root:
            package = pathlib.Path(root) / "tf_dpadam"
            for stage in ALLOWED:
                (package / stage).mkdir(parents=True)
                (package / stage / "__init__.py").write_text("")
            (package / "__init__.py").write_text(
                "from tf_dpadam.tools import anything\n")  # Allowed.
            (package / "privatizer" / "noise.py").write_text(
                "from tf_dpadam.common import seeds\n"  # Allowed.
                "def f():\n"
                "    from tf_dpadam.training import update\n")
            (package / "accounting" / "ledger.py").write_text(
                "from tf_dpadam import data\n")
            (package / "optimizers" / "base.py").write_text(
                "import tf_dpadam.privatizer.noise\n")  # Allowed.
            self.assertEqual(wrong_way_imports(package), [
                "tf_dpadam.accounting.ledger (accounting) -> tf_dpadam.data"
                " (data), line 1",
                "tf_dpadam.privatizer.noise (privatizer) ->"
                " tf_dpadam.training.update (training), line 3",
            ])


if __name__ == "__main__":
    absltest.main()
