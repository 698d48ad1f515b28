"""Keeps the Bazel BUILD files honest about the Python imports they build.

Bazel cannot run in every environment this project is developed in, so a
BUILD file can drift from the code for a long time unnoticed (a module split,
a new import, a new test file). This test reads the BUILD files the way Bazel
would see them and compares them with the `import` statements of the sources.

What it checks, for the repository that contains this file:

* Every BUILD / BUILD.bazel file parses. They are Starlark; the subset used
  here is valid Python syntax, so they are parsed with `ast` and evaluated by
  a small interpreter that understands `load`, rule calls with keyword
  arguments, string/number/bool constants, lists, tuples, dicts, module-level
  `NAME = <expr>` assignments, `+` on lists and strings, and `glob`. Anything
  else (`select`, `if`, comprehensions, `**kwargs`, f-strings, macros called
  as expressions, ...) is an error naming the file and line, never a guess.
* Per `py_library` / `py_binary` / `py_test` target, two test cases,
  `test_project_deps_<target>` and `test_pypi_deps_<target>` (so the layering
  of the project and the spelling of third-party deps fail separately): its
  srcs exist, lie in its own package and are Python files, and every import
  in them that the target needs is a DIRECT dep (Bazel's layering
  convention; a dep reached only through another target does not count):
    - a project module (a file under the repository root: `tf_dpadam.x`,
      `research.common`, `tests/helpers.py` imported as `helpers` or as
      `tests.helpers`, relative imports inside packages) must be provided by
      a target in `deps` that has that file in its srcs. `from P import n`
      needs the target of module `P.n` if that is a file, else that of `P`.
      The parent packages' `__init__.py` are not required (rules_python
      creates missing ones, and a package's own modules could not depend on
      its `__init__` target without a cycle); imports of files that are in
      the target's own srcs need nothing;
    - a third-party import must be a `@pypi//<name>` dep, with the import
      name mapped to the normalized pip name (`absl` -> `absl_py`, see
      `_IMPORT_TO_PIP`). Imports inside `try: ... except ImportError` are
      optional and not checked (e.g. the offline MiniLM preset), nor are
      `if TYPE_CHECKING:` blocks or the standard library. Imports inside
      functions are checked: they run when the function does.
  Extra (unused) deps are not reported: data-only deps such as
  `//tests:distribute_check` (run as a subprocess) are legitimate.
* Every .py file under tf_dpadam/, research/ and benchmarks/ and every
  tests/*_test.py is in the srcs of exactly one target, and no file is in the
  srcs of two targets. tests/conftest.py is exempt: pytest loads it as a
  plugin and nothing imports it; under Bazel the environment it sets comes
  from each py_test's `env`. tests/helpers.py and other non-test files in
  tests/ need a target only once something imports them (then the import
  check above demands one).
* Every label in `deps` that points into the project names an existing
  target, and every `@pypi//x` dep names a package of the requirements lock
  file that MODULE.bazel's `pip.parse` declares for that hub.

Under `bazel test` the sources are found through the real path of this file
(runfiles are symlinks into the source tree); the target is tagged
`external` because the BUILD files are not (and cannot all be) declared
inputs, so Bazel must not cache its result.
"""

import ast
import dataclasses
import fnmatch
import os
import pathlib
import re
import shutil
import sys
import tempfile
import textwrap

from absl.testing import absltest
from absl.testing import parameterized

_PY_RULES = ("py_library", "py_binary", "py_test")
_BUILD_NAMES = ("BUILD.bazel", "BUILD")
# Import name -> pip distribution name, where they differ (before
# normalization: lower case, "-" and "." -> "_", as rules_python spells the
# @pypi targets).
_IMPORT_TO_PIP = {
    "absl": "absl_py",
    "google.protobuf": "protobuf",
    "PIL": "pillow",
    "sklearn": "scikit_learn",
    "yaml": "pyyaml",
}
# The project's Python trees whose every .py file must be built, and the
# tests directory whose *_test.py files must be.
_LIBRARY_DIRS = ("tf_dpadam", "examples", "benchmarks")
_TESTS_DIR = "tests"
_EXEMPT_FILES = frozenset({"tests/conftest.py"})
_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})


class BuildFileError(Exception):
    """A BUILD/MODULE file uses a construct this checker does not model."""


def normalize_pip_name(name):
    return re.sub(r"[-_.]+", "_", name).lower()


# --------------------------------------------------------------------------
# Labels.


