"""The files of a run folder (tf_dpadam.tools.run_files): a full disk or a folder
made read-only is one line naming the file and the cause (issue 52)."""

import contextlib
import errno
import os
import re
import tempfile
from unittest import mock

from absl.testing import absltest

from tf_dpadam.tools import run_files


def _os_error(code):
    return OSError(code, os.strerror(code))


class WriteFailureTest(absltest.TestCase):

    def assert_one_line(self, error, path, code):
        message = str(error)
        self.assertNotIn("\n", message)
        self.assertIn(f"Cannot write {path} ({os.strerror(code)},"
                      f" {errno.errorcode[code]})", message)

    def test_a_folder_made_read_only_mid_run(self):
        model_dir = tempfile.mkdtemp()
        path = os.path.join(model_dir, "ledger.json")
        run_files.write_json(path, {"steps": 1})
        if os.geteuid() == 0:  # chmod does not stop root: simulated.
            refuse = mock.patch.object(
                os, "replace", side_effect=_os_error(errno.EACCES))
        else:
            os.chmod(model_dir, 0o500)
            refuse = contextlib.nullcontext()
        try:
            with refuse, self.assertRaises(run_files.SettingsError) as error:
                run_files.write_json(path, {"steps": 2})
        finally:
            os.chmod(model_dir, 0o700)
        self.assert_one_line(error.exception, path, errno.EACCES)
        self.assertEqual(os.listdir(model_dir), ["ledger.json"])
        self.assertEqual(run_files.read_json(path), {"steps": 1})

    def test_the_write_test_leaves_no_file_on_a_full_disk(self):
        model_dir = tempfile.mkdtemp()
        with mock.patch.object(os, "fsync",
                               side_effect=_os_error(errno.ENOSPC)):
            with self.assertRaisesRegex(
                    run_files.SettingsError,
                    f"^--model_dir={re.escape(model_dir)} is not writable"
                    r" \(No space left on device\)"):
                run_files.check_writable(model_dir)
        self.assertEqual(os.listdir(model_dir), [])

    def test_leftovers_of_a_killed_writer_are_removed(self):
        model_dir = tempfile.mkdtemp()
        for name in ("checkpoint.1.partial.keras", "ledger.json.2.partial",
                     f"{run_files.WRITE_TEST}.3", "checkpoint.keras"):
            open(os.path.join(model_dir, name), "w").close()
        run_files.remove_leftovers(model_dir)
        self.assertEqual(os.listdir(model_dir), ["checkpoint.keras"])


if __name__ == "__main__":
    absltest.main()
