"""examples/train_image.py's --model_dir: the resumes that misstated epsilon
before the model's ledger (issue 49), each now refused in one line naming
the files and --resume_counting_all_steps, or counted.

Each is the real binary (`python -m examples.train_image`) on a tiny
setting (N = 256, B = 16, a few steps); run A has sigma = 1.5.

* A's checkpoint with the ledger.json of another run (sigma = 6), resumed
  with --noise_multiplier=6: before, 0.159 printed (honest 1.049);
* A without its ledger.json, resumed with another --max_examples: before,
  0.093 printed (honest >= 0.815);
* A without its checkpoints: before, the run started over and overwrote
  the ledger. With the flag it starts over counting A's steps.

A resume takes --learning_rate if given (else the checkpoint's), and its
bar counts the epochs of the whole run (`ResumeTest`). The kills (steps
after the last checkpoint) are research/tests/run_dir_kill_test.py's.

Run A is trained once for the file (`run_a`); the tests resume copies of
it, each run of the binary loading TensorFlow and tracing the DP step
(tens of seconds of CPU).
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import dp_accounting
import pytest
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.tools import run_dir
from tf_dpadam.tools import run_ledger
from tf_dpadam.accounting import ledger as ledger_lib

pytestmark = pytest.mark.slow  # Each run loads TensorFlow and the data.

ROOT = pathlib.Path(__file__).resolve().parent.parent
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
TINY = ("--max_examples=256", "--batch_size=16", "--optimizer=dpsgd",
        "--eval_every=2")
SIGMA = 1.5
FLAG = run_ledger.COUNT_ALL_FLAG


def train_image(*flags, expect_rc=0):
    """Runs the binary; (stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.train_image", *TINY, *flags],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == expect_rc, (done.returncode,
                                          done.stderr[-3000:])
    return done.stdout, done.stderr


def printed(stdout):
    """(steps, epsilon) of the binary's last line."""
    match = re.search(r"after (\d+) steps; spent epsilon (\S+) at", stdout)
    assert match, stdout[-2000:]
    return int(match[1]), float(match[2])


def pld_epsilon(steps, sigma=SIGMA):
    """Independent: steps of q = 16 / 256 composed by dp_accounting's PLD
    accountant as tf_dpadam sets it up."""
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-3)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        16 / 256, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(1e-5)


