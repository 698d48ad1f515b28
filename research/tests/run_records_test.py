"""research/run_records.py: finished runs saved and restored, others not."""

import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest

from research import run_records
from research import runs


def _run(root, name, status, steps=4):
    folder = os.path.join(root, name)
    os.makedirs(folder)
    with open(os.path.join(folder, runs.SIDECAR), "w") as f:
        json.dump({"status": status}, f)
    with open(os.path.join(folder, runs.METRICS), "w") as f:
        json.dump({"steps": steps}, f)
    with open(os.path.join(folder, "checkpoint.keras"), "w") as f:
        f.write("big")


class RunRecordsTest(absltest.TestCase):

    def test_save_and_restore(self):
        runs_dir, records = tempfile.mkdtemp(), tempfile.mkdtemp()
        _run(runs_dir, "task/a_seed0", "done")
        _run(runs_dir, "task/b_seed0", "running")
        _run(runs_dir, "other/cell/c_seed1", "done")
        self.assertEqual(
            run_records.copy_runs(runs_dir, records, overwrite=True),
            ["other/cell/c_seed1", "task/a_seed0"])
        self.assertCountEqual(
            os.listdir(os.path.join(records, "task", "a_seed0")),
            [runs.METRICS, runs.SIDECAR])  # No checkpoint.
        self.assertFalse(os.path.exists(os.path.join(records, "task",
                                                     "b_seed0")))
        # A fresh clone: both finished runs come back, readable as done.
        fresh = tempfile.mkdtemp()
        run_records.copy_runs(records, fresh, overwrite=False)
        self.assertEqual(run_records.finished_runs(fresh),
                         ["other/cell/c_seed1", "task/a_seed0"])
        # A finished run already on disk is never overwritten by a restore.
        with open(os.path.join(fresh, "task", "a_seed0", runs.METRICS),
                  "w") as f:
            json.dump({"steps": 99}, f)
        self.assertEqual(
            run_records.copy_runs(records, fresh, overwrite=False), [])
        self.assertEqual(runs.read_json(os.path.join(
            fresh, "task", "a_seed0", runs.METRICS)), {"steps": 99})

    def test_usage(self):
        self.assertEqual(run_records.main(["run_records", "push"]), 2)

    def test_the_records_live_in_research_run_records(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        records = os.path.join(root, "research", "run_records")
        # The committed records are where save and restore look.
        self.assertGreater(len(run_records.finished_runs(records)), 10)
        with mock.patch.object(run_records, "copy_runs",
                               return_value=[]) as copy:
            self.assertEqual(run_records.main(["run_records", "save"]), 0)
            copy.assert_called_once_with(os.path.join(root, "runs"), records,
                                         overwrite=True)
            copy.reset_mock()
            self.assertEqual(run_records.main(["run_records", "restore"]), 0)
            copy.assert_called_once_with(records, os.path.join(root, "runs"),
                                         overwrite=False)


if __name__ == "__main__":
    absltest.main()
