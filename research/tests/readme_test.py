"""research/README.md's commands: every `python -m` names a module of the
harness, and every flag it passes is one the module defines, with a value
it accepts (the checks tests/readme_commands_test.py makes of README.md and
the docs' guides; the reproduction commands moved here from README.md).

None is run: they are experiments of minutes to hours. Each module runs
with the command's arguments and `--helpfull` last, which parses the flags
before it and stops at the help.
"""

import os
import sys

from absl.testing import absltest

from tests import readme_commands_test as readme

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_README = os.path.join(_ROOT, "research", "README.md")


def research_commands():
    """The commands of research/README.md, less the excluded ones (the
    test suite)."""
    with open(_README, encoding="utf-8") as f:
        return [c for c in readme.readme_commands(f.read())
                if not readme.excluded(c)]


class ReadmeTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.commands = research_commands()

    def test_the_reproduction_commands_are_found(self):
        modules = {readme.module_and_args(c)[0] for c in self.commands}
        self.assertLessEqual(
            {"research.train_image", "research.train_text",
             "research.reproduce", "research.ablations", "research.study",
             "research.diagnostics", "research.audit",
             "research.audit_table", "research.run_records"}, modules)
        self.assertIn(
            "python -m research.ablations --max_examples=20000"
            " --noise_multiplier=0.59 --eval_every=40 --spread_seeds=1,2",
            self.commands)
        # The test command is excluded, not run.
        with open(_README, encoding="utf-8") as f:
            self.assertIn("python -m pytest -q research/tests",
                          readme.readme_commands(f.read()))
        self.assertNotIn("python -m pytest -q research/tests", self.commands)

    def test_every_module_exists(self):
        for command in self.commands:
            module, _ = readme.module_and_args(command)
            self.assertTrue(module.startswith("research."), command)
            self.assertIsNotNone(readme.module_file(module), command)

    def test_every_flag_exists_with_a_valid_value(self):
        argvs, checked = [], []
        for command in self.commands:
            module, args = readme.module_and_args(command)
            if module == "research.run_records":
                continue  # No flags: `save` or `restore`.
            argvs.append([sys.executable, "-m", module, *args, "--helpfull"])
            checked.append(command)
        self.assertGreaterEqual(len(checked), 10)
        for command, (_, out) in zip(checked, readme._run_all(argvs)):
            with self.subTest(command=command):
                self.assertNotIn("Traceback", out, out[-3000:])
                self.assertNotRegex(out, r"error: |Flags parsing error",
                                    out[-3000:])
                defined = readme.defined_flags(out)
                for name in readme.flag_names(
                        readme.module_and_args(command)[1]):
                    self.assertIn(name, defined,
                                  f"{command}: no flag --{name}")


if __name__ == "__main__":
    absltest.main()
