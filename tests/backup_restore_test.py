"""A private model under keras.callbacks.BackupAndRestore, killed and restarted.

A real process (tests/backup_restore_check.py) trains with backups every
4 steps and is killed with SIGKILL after step 6; a second process restarts
the same command and finishes the 10 steps. Checked:

* the restart begins from the last backup exactly: the weights, Adam's
  moments and the optimizer's step count of step 4 (the steps 5 and 6 of
  the killed process are lost with it, as for any crash);
* the privacy ledger continues from there: 10 steps in total and the epsilon
  of 10 steps, nothing counted twice;
* the noise after the restart is fresh: the restarted step 5, from the same
  state on the same examples, differs from the killed process's step 5, by
  about as much as two independent noise draws would make it differ.
"""

import json
import os
import subprocess
import sys
import tempfile

import dp_accounting
import numpy as np
import pytest
from absl.testing import absltest

import tf_dpadam
from tests import backup_restore_check as check

pytestmark = pytest.mark.slow  # Kills and restarts a training process.

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "backup_restore_check.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_AT = 6
RESTORED = 4  # the last backup before the kill (every SAVE_FREQ = 4 steps)


def _run(work_dir, kill_at):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, SCRIPT, work_dir, str(kill_at)],
                          capture_output=True, text=True, timeout=300,
                          env=env, check=False)


def _load(path):
    with np.load(path) as arrays:
        return dict(arrays)


class BackupAndRestoreTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.dir = tempfile.mkdtemp()
        killed = _run(cls.dir, KILL_AT)
        cls.killed_code = killed.returncode
        restarted = _run(cls.dir, 0)
        lines = [l for l in restarted.stdout.splitlines()
                 if l.startswith("RESULT ")]
        if restarted.returncode != 0 or not lines:
            raise AssertionError(
                f"the restarted process failed:\n{restarted.stderr[-3000:]}")
        cls.result = json.loads(lines[-1][len("RESULT "):])

    def state(self, name):
        return _load(os.path.join(self.dir, name))

    def test_the_first_process_was_killed_after_step_6(self):
        self.assertEqual(self.killed_code, -9)  # SIGKILL
        self.assertTrue(os.path.exists(
            os.path.join(self.dir, f"state_first_{KILL_AT}.npz")))
        self.assertFalse(os.path.exists(
            os.path.join(self.dir, f"state_first_{KILL_AT + 1}.npz")))

    def test_restart_begins_exactly_at_the_last_backup(self):
        start = self.state("start_second.npz")
        backup = self.state(f"state_first_{RESTORED}.npz")
        self.assertEqual(int(start["iterations"]), RESTORED)
        self.assertEqual(sorted(start), sorted(backup))
        for key in start:
            np.testing.assert_array_equal(start[key], backup[key], err_msg=key)

    def test_ledger_counts_every_step_once(self):
        self.assertEqual(self.result["iterations"], check.TOTAL_STEPS)
        # Fixed batches, no amplification: 10 steps of 4 a pass begin 3
        # passes, each one Gaussian mechanism on every example, composed.
        passes = -(-check.TOTAL_STEPS // check.BATCHES_PER_EPOCH)
        accountant = dp_accounting.rdp.RdpAccountant(
            list(tf_dpadam.accounting.RDP_ORDERS))
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(check.NOISE_MULTIPLIER), passes))
        expected = accountant.get_epsilon(check.DELTA)
        self.assertAlmostEqual(self.result["epsilon"], expected, places=9)

    def test_noise_after_the_restart_is_fresh(self):
        before = self.state(f"state_first_{RESTORED}.npz")
        killed = self.state(f"state_first_{RESTORED + 1}.npz")
        restarted = self.state(f"state_second_{RESTORED + 1}.npz")
        # Same state, same examples: the first moments' change is
        # (1 - beta_1) * (g + z / B); only the noise z can differ.
        differences = np.concatenate([
            np.ravel(killed[k] - restarted[k]) for k in killed
            if k.startswith("m_")])
        noise_std = check.NOISE_MULTIPLIER * check.CLIP / check.BATCH
        # Two independent draws differ by sqrt(2) * 0.1 * noise_std per
        # coordinate (83 of them); a replay would differ by 0.
        ratio = np.std(differences) / (np.sqrt(2) * 0.1 * noise_std)
        self.assertBetween(ratio, 0.6, 1.4)
        for key in before:
            if key.startswith("weight_"):
                self.assertFalse(np.array_equal(killed[key], restarted[key]))


if __name__ == "__main__":
    absltest.main()
