"""Every shell command of README.md and of the docs' guides works as written.

The commands are the code blocks' lines (indented, or fenced as
sh/bash/shell/console) that start with `python`, `bash` or an environment
assignment, and the inline code that starts with `python -m`, plus the
documented variants ("add `--target_epsilon=7`" of the privacy command, "add
`--max_steps=2 --max_examples=4096`" of the main job).

* Every `python -m X` names a module that exists, and every flag it passes
  is one the module defines, with a value it accepts: the module runs with
  the command's arguments and `--helpfull` (absl) or `--help` (argparse)
  last, which parses the flags before it and stops at the help.
* The quick commands run as written, from the repository's root: the
  privacy command line (and its variant) and the main job's quick variant,
  each output checked.
* The rest are listed below with the reason they are not run: the set-up,
  the test suite and the docs build (tests/docs_test.py builds the docs),
  and runs of minutes to hours.
"""

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

from absl.testing import absltest
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = [os.path.join(_ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(_ROOT, "docs", "guides", "*.md")))

MAIN_JOB = ("python -m examples.train_image --dataset=fashion_mnist"
            " --optimizer=dpadam_corrected")
QUICK_MAIN_JOB = MAIN_JOB + " --max_steps=2 --max_examples=4096"
PRIVACY = "python -m tf_dpadam.accounting.cli "
# Not run, nor their flags parsed: what they are is the reason.
EXCLUDED = {
    "bash setup.sh": "the set-up (installs packages)",
    "python -m pytest": "the test suite (this test is part of it)",
    "python -m sphinx": "the docs build: tests/docs_test.py runs it",
    "PYTHONPATH=. python benchmarks/benchmark.py":
        "timing runs of minutes; the file's existence is checked",
}
# Run as written (quick).
RUN = (PRIVACY, QUICK_MAIN_JOB)


def readme_commands(text):
    """The shell commands of a Markdown text: lines of code blocks (indented
    or fenced as sh/bash/shell/console) that start with `python`, `bash` or
    an environment assignment, and inline code that starts with `python -m`
    (whitespace normalized)."""
    commands = []
    fence = None
    previous_blank = True
    in_indented = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence is not None:
            if fence in ("sh", "bash", "shell", "console"):
                commands.append(stripped.removeprefix("$ "))
            continue
        if line.startswith("    ") and (previous_blank or in_indented):
            in_indented = True
            commands.append(stripped)
        elif stripped:
            in_indented = False
        previous_blank = not stripped
    commands = [c for c in commands
                if re.match(r"(python|bash|[A-Z_]+=\S+ python)\b", c)]
    inline = re.findall(r"`(python -m\s[^`]+)`", text)
    commands += [" ".join(c.split()) for c in inline]
    if re.search(r"add\s+`--target_epsilon=7`", text):  # The variants.
        privacy = [c for c in commands if c.startswith(PRIVACY)]
        commands += [c + " --target_epsilon=7" for c in privacy]
    if MAIN_JOB in commands and re.search(
            r"add\s+`--max_steps=2 --max_examples=4096`", text):
        commands.append(QUICK_MAIN_JOB)
    return list(dict.fromkeys(commands))


def documented_commands():
    """{command: the documents (paths from the root) that give it}."""
    found = {}
    for path in DOCUMENTS:
        with open(path, encoding="utf-8") as f:
            for command in readme_commands(f.read()):
                found.setdefault(command, []).append(
                    os.path.relpath(path, _ROOT))
    return found


def excluded(command):
    return next((reason for prefix, reason in EXCLUDED.items()
                 if command.startswith(prefix)), None)


def module_and_args(command):
    """`python -m module args...` -> (module, [args])."""
    words = shlex.split(command)
    if words[:2] != ["python", "-m"]:
        raise ValueError(f"Expected a `python -m` command, got {command!r}.")
    return words[2], words[3:]


def module_file(module):
    """The file that `python -m module` runs from the repository's root, or
    None if there is none."""
    path = os.path.join(_ROOT, *module.split("."))
    for candidate in (path + ".py", os.path.join(path, "__main__.py")):
        if os.path.exists(candidate):
            return candidate
    if os.path.exists(os.path.join(_ROOT, module.split(".")[0])):
        return None  # A package of this repository without that module.
    spec = importlib.util.find_spec(module)
    return spec.origin if spec else None


def flag_names(args):
    """The flags' names in a command's arguments (`--x=1`, `--x 1`,
    `--nox`: x or nox; the help lists booleans as --[no]x)."""
    return [re.match(r"--([A-Za-z0-9_]+)", a).group(1)
            for a in args if a.startswith("--")]


def defined_flags(help_text):
    """The flags a module's help lists: absl's `--name:` and `--[no]name:`,
    argparse's `--name`."""
    names = set()
    for no, name in re.findall(r"--(\[no\])?([A-Za-z0-9_]+)", help_text):
        names.add(name)
        if no:
            names.add("no" + name)
    return names