def parse_label(label, package):
    """`label` as ("", pkg, name) for the main repository or (repo, pkg, name).

    `package` is the repository-relative directory of the BUILD file the
    label appears in. Raises ValueError on a malformed label.
    """
    if not isinstance(label, str) or not label:
        raise ValueError(f"not a label: {label!r}")
    repo = ""
    rest = label
    if rest.startswith("@"):
        repo, sep, rest = rest.lstrip("@").partition("//")
        if not sep:
            # `@repo` alone means `@repo//:repo`.
            return repo, "", repo
        rest = "//" + rest
    if rest.startswith("//"):
        pkg, sep, name = rest[2:].partition(":")
        if not sep:
            name = pkg.rsplit("/", 1)[-1]
        if not name:
            raise ValueError(f"label {label!r} has no target name")
        return repo, pkg, name
    if rest.startswith(":"):
        rest = rest[1:]
    if not rest or rest.startswith("/") or ":" in rest:
        raise ValueError(f"malformed label {label!r}")
    return repo, package, rest


def canonical_label(label, package):
    """`//pkg:name` for a main-repository label, `@repo//pkg:name` else."""
    repo, pkg, name = parse_label(label, package)
    return f"{'@' + repo if repo else ''}//{pkg}:{name}"


# --------------------------------------------------------------------------
# Starlark subset.


@dataclasses.dataclass
class Target:
    label: str
    kind: str
    package: str
    name: str
    build_file: str
    lineno: int
    attrs: dict
    srcs: list = dataclasses.field(default_factory=list)  # repo paths
    deps: list = dataclasses.field(default_factory=list)  # canonical
    problems: list = dataclasses.field(default_factory=list)

    @property
    def where(self):
        return f"{self.build_file}:{self.lineno}"


