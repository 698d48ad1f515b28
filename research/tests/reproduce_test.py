"""research/reproduce.py: the binary end to end on tiny Fashion-MNIST-format
files (the report's contents are tested on recorded runs in
results_report_test.py, the phases on a fake training in
experiments_test.py)."""

import gzip
import os
import struct
import tempfile

import numpy as np
from absl.testing import absltest
from absl.testing import flagsaver

from research import common
from research import experiments
from research import reproduce
from research import runs
from research.tests import binary_driver


def _write_idx(path, array):
    """A gzipped uint8 IDX file (the format of Debian's Fashion-MNIST)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        struct.pack(">I", size) for size in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _tiny_fashion_mnist(folder, num_train=64, num_test=32, size=8):
    """Images whose brightness gives the class (learnable in a few steps)."""
    rng = np.random.default_rng(0)
    for prefix, n in (("train", num_train), ("t10k", num_test)):
        labels = rng.integers(0, 10, n)
        images = (labels[:, None, None] * 25
                  + rng.integers(0, 20, (n, size, size)))
        _write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"),
                   images)
        _write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte.gz"),
                   labels)


class PipelineTest(absltest.TestCase):

    def test_all_phases_train_the_cnn_and_write_the_report(self):
        data_dir = tempfile.mkdtemp()
        _tiny_fashion_mnist(data_dir)
        work = tempfile.mkdtemp()
        runs_dir = os.path.join(work, "runs")
        output_dir = os.path.join(work, "docs")
        # 64 examples, B = 16, one epoch: 4 steps, evaluated at 2 and 4.
        base = common.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, epochs=1.0, eval_every=2)
        plan = experiments.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpsgd": (1.0,), "dpadam": (1e-2,),
                            "dpadam_corrected": (1e-3,)},
            gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
            seeds=(0,), runs_dir=runs_dir,
            data=experiments.data_spec("fashion_mnist"),
            ceiling_learning_rate=1e-2)
        train = experiments.make_train_fn("fashion_mnist", data_dir=data_dir)
        trained = []

        def train_fn(config):
            trained.append(config)
            return train(config)

        machine = {"platform": "test-machine", "cpu_count": 2}
        with self.assertRaisesRegex(ValueError, "--phase=tune first"):
            reproduce.reproduce(plan, train_fn, phase="ceiling",
                                output_dir=output_dir, command="c",
                                machine=machine)
        path = reproduce.reproduce(plan, train_fn, phase="all",
                                   output_dir=output_dir,
                                   command="python -m research.reproduce",
                                   machine=machine)
        self.assertLen(trained, 4)
        # The ceiling: Adam without noise or clipping, the DP runs' steps.
        ceiling = trained[-1]
        self.assertEqual(
            (ceiling.optimizer, ceiling.noise_multiplier,
             ceiling.l2_norm_clip, ceiling.learning_rate,
             ceiling.target_epsilon),
            ("dpadam", 0.0, experiments.CEILING_CLIP, 1e-2, None))
        ceiling_record = experiments.collect_ceiling(
            plan, experiments.collect(plan))
        self.assertEqual(ceiling_record.steps, 4)
        self.assertEqual(ceiling_record.epsilon, float("inf"))
        records = experiments.collect(plan)
        self.assertLen(records, 3)
        for record in records.values():
            self.assertEqual(record.steps, 4)
            self.assertEqual([s for s, _ in record.history], [2, 4])
            self.assertBetween(record.accuracy, 0.0, 1.0)
        self.assertEqual(path, os.path.join(output_dir,
                                            "RESULTS_fashion_mnist.md"))
        for name in ("RESULTS_fashion_mnist.md", "RESULTS_fashion_mnist.json",
                     "RESULTS.md", "RESULTS_fashion_mnist_curves.png",
                     "RESULTS_fashion_mnist_tuning.png"):
            self.assertTrue(os.path.exists(os.path.join(output_dir, name)))
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for record in [*records.values(), ceiling_record]:
            self.assertIn(f"| `{record.name}` | 0 | "
                          f"{runs.format_percent(record.accuracy)} |", text)
        self.assertIn("**Non-private ceiling:** "
                      f"{runs.format_percent(ceiling_record.accuracy)}%",
                      text)
        with open(os.path.join(output_dir, "RESULTS.md"),
                  encoding="utf-8") as f:
            self.assertIn(
                "| Non-private Adam (ceiling, ε = ∞) | "
                f"{runs.format_percent(ceiling_record.accuracy)} (1 seed, "
                "lr 0.01) |", f.read())

        # Finished runs are read back, never retrained.
        def refuse(config):
            raise AssertionError(f"Retrained {config}.")

        reproduce.reproduce(plan, refuse, phase="all", output_dir=output_dir,
                            command="again", machine=machine)

    def test_newer_optimizer_with_rdp_calibrated_steps(self):
        # --optimizers=dpadam_stp --calibration_accountant=rdp on the tiny
        # images: N = 64, B = 16, sigma = 1 and epsilon = 5 allow 4 steps by
        # RDP, 6 by PLD (which the runs would count at train time).
        data_dir = tempfile.mkdtemp()
        _tiny_fashion_mnist(data_dir)
        num_examples = experiments.num_train_examples("fashion_mnist",
                                                      data_dir=data_dir)
        self.assertEqual(num_examples, 64)
        base = common.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=5.0, eval_every=2)
        self.assertEqual(common.total_steps(base, num_examples), 6)
        work = tempfile.mkdtemp()
        plan = experiments.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpadam_stp": (1e-2,)},
            gammas={"dpadam_stp": (1e-8,)}, seeds=(0,),
            runs_dir=os.path.join(work, "runs"),
            data=experiments.data_spec("fashion_mnist"),
            optimizers=("dpadam_stp",), calibration_accountant="rdp",
            num_examples=num_examples)
        train = experiments.make_train_fn("fashion_mnist", data_dir=data_dir)
        trained = []

        def train_fn(config):
            trained.append(config)
            return train(config)

        path = reproduce.reproduce(
            plan, train_fn, phase="all", output_dir=os.path.join(work, "out"),
            command="python -m research.reproduce --optimizers=dpadam_stp",
            machine={"platform": "test-machine", "cpu_count": 2})
        self.assertEqual([(c.optimizer, c.learning_rate, c.epsilon, c.seed)
                          for c in trained], [("dpadam_stp", 1e-2, 1e-8, 0)])
        self.assertEqual(common.total_steps(trained[0], num_examples), 4)
        (record,) = experiments.collect(plan).values()
        self.assertEqual((record.steps, record.setting.optimizer),
                         (4, "dpadam_stp"))
        self.assertLessEqual(record.epsilon, 5.0)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn("# DP-Adam STP on Fashion-MNIST", text)
        self.assertIn("| DP-Adam STP | 0.01 | 1e-08 | 1 | "
                      f"{runs.format_percent(record.accuracy)} ± 0.00 | "
                      f"{record.epsilon:.3f} | n/a |", text)
        self.assertIn("target ε = 5 with the steps calibrated by the RDP "
                      "accountant (4 steps for 64 examples", text)
        self.assertIn("Only DP-Adam STP in this plan: nothing to compare.",
                      text)

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                reproduce.main(["reproduce", "stray"])


class CommandLineTest(absltest.TestCase):
    """`python -m research.reproduce`'s new flags, through
    `binary_driver` (forked children that stop before training)."""

    def test_flags(self):
        output_dir = tempfile.mkdtemp()
        report = [f"--output_dir={output_dir}", "--phase=report",
                  f"--runs_dir={tempfile.mkdtemp()}", "--seeds=0"]
        cases = [
            ["--optimizers=dpsgd,adam"],
            ["--learning_rates_dpadam_stp=0.001"],
            ["--optimizers=dpadam_stp", "--gammas_dpadam_stp=none"],
            ["--calibration_accountant=moments"],
            # Nothing to train: only the report of the planned runs.
            ["--optimizers=dpadam_stp,dpadam_disk",
             "--calibration_accountant=rdp", *report],
        ]
        results = binary_driver.run_cases(
            [{"module": "research.reproduce", "args": args, "mode": "run"}
             for args in cases])
        for result, expected in zip(results[:4], (
                "--optimizers=['dpsgd', 'adam']: Expected optimizers='adam' "
                "in ['dpsgd', 'dpadam', 'dpadam_corrected', 'dpadam_stp', "
                "'dpadam_disk']",
                "--learning_rates_dpadam_stp is given but --optimizers lacks"
                " dpadam_stp",
                "DP-Adam STP needs numeric gammas",
                "--calibration_accountant")):
            self.assertEqual(result["code"], 2, result["stderr"])
            self.assertEqual(result["stderr"].count("\n"), 1,
                             result["stderr"])
            self.assertIn(expected, result["stderr"])
        # (absl's sys.exit(None) after main: the driver's code 1.)
        self.assertNotIn("Traceback", results[4]["stderr"])
        self.assertIn("Wrote ", results[4]["stdout"], results[4]["stderr"])
        with open(os.path.join(output_dir, "RESULTS_fashion_mnist.md"),
                  encoding="utf-8") as f:
            text = f.read()
        # Fashion-MNIST's 60,000 images, sigma = 0.52, B = 256: the 719
        # steps of research/results/RESULTS_fashion_mnist.md.
        self.assertIn("target ε = 7 with the steps calibrated by the RDP "
                      "accountant (719 steps for 60000 examples", text)
        self.assertIn("| DP-Adam STP | 0.0001 | 1e-08 | not run |", text)
        self.assertIn("| DP-Adam DiSK | 0.01 | 1e-08 | not run |", text)


if __name__ == "__main__":
    absltest.main()
