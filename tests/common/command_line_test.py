"""Tests of `tf_dpadam.common.command_line`: usage errors in one line, exit code 2;
deprecated flag names; the offline checks of the example binaries.

The privacy command line's own errors are tested end to end in
privacy_cli_test.
"""

import contextlib
import io
import os
import shutil
import socket
import sys
import tempfile
import time
from unittest import mock

from absl import app
from absl import flags
from absl.testing import absltest

from tf_dpadam.common import command_line


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

    def test_deprecated_alias_warns_and_sets_the_new_flag(self):
        flags.DEFINE_float("command_line_test_gamma", None, "New name.")
        command_line.define_deprecated_alias("command_line_test_old_gamma",
                                             "command_line_test_gamma")
        seen = []

        def main(argv):
            del argv
            seen.append(flags.FLAGS.command_line_test_gamma)

        for args, value in ((["--command_line_test_old_gamma=0.5"], 0.5),
                            (["--command_line_test_gamma=2"], 2.0), ([], None)):
            stderr = io.StringIO()
            with mock.patch.object(sys, "argv", ["prog"]), \
                    contextlib.redirect_stderr(stderr), \
                    self.assertRaises(SystemExit) as raised:
                command_line.run(main, argv=["prog", *args])
            flags.FLAGS.unparse_flags()
            self.assertIn(raised.exception.code, (0, None))
            self.assertEqual(seen.pop(), value)
            self.assertEqual(
                stderr.getvalue(),
                "warning: --command_line_test_old_gamma is deprecated and will"
                " be removed; use --command_line_test_gamma.\n" if "old" in
                "".join(args) else "")
        stderr = io.StringIO()
        with mock.patch.object(sys, "argv", ["prog"]), \
                contextlib.redirect_stderr(stderr), \
                self.assertRaises(SystemExit) as raised:
            command_line.run(main, argv=[
                "prog", "--command_line_test_gamma=1",
                "--command_line_test_old_gamma=2"])
        flags.FLAGS.unparse_flags()
        self.assertEqual(raised.exception.code,
                         command_line.USAGE_ERROR_EXIT_CODE)
        self.assertEqual(
            stderr.getvalue(), "prog: error: --command_line_test_old_gamma is"
            " the deprecated name of --command_line_test_gamma; give"
            " --command_line_test_gamma only.\n")

    def test_unreachable_gives_a_reason_within_its_timeout(self):
        start = time.monotonic()
        # Nothing listens on port 9 here (discard): refused at once.
        why = command_line.unreachable("http://127.0.0.1:9/", timeout=2.0)
        self.assertLess(time.monotonic() - start, 3.0)
        self.assertStartsWith(why, "no network: ")
        with mock.patch.dict(os.environ, {"https_proxy": "http://127.0.0.1:9"}):
            self.assertIsNotNone(command_line.unreachable("https://example.org"))

    def test_unreachable_is_none_for_a_listening_host(self):
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            self.assertIsNone(
                command_line.unreachable(f"http://127.0.0.1:{port}/"))

    def test_preset_unreachable_for_a_name_not_a_folder(self):
        offline = {"https_proxy": "http://127.0.0.1:9"}  # Nothing listens.
        with mock.patch.dict(os.environ, offline):
            for name in ("bert_tiny_en_uncased", "hf://owner/bert",
                         "kaggle://keras/bert/keras/bert_tiny_en_uncased"):
                self.assertStartsWith(
                    command_line.preset_unreachable(name), "no network: ")
            # A folder, no preset, or a scheme keras-hub reads itself.
            self.assertIsNone(
                command_line.preset_unreachable(tempfile.mkdtemp()))
            self.assertIsNone(command_line.preset_unreachable(None))
            self.assertIsNone(
                command_line.preset_unreachable("gs://bucket/bert"))
        with mock.patch.object(command_line, "unreachable",
                               return_value=None):  # A host that answers.
            self.assertIsNone(
                command_line.preset_unreachable("bert_tiny_en_uncased"))

    def test_tfds_prepared_looks_for_dataset_info(self):
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root)
        self.assertFalse(command_line.tfds_prepared("glue/sst2", root))
        folder = os.path.join(root, "glue", "sst2", "2.0.0")
        os.makedirs(folder)
        self.assertFalse(command_line.tfds_prepared("glue/sst2", root))
        with open(os.path.join(folder, "dataset_info.json"), "w") as f:
            f.write("{}")
        self.assertTrue(command_line.tfds_prepared("glue/sst2", root))
        self.assertFalse(command_line.tfds_prepared("cifar10", root))
        with mock.patch.dict(os.environ, {"TFDS_DATA_DIR": root}):
            self.assertTrue(command_line.tfds_prepared("glue/sst2"))

    def test_run_keeps_other_exceptions(self):
        def main(argv):
            del argv
            raise KeyError("a bug")

        with mock.patch.object(sys, "argv", ["prog"]), \
                self.assertRaises(KeyError):
            command_line.run(main, argv=["prog"])


if __name__ == "__main__":
    absltest.main()