class _Evaluator:
    """Evaluates the expressions of one BUILD file."""

    def __init__(self, root, package, path, subpackages):
        self.root = root
        self.package = package
        self.path = path  # repo-relative, for messages
        self.subpackages = subpackages
        self.env = {}

    def fail(self, node, what):
        raise BuildFileError(
            f"{self.path}:{getattr(node, 'lineno', '?')}: {what} is not"
            " supported by tests/bazel_files_test.py (extend its"
            " interpreter rather than let it guess)"
        )

    def eval(self, node):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (str, int, bool)) or node.value is None:
                return node.value
            self.fail(node, f"the constant {node.value!r}")
        if isinstance(node, (ast.List, ast.Tuple)):
            if any(isinstance(e, ast.Starred) for e in node.elts):
                self.fail(node, "unpacking (*x) in a list")
            return [self.eval(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                self.fail(node, "unpacking (**x) in a dict")
            return {self.eval(k): self.eval(v)
                    for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Name):
            if node.id not in self.env:
                self.fail(node, f"the undefined (or non-constant) name"
                          f" {node.id!r}")
            return self.env[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.eval(node.left), self.eval(node.right)
            if type(left) is not type(right) or not isinstance(
                    left, (list, str)):
                self.fail(node, f"`+` on {type(left).__name__} and"
                          f" {type(right).__name__}")
            return left + right
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "glob"):
            return self.glob(node)
        self.fail(node, f"the expression `{ast.unparse(node)}`")

    def glob(self, node):
        kwargs = self.keywords(node)
        if len(node.args) > 2:
            self.fail(node, "glob with more than 2 positional arguments")
        include = self.eval(node.args[0]) if node.args else kwargs.pop(
            "include", None)
        exclude = (self.eval(node.args[1]) if len(node.args) > 1
                   else kwargs.pop("exclude", []))
        kwargs.pop("exclude_directories", None)
        kwargs.pop("allow_empty", None)
        if kwargs or not isinstance(include, list):
            self.fail(node, f"glob({ast.unparse(node)[5:-1]})")
        base = pathlib.Path(self.root, self.package)
        found = set()
        for pattern in include:
            for p in base.glob(pattern):
                rel = p.relative_to(base).as_posix()
                if not p.is_file() or any(
                        fnmatch.fnmatchcase(rel, x) for x in exclude):
                    continue
                # Bazel's glob does not cross into subpackages.
                if _in_subpackage(rel, self.package, self.subpackages):
                    continue
                found.add(rel)
        return sorted(found)

    def keywords(self, call):
        out = {}
        for kw in call.keywords:
            if kw.arg is None:
                self.fail(call, "**kwargs in a call")
            out[kw.arg] = self.eval(kw.value)
        return out


def _in_subpackage(name, package, subpackages):
    """Whether file `name` of `package` lies in one of its subpackages."""
    full = f"{package}/{name}" if package else name
    return any(full.startswith(sp + "/") for sp in subpackages
               if sp and sp != package
               and (not package or sp.startswith(package + "/")))


def _rel(root, path):
    return pathlib.Path(path).relative_to(root).as_posix()


def find_build_files(root):
    """{package: BUILD path} for every Bazel package under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and not d.startswith("bazel-")
            and d not in _SKIP_DIRS
            and not os.path.islink(os.path.join(dirpath, d))
        )
        for name in _BUILD_NAMES:
            if name in filenames:
                pkg = _rel(root, dirpath)
                out["" if pkg == "." else pkg] = os.path.join(dirpath, name)
                break
    return out


def parse_build_file(root, package, path, subpackages=()):
    """The targets of one BUILD file: [Target], or raises BuildFileError."""
    rel_path = _rel(root, path)
    ev = _Evaluator(root, package, rel_path, subpackages)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        tree = ast.parse(text, filename=rel_path)
    except SyntaxError as e:
        raise BuildFileError(f"{rel_path}:{e.lineno}: not Python-parsable"
                             f" Starlark: {e.msg}") from e
    kinds = {}  # symbol in this file -> rule kind
    targets = []
    names = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                and isinstance(stmt.value.value, str):
            continue  # A docstring.
        if isinstance(stmt, ast.Assign):
            if len(stmt.targets) != 1 or not isinstance(stmt.targets[0],
                                                        ast.Name):
                ev.fail(stmt, "an assignment to anything but one name")
            ev.env[stmt.targets[0].id] = ev.eval(stmt.value)
            continue
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name)):
            ev.fail(stmt, f"the statement `{ast.unparse(stmt).splitlines()[0]}`")
        call = stmt.value
        func = call.func.id
        if func == "load":
            for a in call.args[1:]:
                symbol = ev.eval(a)
                kinds[symbol] = symbol
            for kw in call.keywords:
                kinds[kw.arg] = ev.eval(kw.value)
            continue
        kwargs = ev.keywords(call)
        if func in ("package", "licenses", "exports_files"):
            for a in call.args:
                ev.eval(a)
            continue
        if call.args:
            ev.fail(call, f"positional arguments to {func}()")
        name = kwargs.get("name")
        if not isinstance(name, str):
            ev.fail(call, f"a {func}() call without a string name")
        if name in names:
            ev.fail(call, f"a second target named {name!r} (first at line"
                    f" {names[name]})")
        names[name] = call.lineno
        targets.append(Target(
            label=f"//{package}:{name}", kind=kinds.get(func, func),
            package=package, name=name, build_file=rel_path,
            lineno=call.lineno, attrs=kwargs))
    for t in targets:
        if t.kind not in _PY_RULES:
            continue
        for attr in ("srcs", "deps"):
            value = t.attrs.get(attr, [])
            if not isinstance(value, list) or not all(
                    isinstance(v, str) for v in value):
                raise BuildFileError(f"{t.where}: {t.label}'s {attr} is not"
                                     " a list of strings")
        for d in t.attrs.get("deps", []):
            try:
                t.deps.append(canonical_label(d, package))
            except ValueError as e:
                t.problems.append(f"bad dep {d!r}: {e}")
        for s in t.attrs.get("srcs", []):
            try:
                repo, pkg, name = parse_label(s, package)
            except ValueError as e:
                t.problems.append(f"bad src {s!r}: {e}")
                continue
            if repo or pkg != package:
                t.problems.append(f"src {s!r} is not a file of package"
                                  f" //{package}")
                continue
            if _in_subpackage(name, package, subpackages):
                t.problems.append(f"src {s!r} crosses into a subpackage (it"
                                  " has its own BUILD file)")
                continue
            t.srcs.append(f"{pkg}/{name}" if pkg else name)
    return targets


def parse_module_file(root):
    """{hub name: lock file path} from MODULE.bazel's `pip.parse(...)` calls."""
    path = os.path.join(root, "MODULE.bazel")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename="MODULE.bazel")
    ev = _Evaluator(root, "", "MODULE.bazel", ())
    hubs = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "parse"
                and {"hub_name", "requirements_lock"} <= {
                    kw.arg for kw in node.keywords}):
            kw = {k.arg: ev.eval(k.value) for k in node.keywords
                  if k.arg in ("hub_name", "requirements_lock")}
            _, pkg, name = parse_label(kw["requirements_lock"], "")
            hubs[kw["hub_name"]] = os.path.join(root, pkg, name)
    return hubs


def read_lock_names(path):
    names = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)", line)
            if m and not line[0].isspace():
                names.add(normalize_pip_name(m.group(1)))
    return names


# --------------------------------------------------------------------------
# The workspace and the checks.


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # Absolute dotted name (relative imports resolved).
    names: tuple  # For `from module import a, b`; () for `import module`.
    lineno: int
    optional: bool  # Inside try/except ImportError.
    text: str


def _catches_import_error(handler):
    if handler.type is None:
        return True
    types = (handler.type.elts if isinstance(handler.type, ast.Tuple)
             else [handler.type])
    return any(isinstance(t, ast.Name) and t.id in (
        "ImportError", "ModuleNotFoundError") for t in types)


