"""research.training's run directory under SIGKILL at random moments (issues
34 and 49).

A child process (run_dir_kill_check.py) trains a tiny private model with a
checkpoint after every step in one model_dir and is killed with SIGKILL
`KILLS` times (10; RUN_DIR_KILLS=N for another count), in turn: at a
random moment after training began, while a checkpoint is being written
(its temporary file is half written for a moment) and while ledger.json is
being written (the same). Then it runs to the end. Checked, from the children's logs of the steps they reserved,
took and saved:

* every restart resumes from the checkpoint the killed process last saved
  (or from the one it was renaming into place when killed), never from
  scratch, and none fails to load;
* every step any process took is in the final ledger: each restart begins
  at the killed process's last reserved step (at most one past the last
  step it began), so the ledger's steps and epsilon are at least those of
  every step taken (composed independently by dp_accounting), and the run
  takes no more steps than planned, however often it is killed;
* the reported epsilon (metrics.json) equals an independent dp_accounting
  composition of the ledger's segments; no half-written file is left.
"""

import collections
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import dp_accounting
import numpy as np
from absl.testing import absltest

import tf_dpadam
from research import runs
from research.tests import run_dir_kill_check as check

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "run_dir_kill_check.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# Issue 49 asks for >= 10 kills: 11 processes, about 2 minutes on 2 busy
# cores (a slow test); RUN_DIR_KILLS=N runs another count.
KILLS = int(os.environ.get("RUN_DIR_KILLS", "10"))
Q = 16 / check.NUM_EXAMPLES


def _wait_for(condition, process, timeout=120.0):
    """Polls `condition()` until true (True) or `process` ended (False)."""
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError("the child neither got there nor ended")


def _events(log):
    """{pid: {event: [numbers of each line]}}, pids in the order they
    first logged."""
    events = collections.defaultdict(lambda: collections.defaultdict(list))
    with open(log) as f:
        for line in f:
            pid, event, *numbers = line.split()
            events[int(pid)][event].append([int(n) for n in numbers])
    return events


def _started(log):
    """The processes that began training."""
    return [p for p in _events(log).values() if p["START"]]


def _pld_epsilon(steps):
    """Independent: `steps` Poisson-sampled Gaussian steps of the run
    composed by dp_accounting's PLD accountant as tf_dpadam sets it up
    (add-or-remove-one, pessimistic, value discretization 1e-3)."""
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-3)
    for count in filter(None, steps):
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                Q, dp_accounting.GaussianDpEvent(1.0)), count))
    return accountant.get_epsilon(1e-5)


class KillLoopTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.dir = tempfile.mkdtemp()
        cls.model_dir = os.path.join(cls.dir, "run")
        cls.log = os.path.join(cls.dir, "log")
        open(cls.log, "w").close()
        rng = np.random.default_rng()
        cls.codes, cls.mid_write = [], collections.Counter()
        env = dict(os.environ, PYTHONPATH=ROOT)
        for i in range(KILLS + 1):
            with open(os.path.join(cls.dir, f"stderr_{i}"), "w") as err:
                child = subprocess.Popen(
                    [sys.executable, SCRIPT, cls.model_dir, cls.log],
                    stdout=subprocess.DEVNULL, stderr=err, env=env)
            if i < KILLS:
                cls._kill_sometime(child, i % 3, rng)
            cls.codes.append(child.wait(timeout=300))
        with open(os.path.join(cls.dir, f"stderr_{KILLS}")) as f:
            cls.last_stderr = f.read()

    @classmethod
    def _kill_sometime(cls, child, kind, rng):
        """SIGKILLs `child` once it trains: at a random moment (kind 0),
        while it writes a checkpoint (1) or ledger.json (2)."""
        running = _wait_for(
            lambda: _events(cls.log)[child.pid]["START"], child)
        if running and kind:
            name = (f"checkpoint.{child.pid}.partial.keras" if kind == 1
                    else f"ledger.json.{child.pid}.partial")
            partial = os.path.join(cls.model_dir, name)
            running = _wait_for(lambda: os.path.exists(partial), child)
            time.sleep(rng.uniform(0, check.HALF_WRITTEN_SECONDS))
            cls.mid_write[kind] += running
        elif running:
            time.sleep(rng.uniform(0, 1.0))
        if running:
            child.send_signal(signal.SIGKILL)

    def test_killed_and_finished(self):
        self.assertEqual(self.codes[-1], 0, self.last_stderr[-3000:])
        self.assertEqual(self.codes[:-1], [-signal.SIGKILL] * KILLS)
        # Most kills of kinds 1 and 2 hit a write (a process can end
        # before it writes again).
        self.assertGreaterEqual(sum(self.mid_write.values()), KILLS // 2)

    def test_every_restart_resumes_the_last_checkpoint(self):
        processes = _started(self.log)
        self.assertGreater(len(processes), KILLS // 2)
        for process, after in zip(processes, processes[1:]):
            iterations = process["START"][0][1]
            last = process["SAVED"][-1][0] if process["SAVED"] else iterations
            # SAVED is logged just after the rename: a kill in between
            # leaves one more step than the log says.
            self.assertBetween(after["START"][0][1], last, last + 1)
        checkpoint = tf_dpadam.run_dir.load_checkpoint(self.model_dir)
        self.assertEqual(checkpoint.privacy_ledger.steps, check.TOTAL_STEPS)
        self.assertEqual(
            glob.glob(os.path.join(self.model_dir, "*.partial*")), [])

    def test_every_step_taken_is_in_the_ledger(self):
        processes = _started(self.log)
        self.assertEqual(processes[0]["START"][0][0], 0)
        taken = []  # The most steps each process took: to its last BEGIN.
        ran = []  # The steps it logged as run.
        for process, after in zip(processes, processes[1:] + [None]):
            start = process["START"][0][0]
            begun = max([n for n, in process["BEGIN"]], default=start)
            done = max([n for n, in process["STEP"]], default=start)
            self.assertBetween(done, begun - 1, begun)
            taken.append(begun - start)
            ran.append(done - start)
            if after is not None:
                # A restart counts the killed process's reservation: at
                # least its last step begun, at most one more (a kill
                # between the reservation and its log line).
                self.assertBetween(after["START"][0][0], begun, begun + 1)
        self.assertBetween(sum(taken), check.TOTAL_STEPS - KILLS,
                           check.TOTAL_STEPS)
        with open(os.path.join(self.model_dir, runs.METRICS)) as f:
            metrics = json.load(f)
        self.assertEqual(metrics["steps"], check.TOTAL_STEPS)
        self.assertGreaterEqual(metrics["epsilon"],
                                _pld_epsilon(taken) * (1 - 1e-6))
        print(f"\n{KILLS} kills ({dict(self.mid_write)} mid-write), steps"
              f" taken per the logs {sum(ran)} to {sum(taken)} (optimizer"
              f" {processes[-1]['SAVED'][-1][0]}), ledger"
              f" {metrics['steps']}: epsilon {metrics['epsilon']:.4f} >="
              f" {_pld_epsilon(taken):.4f}")

    def test_the_ledger_and_its_epsilon_are_exact(self):
        with open(os.path.join(self.model_dir, runs.METRICS)) as f:
            metrics = json.load(f)
        record = runs.read_json(os.path.join(self.model_dir, runs.LEDGER))
        self.assertEqual(record["ledger"], metrics["ledger"])
        self.assertEqual(record["reserved_steps"], check.TOTAL_STEPS)
        self.assertEqual(record["checkpoint_steps"], check.TOTAL_STEPS)
        self.assertEqual(record["settings"]["noise_multiplier"], 1.0)
        segments = metrics["ledger"]["segments"]
        for segment in segments:
            self.assertEqual(
                (segment["sampling"], segment["noise_multiplier"],
                 segment["num_examples"], segment["expected_batch_size"]),
                ("poisson", 1.0, check.NUM_EXAMPLES, 16))
        self.assertEqual(sum(s["steps"] for s in segments), check.TOTAL_STEPS)
        # Composed per segment or at once: equal up to the PLD's
        # discretization.
        self.assertAlmostEqual(
            metrics["epsilon"], _pld_epsilon([s["steps"] for s in segments]),
            delta=1e-6 * metrics["epsilon"])


if __name__ == "__main__":
    absltest.main()
