"""Every shell command of the README runs as written.

The commands are the README's code blocks (indented or fenced) and the
inline code that starts with `python -m`, plus the documented variant "add
`--target_epsilon=7`" of the privacy command. Each quick one runs as written,
in a subprocess with $TF_DPADAM_SMOKE_TEST=1 (`shared_flags.smoke_test_caps`:
4,096 examples, 256 test examples, 2 steps), from a scratch copy of the
repository's layout (the sources linked, `../shared` too), so that the reports
they write land there, not in docs/. The other commands are listed below with
the reason; the long experiments among them have their flags parsed by the
binary (`binary_driver`), which catches a renamed flag or a bad value.
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile

from absl.testing import absltest

from research import shared_flags

import binary_driver

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_README = os.path.join(_ROOT, "README.md")

# Not run: the set-up and the whole suite (this test is part of it).
EXCLUDED = {
    "bash setup.sh": "the set-up (installs packages)",
    "python -m pytest -q": "the whole test suite",
}
# Not run, their binary is not an example: timing runs of minutes, which the
# smoke-test variable does not shorten.
BENCHMARKS = "PYTHONPATH=. python benchmarks/benchmark.py"
# Not run, their flags are parsed: experiments of 22 to 24 runs (~0.5-3.5
# h), and the text binary (~55 s even shortened: it loads MiniLM and embeds
# 4,096 sentences; examples_binaries_test runs its code on a tiny BERT).
PARSED_ONLY = ("python -m research.reproduce", "python -m research.ablations",
               "python -m research.train_text",
               "python -m research.audit_table")  # 12 audits.
# The audit's binaries (another developer's): skipped until their file
# exists, then run with the same variable (or parsed, above).
AUDIT = "python -m research.audit"


def readme_commands(text):
    """The shell commands of a README: lines of code blocks (indented or
    fenced as sh/bash/shell/console) that start with `python`, `bash` or an
    environment assignment, and inline code that starts with `python -m`
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
    if "add `--target_epsilon=7`" in text:  # The privacy command's variant.
        privacy = [c for c in commands
                   if c.startswith("python -m tf_dpadam.privacy ")]
        commands += [c + " --target_epsilon=7" for c in privacy]
    return list(dict.fromkeys(commands))


def _module(command):
    return shlex.split(command)[2]


def _scratch_checkout():
    """A folder laid out like the repository (sources linked, `../shared`
    beside it), with empty docs/ and runs/."""
    base = tempfile.mkdtemp()
    work = os.path.join(base, "main")
    os.makedirs(os.path.join(work, "docs"))
    for name in ("examples", "tf_dpadam", "benchmarks", "README.md"):
        os.symlink(os.path.join(_ROOT, name), os.path.join(work, name))
    shared = os.path.join(os.path.dirname(_ROOT), "shared")
    if os.path.isdir(shared):
        os.symlink(shared, os.path.join(base, "shared"))
    return work


class ReadmeCommandsTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with open(_README, encoding="utf-8") as f:
            cls.commands = readme_commands(f.read())

    def test_the_extraction_finds_the_documented_commands(self):
        self.assertIn("bash setup.sh", self.commands)
        self.assertIn("python -m research.train_image --dataset=fashion_mnist"
                      " --optimizer=dpadam_corrected", self.commands)
        self.assertIn("python -m research.train_text"
                      " --data_dir=../shared/data/sst2 --sequence_length=32"
                      " --noise_multiplier=0.5", self.commands)
        self.assertIn("python -m tf_dpadam.privacy --num_examples=60000"
                      " --batch_size=256 --noise_multiplier=1.1 --epochs=60"
                      " --delta=1e-5 --target_epsilon=7", self.commands)
        self.assertEqual(readme_commands(
            "Text\n\n    python -m a --x=1\n\n    m ← β₁m\n\n"
            "```python\nimport keras\n```\n```sh\n$ bash b.sh\n```\n"
            "and `python -m c\n--y=2` inline, `--z=3`.\n"),
            ["python -m a --x=1", "bash b.sh", "python -m c --y=2"])

    def test_every_command_runs_or_is_excluded_for_a_reason(self):
        to_run, to_parse = [], []
        for command in self.commands:
            if command in EXCLUDED or command.startswith(BENCHMARKS):
                continue
            module = _module(command)
            if command.startswith(AUDIT) and not os.path.exists(
                    os.path.join(_ROOT, *module.split(".")) + ".py"):
                continue  # Not written yet.
            if command.startswith(PARSED_ONLY):
                to_parse.append(command)
            else:
                to_run.append(command)
        # reproduce twice, ablations, text (and the audit table).
        self.assertGreaterEqual(len(to_parse), 4)
        self.assertGreaterEqual(len(to_run), 5)

        results = binary_driver.run_cases([
            {"module": _module(c), "args": shlex.split(c)[3:],
             "mode": "parse"} for c in to_parse])
        for command, result in zip(to_parse, results):
            with self.subTest(command=command):
                self.assertEqual(result["code"], 0, result["stderr"])

        work = _scratch_checkout()
        env = dict(os.environ, **{shared_flags.SMOKE_TEST_VARIABLE: "1"})
        env.pop("PYTHONPATH", None)  # As a user: from the checkout's root.
        # Two at a time (the machine has 2 cores; each mostly imports).
        for first in range(0, len(to_run), 2):
            batch = to_run[first:first + 2]
            processes = [
                subprocess.Popen(
                    [sys.executable if word == "python" else word
                     for word in shlex.split(command)],
                    cwd=work, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
                for command in batch]
            for command, process in zip(batch, processes):
                out, err = process.communicate(timeout=600)
                with self.subTest(command=command):
                    self.assertEqual(process.returncode, 0,
                                     f"{command}\n{err[-3000:]}")
                    self.assertNotIn("Traceback", err)
                    self._check_output(command, out)

    def _check_output(self, command, out):
        module = _module(command)
        if module == "research.train_image":
            # At most the smoke test's 2 steps (epsilon 7 allows 1 on 4,096
            # examples); the epoch line counts the steps that ran.
            steps = re.search(r"test accuracy 0?\.\d+ after ([12]) steps;"
                              r" spent epsilon \d+\.\d+", out).group(1)
            self.assertRegex(out, rf"(?m)^{steps}/{steps} - .* epsilon: ")
        elif module == "research.diagnostics":
            self.assertRegex(out, r"wrote docs/DIAGNOSTICS_fashion_mnist\.md;"
                                  r" .* after [12] steps")
        elif module == "tf_dpadam.privacy":
            self.assertIn("epsilon = 2.597 (RDP accountant", out)
            if "--target_epsilon=7" in command:
                self.assertIn("Budget epsilon = 7", out)


if __name__ == "__main__":
    absltest.main()