def _is_type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def python_imports(source, filename, module_package):
    """The imports of `source`; `module_package` is its package's parts."""
    tree = ast.parse(source, filename=filename)
    out = []

    def visit(node, optional):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, optional)
            return
        if isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            body_optional = optional or any(
                _catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, body_optional)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, optional)
            return
        text = ast.unparse(node) if isinstance(
            node, (ast.Import, ast.ImportFrom)) else ""
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(alias.name, (), node.lineno, optional, text))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = list(module_package)
                up = node.level - 1
                if up > len(base) or (up == len(base) and not module):
                    raise ValueError(f"{filename}:{node.lineno}: relative"
                                     " import beyond the top-level package")
                base = base[:len(base) - up] if up else base
                module = ".".join(base + ([module] if module else []))
            out.append(Import(module, tuple(a.name for a in node.names),
                              node.lineno, optional, text))
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return out


class Workspace:
    """The parsed BUILD files of the repository at `root`."""

    def __init__(self, root, library_dirs=_LIBRARY_DIRS,
                 tests_dir=_TESTS_DIR):
        self.root = str(root)
        self.library_dirs = library_dirs
        self.tests_dir = tests_dir
        self.build_files = find_build_files(self.root)
        self.packages = set(self.build_files)
        self.targets = {}
        self.errors = []  # BUILD files that could not be parsed.
        self.broken_packages = set()
        for pkg, path in sorted(self.build_files.items()):
            try:
                for t in parse_build_file(self.root, pkg, path,
                                          self.packages):
                    self.targets[t.label] = t
            except BuildFileError as e:
                self.errors.append(str(e))
                self.broken_packages.add(pkg)
        self.owners = {}  # repo path -> [labels of targets with it in srcs]
        for t in self.py_targets():
            for s in t.srcs:
                self.owners.setdefault(s, []).append(t.label)
        try:
            self.hubs = {hub: read_lock_names(p) if os.path.exists(p)
                         else None
                         for hub, p in parse_module_file(self.root).items()}
        except (BuildFileError, SyntaxError, ValueError) as e:
            self.errors.append(f"MODULE.bazel: {e}")
            self.hubs = {}
        self.pip_hub = "pypi" if "pypi" in self.hubs or not self.hubs else (
            sorted(self.hubs)[0])

    def py_targets(self):
        return [t for _, t in sorted(self.targets.items())
                if t.kind in _PY_RULES]

    # ----- module resolution.

    def _is_project_top(self, name):
        if name.startswith(".") or name in _SKIP_DIRS:
            return False
        if os.path.isfile(os.path.join(self.root, name + ".py")):
            return True
        d = os.path.join(self.root, name)
        return os.path.isdir(d) and (name in self.packages or any(
            f.endswith(".py") or f in _BUILD_NAMES for f in os.listdir(d)))

    def _module_file(self, base, module):
        parts = module.split(".")
        stem = os.path.join(base, *parts)
        if os.path.isfile(stem + ".py"):
            return _rel(self.root, stem + ".py")
        if os.path.isfile(os.path.join(stem, "__init__.py")):
            return _rel(self.root, os.path.join(stem, "__init__.py"))
        if os.path.isdir(stem):
            return ""  # A namespace package: no file to depend on.
        return None

    def resolve(self, module, importer):
        """("file", path) | ("namespace", None) | ("missing", None) |
        ("external", top-level name) for `module` imported by `importer`."""
        roots = []
        importer_dir = os.path.dirname(os.path.join(self.root, importer))
        if not os.path.exists(os.path.join(importer_dir, "__init__.py")):
            # A script directory (tests/): it is sys.path[0] when its files
            # run, and pytest.ini puts tests/ on the path.
            roots.append(importer_dir)
        roots.append(self.root)
        for base in roots:
            found = self._module_file(base, module)
            if found:
                return "file", found
            if found == "" and (base != self.root
                                or self._is_project_top(module.split(".")[0])):
                return "namespace", None
        top = module.split(".")[0]
        if self._is_project_top(top):
            return "missing", None
        return "external", top

    @staticmethod
    def _package_parts(path):
        # The package of a/b/c.py and of a/b/__init__.py alike is a.b.
        return path[:-3].split("/")[:-1]

    def required(self, target):
        """[(category, requirement, why)] for `target`'s imports.

        category is "project" or "pypi"; requirement is a set of canonical
        labels any one of which satisfies the import, or a problem string.
        """
        out = []
        for src in target.srcs:
            path = os.path.join(self.root, src)
            if not src.endswith(".py") or not os.path.isfile(path):
                continue  # Reported by target_problems.
            try:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                imports = python_imports(source, src, self._package_parts(src))
            except (OSError, SyntaxError, ValueError) as e:
                out.append(("project", f"cannot read or parse {src}: {e}",
                            ""))
                continue
            for imp in imports:
                why = f"{src}:{imp.lineno}: {imp.text}"
                modules = [imp.module]
                if imp.names and imp.names != ("*",):
                    # `from P import n`: module P.n if that is a file, else
                    # the name n of module P.
                    modules = []
                    for n in imp.names:
                        kind, _ = self.resolve(f"{imp.module}.{n}", src)
                        modules.append(f"{imp.module}.{n}"
                                       if kind == "file" else imp.module)
                for module in dict.fromkeys(modules):
                    kind, found = self.resolve(module, src)
                    if kind == "namespace":
                        continue
                    if kind == "missing":
                        out.append(("project", f"imports {module}, which is"
                                    " no file in the repository", why))
                    elif kind == "file":
                        if found in target.srcs:
                            continue
                        owners = self.owners.get(found)
                        if owners:
                            out.append(("project", set(owners), why))
                            continue
                        broken = ", ".join(sorted(
                            f"//{p}" for p in self.broken_packages))
                        out.append(("project", (
                            f"imports {found}, which is in no target's srcs"
                            + (f" (BUILD files that failed to parse:"
                               f" {broken})" if broken else "")), why))
                    elif not (found in sys.stdlib_module_names
                              or found == "__future__" or imp.optional):
                        pip = found
                        for prefix, name in _IMPORT_TO_PIP.items():
                            if module == prefix or module.startswith(
                                    prefix + "."):
                                pip = name
                        pip = normalize_pip_name(pip)
                        out.append(("pypi", {f"@{self.pip_hub}//{pip}:{pip}"},
                                    why))
        return out

    # ----- checks: each returns a list of human-readable problems.

    def target_problems(self, target, categories=("project", "pypi")):
        """Problems of one py target: its srcs (with category "project"), and
        the deps its imports of `categories` need that it lacks."""
        problems = []
        if "project" in categories:
            problems += target.problems
            for s in target.srcs:
                if not os.path.isfile(os.path.join(self.root, s)):
                    problems.append(f"src {s} does not exist")
                elif not s.endswith(".py"):
                    problems.append(f"src {s} is not a .py file")
        deps = set(target.deps)
        grouped = {}  # problem -> [why]
        for category, requirement, why in self.required(target):
            if category not in categories:
                continue
            if not isinstance(requirement, str):
                if requirement & deps:
                    continue
                requirement = "missing dep " + " or ".join(sorted(
                    short_label(r, target.package) for r in requirement))
            grouped.setdefault(requirement, [])
            if why:
                grouped[requirement].append(why)
        for problem, whys in grouped.items():
            problems.append("\n      <- ".join([problem] + whys))
        return problems

    def coverage_problems(self):
        problems = []
        required = []
        for top in self.library_dirs:
            for dirpath, dirnames, filenames in os.walk(
                    os.path.join(self.root, top)):
                dirnames[:] = sorted(d for d in dirnames
                                     if d not in _SKIP_DIRS
                                     and not d.startswith("."))
                required += [_rel(self.root, os.path.join(dirpath, f))
                             for f in sorted(filenames) if f.endswith(".py")]
        tests = pathlib.Path(self.root, self.tests_dir)
        if tests.is_dir():
            required += sorted(_rel(self.root, p)
                               for p in tests.glob("*_test.py"))
        for path in required:
            if path in _EXEMPT_FILES:
                continue
            if not self.owners.get(path):
                problems.append(f"{path} is in no target's srcs")
        for path, owners in sorted(self.owners.items()):
            if len(owners) > 1:
                problems.append(f"{path} is in the srcs of {len(owners)}"
                                f" targets: {', '.join(sorted(owners))}")
        return problems

    def label_problems(self):
        problems = []
        for t in self.py_targets():
            for dep in t.deps:
                repo, pkg, name = parse_label(dep, t.package)
                if not repo:
                    if dep in self.targets:
                        continue
                    if pkg in self.broken_packages:
                        problems.append(f"{t.label} ({t.where}): cannot check"
                                        f" dep {dep}: //{pkg}'s BUILD file"
                                        " does not parse")
                    elif pkg not in self.packages:
                        problems.append(f"{t.label} ({t.where}): dep {dep}:"
                                        f" no package //{pkg}")
                    else:
                        problems.append(f"{t.label} ({t.where}): dep {dep}:"
                                        f" no target {name!r} in //{pkg}")
                elif repo in self.hubs:
                    lock = self.hubs[repo]
                    if lock is None:
                        problems.append(f"{t.label}: the lock file of @{repo}"
                                        " does not exist")
                    elif pkg != name or pkg not in lock:
                        problems.append(
                            f"{t.label} ({t.where}): dep {dep}: no package"
                            f" {pkg!r} in the @{repo} requirements lock")
        return problems


