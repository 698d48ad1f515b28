"""Tests of `tf_dpadam.command_line`: usage errors in one line, exit code 2.

The privacy command line's own errors are tested end to end in
privacy_cli_test.
"""

import contextlib
import io
import sys
from unittest import mock

from absl import app
from absl import flags
from absl.testing import absltest

from tf_dpadam import command_line


def _check_non_negative(value):
    if value < 0:
        raise ValueError(f"Expected n={value!r} >= 0.")


class CommandLineTest(absltest.TestCase):

    def test_usage_error_line_is_one_line(self):
        with mock.patch.object(sys, "argv", ["/bin/prog.py", "--x"]):
            self.assertEqual(
                command_line.usage_error_line("bad\nvalue  here"),
                "prog.py: error: bad value here")

    def test_register_check_turns_value_errors_into_flag_errors(self):
        flag_values = flags.FlagValues()
        flags.DEFINE_integer("n", None, "A count.", flag_values=flag_values)
        command_line.register_check("n", _check_non_negative,
                                    flag_values=flag_values)
        flag_values(["prog", "--n=3"])
        self.assertEqual(flag_values.n, 3)
        flag_values.unparse_flags()
        with self.assertRaisesRegex(flags.IllegalFlagValueError,
                                    r"Expected n=-1 >= 0\."):
            flag_values(["prog", "--n=-1"])
        flag_values.unparse_flags()
        flag_values(["prog"])  # None is not checked.
        self.assertIsNone(flag_values.n)

    def test_run_exits_with_code_2_and_one_line(self):
        def main(argv):
            raise app.UsageError(f"Unexpected arguments:\n{argv[1:]}")

        stderr = io.StringIO()
        with mock.patch.object(sys, "argv", ["prog"]), \
                contextlib.redirect_stderr(stderr), \
                self.assertRaises(SystemExit) as raised:
            command_line.run(main, argv=["prog", "extra"])
        self.assertEqual(raised.exception.code,
                         command_line.USAGE_ERROR_EXIT_CODE)
        self.assertEqual(stderr.getvalue(),
                         "prog: error: Unexpected arguments: ['extra']\n")

    def test_run_keeps_other_exceptions(self):
        def main(argv):
            del argv
            raise KeyError("a bug")

        with mock.patch.object(sys, "argv", ["prog"]), \
                self.assertRaises(KeyError):
            command_line.run(main, argv=["prog"])


if __name__ == "__main__":
    absltest.main()
