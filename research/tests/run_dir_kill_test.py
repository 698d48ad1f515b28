"""research.training's run directory under SIGKILL at random moments (issue 34).

A child process (run_dir_kill_check.py) trains a tiny private model
with a checkpoint after every step in one model_dir and is killed with
SIGKILL `KILLS` times: at a random moment after training began, or while a
checkpoint is being written (its temporary file is half written for a
moment). Then it runs to the end. Checked:

* every restart resumes from the checkpoint the killed process last saved
  (or from the one it was renaming into place when killed), never from
  scratch, and none fails to load;
* the final ledger has one segment per process that kept steps, with the
  steps the processes' own logs give, and the run's settings;
* the reported epsilon (metrics.json) equals an independent dp_accounting
  composition of the ledger's segments; no half-written file is left.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import dp_accounting
import keras
import numpy as np
from absl.testing import absltest

import tf_dpadam
from research import common
from research import runs
from research.tests import run_dir_kill_check as check

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "run_dir_kill_check.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
KILLS = 8


def _wait_for(condition, process, timeout=120.0):
    """Polls `condition()` until true (True) or `process` ended (False)."""
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.01)
    raise AssertionError("the child neither got there nor ended")


def _processes(log):
    """[(start step, [saved steps])] per process that began training."""
    processes = []
    with open(log) as f:
        for line in f:
            kind, step = line.split()
            if kind == "START":
                processes.append((int(step), []))
            else:
                processes[-1][1].append(int(step))
    return processes


def _epsilon(segments):
    """Independent: the segments' Poisson-sampled Gaussian steps composed
    by dp_accounting's accountant of the run (PLD as tf_dpadam sets it up:
    add-or-remove-one, pessimistic, value discretization 1e-3)."""
    if segments[-1]["settings"]["accountant"] == "rdp":
        accountant = dp_accounting.rdp.RdpAccountant(
            list(tf_dpadam.accounting.RDP_ORDERS))
    else:
        accountant = dp_accounting.pld.PLDAccountant(
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            value_discretization_interval=1e-3)
    for segment in segments:
        s = segment["settings"]
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                s["batch_size"] / s["num_examples"],
                dp_accounting.GaussianDpEvent(s["noise_multiplier"])),
            segment["steps"]))
    return accountant.get_epsilon(segments[0]["settings"]["delta"])


class KillLoopTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.dir = tempfile.mkdtemp()
        cls.model_dir = os.path.join(cls.dir, "run")
        cls.log = os.path.join(cls.dir, "log")
        open(cls.log, "w").close()
        rng = np.random.default_rng()
        cls.codes, cls.mid_write = [], 0
        env = dict(os.environ, PYTHONPATH=ROOT)
        for i in range(KILLS + 1):
            with open(os.path.join(cls.dir, f"stderr_{i}"), "w") as err:
                child = subprocess.Popen(
                    [sys.executable, SCRIPT, cls.model_dir, cls.log],
                    stdout=subprocess.DEVNULL, stderr=err, env=env)
            if i < KILLS:
                starts = len(_processes(cls.log))
                if i % 2:  # While a checkpoint is written.
                    partial = os.path.join(
                        cls.model_dir, f"checkpoint.{child.pid}.partial.keras")
                    running = _wait_for(lambda: os.path.exists(partial), child)
                    time.sleep(rng.uniform(0, check.HALF_WRITTEN_SECONDS))
                    cls.mid_write += running
                else:  # At a random moment of training.
                    running = _wait_for(
                        lambda: len(_processes(cls.log)) > starts, child)
                    time.sleep(rng.uniform(0, 1.0))
                if running:
                    child.send_signal(signal.SIGKILL)
            cls.codes.append(child.wait(timeout=300))
        with open(os.path.join(cls.dir, f"stderr_{KILLS}")) as f:
            cls.last_stderr = f.read()

    def test_killed_and_finished(self):
        self.assertEqual(self.codes[-1], 0, self.last_stderr[-3000:])
        self.assertEqual(self.codes[:-1], [-signal.SIGKILL] * KILLS)
        self.assertGreaterEqual(self.mid_write, KILLS // 2 - 1)

    def test_every_restart_resumes_the_last_checkpoint(self):
        processes = _processes(self.log)
        self.assertGreater(len(processes), KILLS // 2)
        for (start, saved), (next_start, _) in zip(processes, processes[1:]):
            last = saved[-1] if saved else start
            # SAVED is logged just after the rename: a kill in between
            # leaves one more step than the log says.
            self.assertBetween(next_start, last, last + 1)
        self.assertEqual(processes[-1][1][-1], check.TOTAL_STEPS)
        model = keras.models.load_model(
            os.path.join(self.model_dir, runs.CHECKPOINT))
        self.assertEqual(int(model.optimizer.iterations), check.TOTAL_STEPS)
        self.assertEqual(
            glob.glob(os.path.join(self.model_dir, "*.partial*")), [])

    def test_ledger_and_epsilon_are_exact(self):
        starts = [start for start, _ in _processes(self.log)]
        ends = starts[1:] + [check.TOTAL_STEPS]
        expected = [(a, b - a) for a, b in zip(starts, ends) if b > a]
        ledger = runs.read_json(os.path.join(self.model_dir, runs.LEDGER))
        segments = ledger["segments"]
        self.assertEqual([(s["first_step"], s["steps"]) for s in segments],
                         expected)
        settings = dict(
            noise_multiplier=1.0, l2_norm_clip=1.0, batch_size=16,
            num_examples=check.NUM_EXAMPLES, sampling_rate=0.25,
            optimizer="dpadam_corrected", physical_batch_size=8,
            # Physical batches of 8 per logical step, as the pipeline
            # planned them (enough for Poisson batches well above B).
            accumulation_steps=keras.models.load_model(os.path.join(
                self.model_dir, runs.CHECKPOINT)).optimizer
            .dp_accumulation_steps,
            sampling="poisson", delta=1e-5, accountant=common.ACCOUNTANT)
        self.assertEqual(ledger["settings"], settings)
        for segment in segments:
            self.assertEqual(segment["settings"], settings)
        with open(os.path.join(self.model_dir, runs.METRICS)) as f:
            metrics = json.load(f)
        self.assertEqual(metrics["steps"], check.TOTAL_STEPS)
        self.assertEqual(metrics["ledger"], segments)
        # Composed per segment or at once: equal up to the PLD's
        # discretization (bit for bit with RDP).
        self.assertAlmostEqual(metrics["epsilon"], _epsilon(segments),
                               delta=1e-6 * metrics["epsilon"])


if __name__ == "__main__":
    absltest.main()