def short_label(label, package):
    """`:x` in `package`, `//pkg` for `//pkg:pkg`, `@hub//x` for pip deps."""
    repo, pkg, name = parse_label(label, package)
    if repo:
        return f"@{repo}//{pkg}" if pkg == name else label
    if pkg == package:
        return f":{name}"
    if pkg.rsplit("/", 1)[-1] == name:
        return f"//{pkg}"
    return f"//{pkg}:{name}"


# --------------------------------------------------------------------------
# The tests of this repository.


def _repo_root():
    # realpath: under Bazel this file is a runfiles symlink into the source
    # tree.
    here = os.path.dirname(os.path.realpath(__file__))
    return os.path.dirname(here)


_ROOT = _repo_root()
try:
    _WORKSPACE = Workspace(_ROOT)
    _LOAD_ERROR = None
    _TARGET_CASES = [
        (re.sub(r"\W+", "_", t.label.strip("/")), t.label)
        for t in _WORKSPACE.py_targets()
    ] or [("no_py_targets", None)]
except Exception as e:  # Reported by the tests, not at collection.
    _WORKSPACE = None
    _LOAD_ERROR = e
    _TARGET_CASES = [("load_error", None)]


def _report(title, problems):
    return "\n" + title + ":\n  " + "\n  ".join(problems)