def usage_error(stderr):
    """The binary's one-line usage error."""
    lines = [l for l in stderr.splitlines()
             if l.startswith("train_image.py: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


_RUN_A = {}


def run_a():
    """(folder, stdout) of run A: 2 steps at sigma = 1.5 in a new
    --model_dir, trained on the first call. Resume copies of it."""
    if not _RUN_A:
        folder = os.path.join(tempfile.mkdtemp(), "a")
        stdout, _ = train_image(f"--model_dir={folder}",
                                f"--noise_multiplier={SIGMA}", "--max_steps=2")
        _RUN_A.update(folder=folder, stdout=stdout)
    return _RUN_A["folder"], _RUN_A["stdout"]


def copy_of_a():
    """A new --model_dir holding run A's files."""
    model_dir = os.path.join(tempfile.mkdtemp(), "run")
    shutil.copytree(run_a()[0], model_dir)
    return model_dir


@absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
class ResumeRefusalsTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.a_stdout = run_a()[1]

    def copy_of_a(self):
        return copy_of_a()

    def assert_refused(self, model_dir, *flags, pattern):
        before = {n: (pathlib.Path(model_dir) / n).read_bytes()
                  for n in os.listdir(model_dir) if n != run_dir.TRAIN_LOCK}
        line = usage_error(train_image(f"--model_dir={model_dir}", *flags,
                                       expect_rc=2)[1])
        self.assertRegex(line, pattern)
        self.assertIn(FLAG, line)
        after = {n: (pathlib.Path(model_dir) / n).read_bytes()
                 for n in os.listdir(model_dir) if n != run_dir.TRAIN_LOCK}
        self.assertEqual(after, before)  # Nothing written.

    def test_run_a_prints_its_ledgers_epsilon(self):
        self.assertEqual(printed(self.a_stdout)[0], 2)
        self.assertAlmostEqual(printed(self.a_stdout)[1], pld_epsilon(2),
                               delta=5e-4)

    def test_the_ledger_of_another_run_is_refused(self):
        model_dir = self.copy_of_a()
        # Run B's ledger.json (sigma = 6, 3 steps) copied in.
        settings = dict(run_dir.read_json(os.path.join(
            model_dir, run_dir.LEDGER))["settings"], noise_multiplier=6.0)
        b = ledger_lib.Ledger((ledger_lib.Segment(
            ledger_lib.Mechanism.poisson(6.0, 256, 16), 3),))
        run_dir.write_json(os.path.join(model_dir, run_dir.LEDGER),
                           run_ledger.Record(settings, b, 3, 3).to_json())
        self.assert_refused(
            model_dir, "--noise_multiplier=6", "--max_steps=4",
            pattern=r"checkpoint.keras and \S+/ledger.json disagree: the"
                    r" checkpoint's privacy ledger \(2 steps")

    def test_a_checkpoint_without_its_ledger_is_refused(self):
        model_dir = self.copy_of_a()
        os.remove(os.path.join(model_dir, run_dir.LEDGER))
        self.assert_refused(
            model_dir, f"--noise_multiplier={SIGMA}", "--max_steps=4",
            "--max_examples=512",
            pattern=r"checkpoint.keras holds 2 steps but \S+/ledger.json is"
                    " missing")

    def test_a_ledger_without_its_checkpoints_counts_its_steps(self):
        model_dir = self.copy_of_a()
        for name in (run_dir.CHECKPOINT, run_dir.PREVIOUS_CHECKPOINT):
            if os.path.exists(os.path.join(model_dir, name)):
                os.remove(os.path.join(model_dir, name))
        flags = (f"--model_dir={model_dir}", f"--noise_multiplier={SIGMA}",
                 "--max_steps=3")
        self.assert_refused(
            model_dir, *flags[1:],
            pattern=r"ledger.json records a checkpoint of 2 steps but"
                    r" \S+/checkpoint.keras is missing")
        # With the flag: a new model, which has spent A's 2 steps.
        steps, epsilon = printed(train_image(*flags, FLAG)[0])
        self.assertEqual(steps, 3)
        self.assertAlmostEqual(epsilon, pld_epsilon(3), delta=5e-4)
        self.assertGreater(epsilon, printed(self.a_stdout)[1])


def epoch_lines(stdout):
    """`(k, N)` of every `Epoch k/N` line Keras' bar wrote."""
    return [(int(k), int(n)) for k, n in
            re.findall(r"^Epoch (\d+)/(\d+)$", stdout, re.M)]


def learning_rate(model_dir):
    """The learning rate of `model_dir`'s checkpoint's optimizer."""
    assert tf_dpadam.PrivateModel  # Registers tf_dpadam's Keras classes.
    model = run_dir.load_checkpoint(model_dir)
    return float(model.optimizer.learning_rate.numpy())


@absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
class ResumeTest(absltest.TestCase):
    """Issue 52: a resume took the checkpoint's learning rate whatever
    --learning_rate said, and its bar counted to each `fit` call's last
    epoch (`Epoch 2/2` then `Epoch 3/3` in a run of 3)."""

    def test_learning_rate_and_epochs_of_the_whole_run(self):
        model_dir = copy_of_a()  # 2 steps at the default learning rate.
        # --eval_every=4 (the last one given counts) from here on: epochs
        # end at steps 4, 8 and the run's last.
        flags = (f"--model_dir={model_dir}", f"--noise_multiplier={SIGMA}",
                 "--eval_every=4")
        self.assertEqual(learning_rate(model_dir), 4.0)  # dpsgd's default.
        # Steps 3 to 9 by 4: fit calls of epochs of 2, 4 and 1 steps (each
        # length its own call); epochs 1 to 3 of 3.
        stdout, _ = train_image(*flags, "--max_steps=9", "--learning_rate=0.5")
        self.assertEqual(printed(stdout)[0], 9)
        self.assertEqual(epoch_lines(stdout), [(1, 3), (2, 3), (3, 3)])
        self.assertEqual(learning_rate(model_dir), 0.5)
        # Not given: the checkpoint's, not the default.
        stdout, _ = train_image(*flags, "--max_steps=10")
        self.assertEqual(printed(stdout)[0], 10)
        self.assertEqual(epoch_lines(stdout), [(3, 3)])
        self.assertEqual(learning_rate(model_dir), 0.5)


if __name__ == "__main__":
    absltest.main()