def _run_all(argvs, timeout=900):
    """Runs the argument lists two at a time (2 cores; each mostly imports
    TensorFlow) from the repository's root; (code, stdout + stderr)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # As a user: from the checkout's root.
    results = []
    for first in range(0, len(argvs), 2):
        processes = [subprocess.Popen(
            argv, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
            for argv in argvs[first:first + 2]]
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            results.append((process.returncode, out))
    return results


class ExtractionTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.commands = documented_commands()

    def test_the_extraction_finds_the_documented_commands(self):
        self.assertIn("bash setup.sh", self.commands)
        self.assertIn("python -m pytest -q", self.commands)
        self.assertEqual(self.commands[MAIN_JOB], ["README.md"])
        self.assertIn(QUICK_MAIN_JOB, self.commands)
        self.assertIn(PRIVACY + "--num_examples=60000 --batch_size=256"
                      " --noise_multiplier=1.1 --epochs=60 --delta=1e-5"
                      " --target_epsilon=7", self.commands)
        self.assertIn("python -m research.train_text"
                      " --data_dir=DIR --sequence_length=32"
                      " --noise_multiplier=0.5", self.commands)
        self.assertEqual(readme_commands(
            "Text\n\n    python -m a --x=1\n\n    m ← β₁m\n\n"
            "```python\nimport keras\n```\n```sh\n$ bash b.sh\n```\n"
            "and `python -m c\n--y=2` inline, `--z=3`.\n"),
            ["python -m a --x=1", "bash b.sh", "python -m c --y=2"])

    def test_the_guides_have_commands_too(self):
        guides = {d for documents in self.commands.values()
                  for d in documents if d.startswith("docs/")}
        self.assertGreaterEqual(len(guides), 5, guides)

    def test_every_command_is_python_m_or_excluded_for_a_reason(self):
        for command in self.commands:
            with self.subTest(command=command):
                if excluded(command):
                    continue
                module, _ = module_and_args(command)  # Raises otherwise.
                self.assertTrue(module)

    def test_every_module_exists(self):
        for command in self.commands:
            with self.subTest(command=command):
                if command.startswith(
                        "PYTHONPATH=. python benchmarks/benchmark.py"):
                    self.assertTrue(os.path.exists(
                        os.path.join(_ROOT, "benchmarks", "benchmark.py")))
                    continue
                if command.startswith("bash "):
                    self.assertTrue(os.path.exists(
                        os.path.join(_ROOT, shlex.split(command)[1])))
                    continue
                module, _ = module_and_args(command)
                self.assertIsNotNone(module_file(module),
                                     f"no module {module}")

    def test_the_helpers(self):
        self.assertEqual(module_and_args("python -m a.b --x=1 --noy"),
                         ("a.b", ["--x=1", "--noy"]))
        with self.assertRaisesRegex(ValueError, "python -m"):
            module_and_args("bash setup.sh")
        self.assertEqual(flag_names(["--x=1", "--noy", "value", "--z"]),
                         ["x", "noy", "z"])
        self.assertEqual(
            defined_flags("  --x: X.\n  --[no]y: Y.\nusage: [--z Z]\n"),
            {"x", "y", "noy", "z"})
        self.assertIsNone(module_file("tf_dpadam.no_such_module"))
        self.assertIsNotNone(module_file("tf_dpadam.accounting.cli"))


@pytest.mark.slow
class CommandsTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.commands = [c for c in documented_commands() if not excluded(c)
                        and not c.startswith("bash ")]

    def test_every_flag_exists_with_a_valid_value(self):
        argvs = []
        for command in self.commands:
            module, args = module_and_args(command)
            with open(module_file(module), encoding="utf-8") as f:
                absl = "from absl import" in f.read()
            argvs.append([sys.executable, "-m", module, *args,
                          "--helpfull" if absl else "--help"])
        for command, (_, out) in zip(self.commands, _run_all(argvs)):
            with self.subTest(command=command):
                self.assertNotIn("Traceback", out, out[-3000:])
                self.assertNotRegex(out, r"error: |Flags parsing error",
                                    out[-3000:])
                defined = defined_flags(out)
                for name in flag_names(module_and_args(command)[1]):
                    self.assertIn(name, defined,
                                  f"{command}: no flag --{name}")

    def test_the_quick_commands_run(self):
        to_run = [c for c in self.commands if c.startswith(RUN)]
        self.assertGreaterEqual(len(to_run), 3, to_run)
        results = _run_all([[sys.executable] + shlex.split(c)[1:]
                            for c in to_run])
        for command, (code, out) in zip(to_run, results):
            with self.subTest(command=command):
                self.assertEqual(code, 0, f"{command}\n{out[-3000:]}")
                self.assertNotIn("Traceback", out)
                if command.startswith(PRIVACY):
                    self.assertIn("epsilon = 2.597 (RDP accountant", out)
                    if "--target_epsilon=7" in command:
                        self.assertIn("Budget epsilon = 7", out)
                else:  # The main job, 2 steps.
                    self.assertRegex(
                        out, r"test accuracy 0?\.\d+ after [12] steps;"
                             r" spent epsilon \d+\.\d+ at delta 1e-05")


if __name__ == "__main__":
    absltest.main()