class RepositoryBuildFilesTest(parameterized.TestCase):
    """The BUILD files of this repository against its sources."""

    def setUp(self):
        super().setUp()
        if _LOAD_ERROR is not None:
            self.fail(f"could not read the BUILD files: {_LOAD_ERROR!r}")

    def test_found_the_build_files(self):
        self.assertTrue(
            os.path.exists(os.path.join(_ROOT, "MODULE.bazel"))
            or os.path.exists(os.path.join(_ROOT, "WORKSPACE")),
            f"{_ROOT} is not the repository root")
        self.assertIn("tf_dpadam", _WORKSPACE.packages)

    def test_build_files_parse(self):
        self.assertEmpty(_WORKSPACE.errors, _report(
            "BUILD files this test cannot read", _WORKSPACE.errors))

    @parameterized.named_parameters(*_TARGET_CASES)
    def test_project_deps(self, label):
        """srcs exist; imported project modules are direct deps."""
        self._check_target(label, ("project",))

    @parameterized.named_parameters(*_TARGET_CASES)
    def test_pypi_deps(self, label):
        """Imported third-party packages are direct @pypi deps."""
        self._check_target(label, ("pypi",))

    def _check_target(self, label, categories):
        self.assertIsNotNone(label, "no py_library/py_binary/py_test found")
        target = _WORKSPACE.targets[label]
        problems = _WORKSPACE.target_problems(target, categories)
        self.assertEmpty(problems, _report(
            f"{label} ({target.where}) does not match its sources", problems))

    def test_every_source_in_exactly_one_target(self):
        problems = _WORKSPACE.coverage_problems()
        self.assertEmpty(problems, _report("srcs coverage", problems))

    def test_deps_exist(self):
        problems = _WORKSPACE.label_problems()
        self.assertEmpty(problems, _report("deps that do not exist",
                                           problems))


# --------------------------------------------------------------------------
# The checker itself, on synthetic trees.

_LOAD = 'load("@rules_python//python:defs.bzl", "py_library", "py_test")\n'
_MODULE = textwrap.dedent("""\
    module(name = "demo")
    pip = use_extension("@rules_python//python/extensions:pip.bzl", "pip")
    pip.parse(hub_name = "pypi", python_version = "3.11",
              requirements_lock = "//:requirements_lock.txt")
    use_repo(pip, "pypi")
    """)
_GOOD = {
    "MODULE.bazel": _MODULE,
    "requirements_lock.txt": "absl-py==2.0 \\\n    --hash=sha256:00\n"
                             "numpy==2.0\n",
    "lib/BUILD": _LOAD + textwrap.dedent("""\
        _COMMON = ["@pypi//numpy"]

        py_library(
            name = "base",
            srcs = ["base.py"],
            deps = _COMMON,
        )

        py_library(
            name = "lib",
            srcs = ["__init__.py", "top.py"],
            deps = [
                ":base",
                "//lib/sub",
            ] + _COMMON,
        )
        """),
    "lib/__init__.py": "from lib import top\n",
    "lib/base.py": "import numpy as np\nimport os\n",
    "lib/top.py": textwrap.dedent("""\
        from lib import base
        from lib.sub import rules
        from . import base as b2
        try:
            import optional_thing
        except ImportError:
            optional_thing = None
        """),
    "lib/sub/BUILD": _LOAD + textwrap.dedent("""\
        py_library(
            name = "sub",
            srcs = glob(["*.py"]),
            deps = ["//lib:base"],
        )
        """),
    "lib/sub/__init__.py": "from .rules import f\n",
    "lib/sub/rules.py": "from ..base import np\ndef f(): pass\n",
    "tests/BUILD": _LOAD + textwrap.dedent("""\
        _ENV = {"A": "1"}

        py_library(name = "helpers", srcs = ["helpers.py"])

        py_test(
            name = "top_test",
            srcs = ["top_test.py"],
            env = _ENV,
            deps = [
                ":helpers",
                "//lib",
                "@pypi//absl_py",
            ],
        )
        """),
    "tests/helpers.py": "X = 1\n",
    "tests/conftest.py": "import os\n",
    "tests/top_test.py": textwrap.dedent("""\
        from absl.testing import absltest
        import helpers
        import lib

        def test():
            from tests import helpers as h2
        """),
}


class CheckerTest(parameterized.TestCase):
    """The checker on small synthetic trees, independent of this repo."""

    def workspace(self, files, overrides=None):
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        files = dict(files, **(overrides or {}))
        for path, text in files.items():
            if text is None:
                continue
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        return Workspace(root, library_dirs=("lib",))

    def all_problems(self, ws):
        out = list(ws.errors)
        for t in ws.py_targets():
            out += [f"{t.label}: {p}" for p in ws.target_problems(t)]
        return out + ws.coverage_problems() + ws.label_problems()

    def test_consistent_tree_passes(self):
        ws = self.workspace(_GOOD)
        self.assertEqual(self.all_problems(ws), [])
        self.assertEqual(ws.targets["//lib/sub:sub"].srcs,
                         ["lib/sub/__init__.py", "lib/sub/rules.py"])
        self.assertEqual(ws.targets["//lib:base"].deps,
                         ["@pypi//numpy:numpy"])
        self.assertEqual(ws.targets["//tests:top_test"].attrs["env"],
                         {"A": "1"})

    def test_deleting_a_dep_line_fails(self):
        build = _GOOD["lib/BUILD"]
        self.assertIn('        ":base",\n', build)
        ws = self.workspace(_GOOD, {
            "lib/BUILD": build.replace('        ":base",\n', "")})
        problems = ws.target_problems(ws.targets["//lib:lib"])
        self.assertLen(problems, 1)
        self.assertIn("missing dep :base", problems[0])
        # Both importing lines are named, with file and line.
        self.assertIn("lib/top.py:1: from lib import base", problems[0])
        self.assertIn("lib/top.py:3: from . import base as b2", problems[0])

    def test_transitive_dep_is_not_enough(self):
        # //tests:top_test reaches :base through //lib, but imports it.
        ws = self.workspace(_GOOD, {
            "tests/top_test.py": _GOOD["tests/top_test.py"]
                                 + "from lib import base\n"})
        problems = ws.target_problems(ws.targets["//tests:top_test"])
        self.assertLen(problems, 1)
        self.assertIn("missing dep //lib:base", problems[0])

    def test_sibling_and_namespace_test_imports(self):
        ws = self.workspace(_GOOD, {"tests/BUILD": _GOOD["tests/BUILD"]
                                    .replace('":helpers",', "")})
        problems = ws.target_problems(ws.targets["//tests:top_test"])
        self.assertLen(problems, 1)
        self.assertIn("missing dep :helpers", problems[0])
        self.assertIn("top_test.py:2: import helpers", problems[0])
        self.assertIn("top_test.py:6: from tests import helpers as h2",
                      problems[0])

    def test_missing_third_party_dep(self):
        ws = self.workspace(_GOOD, {"lib/sub/rules.py":
                                    "from absl import flags\n"})
        problems = ws.target_problems(ws.targets["//lib/sub:sub"])
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("missing dep @pypi//absl_py", problems[0])

    def test_unknown_project_module_and_unowned_file(self):
        ws = self.workspace(_GOOD, {
            "lib/base.py": "import numpy\nfrom lib import gone\n"
                           "import lib.nothing_here\n",
            "lib/orphan.py": "",
            "lib/top.py": "from lib import orphan\n",
        })
        base = ws.target_problems(ws.targets["//lib:base"])
        self.assertLen(base, 2, base)
        # `gone` is no module: it is a name of lib/__init__.py, whose target
        # //lib:lib the import needs.
        self.assertEqual(
            "missing dep :lib\n      <- lib/base.py:2: from lib import gone",
            base[0])
        self.assertEqual(
            "imports lib.nothing_here, which is no file in the repository"
            "\n      <- lib/base.py:3: import lib.nothing_here", base[1])
        top = ws.target_problems(ws.targets["//lib:lib"])
        self.assertLen(top, 1)
        self.assertIn("lib/orphan.py, which is in no target's srcs", top[0])
        self.assertIn("lib/orphan.py is in no target's srcs",
                      ws.coverage_problems())

    def test_file_in_two_targets_and_conftest_exempt(self):
        ws = self.workspace(_GOOD, {
            "tests/BUILD": _GOOD["tests/BUILD"] + textwrap.dedent("""\
                py_library(name = "again", srcs = ["helpers.py"])
                """),
            "tests/other_test.py": "",
        })
        problems = ws.coverage_problems()
        self.assertIn("tests/other_test.py is in no target's srcs", problems)
        self.assertIn("tests/helpers.py is in the srcs of 2 targets:"
                      " //tests:again, //tests:helpers", problems)
        self.assertLen(problems, 2)  # tests/conftest.py is not reported.

    def test_dangling_labels(self):
        ws = self.workspace(_GOOD, {"lib/BUILD": _GOOD["lib/BUILD"].replace(
            '"//lib/sub",', '"//lib/sub", "//lib/sub:nope", "//nowhere",'
            ' "@pypi//scipy",')})
        problems = ws.label_problems()
        self.assertLen(problems, 3, problems)
        self.assertIn("no target 'nope' in //lib/sub", problems[0])
        self.assertIn("no package //nowhere", problems[1])
        self.assertIn("no package 'scipy' in the @pypi requirements lock",
                      problems[2])

    def test_moved_source(self):
        # A module turned into a package while the BUILD file still lists
        # the old file.
        ws = self.workspace(_GOOD, {"lib/base.py": None,
                                    "lib/base/__init__.py": "import numpy\n"})
        problems = self.all_problems(ws)
        self.assertIn("//lib:base: src lib/base.py does not exist", problems)
        self.assertIn("lib/base/__init__.py is in no target's srcs", problems)

    def test_src_in_subpackage(self):
        ws = self.workspace(_GOOD, {"lib/BUILD": _GOOD["lib/BUILD"].replace(
            '"base.py"', '"base.py", "sub/rules.py"')})
        self.assertIn("src 'sub/rules.py' crosses into a subpackage",
                      ws.targets["//lib:base"].problems[0])

    @parameterized.named_parameters(
        ("select", 'py_library(name = "a", deps = select({}))\n', "select"),
        ("if", "if True:\n    pass\n", "if True"),
        ("kwargs", 'py_library(**{"name": "a"})\n', "**kwargs"),
        ("undefined", 'py_library(name = "a", deps = _X)\n', "'_X'"),
        ("comprehension", 'py_library(name = "a", srcs = [x for x in []])\n',
         "[x for x in []]"),
        ("format", 'py_library(name = "a" + 1)\n', "`+` on str and int"),
        ("duplicate", 'py_library(name = "a")\npy_library(name = "a")\n',
         "a second target named 'a'"),
    )
    def test_unsupported_starlark_fails_clearly(self, text, fragment):
        ws = self.workspace(_GOOD, {"lib/BUILD": _LOAD + text})
        self.assertLen(ws.errors, 1)
        self.assertIn("lib/BUILD:", ws.errors[0])
        self.assertIn(fragment, ws.errors[0])

    @parameterized.parameters(
        ("//tf_dpadam", "x", "//tf_dpadam:tf_dpadam"),
        ("//tf_dpadam:privatizer", "x", "//tf_dpadam:privatizer"),
        (":common", "examples", "//research:common"),
        ("common", "examples", "//research:common"),
        ("//:requirements_lock.txt", "x", "//:requirements_lock.txt"),
        ("@pypi//absl_py", "x", "@pypi//absl_py:absl_py"),
        ("@//tests:helpers", "x", "//tests:helpers"),
        ("//a/b", "x", "//a/b:b"),
    )
    def test_labels(self, label, package, expected):
        self.assertEqual(canonical_label(label, package), expected)

    def test_relative_imports(self):
        imports = python_imports(
            "from . import a\nfrom ..b import c\nfrom .d.e import f\n",
            "p/q/r.py", ["p", "q"])
        self.assertEqual([i.module for i in imports], ["p.q", "p.b", "p.q.d.e"])

    def test_optional_and_type_checking_imports(self):
        imports = python_imports(textwrap.dedent("""\
            import a
            try:
                import b
            except (ValueError, ModuleNotFoundError):
                import c
            if TYPE_CHECKING:
                import d
            def f():
                import e
            """), "m.py", [])
        self.assertEqual([(i.module, i.optional) for i in imports], [
            ("a", False), ("b", True), ("c", False), ("e", False)])


if __name__ == "__main__":
    absltest.main()
