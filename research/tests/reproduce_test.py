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

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                reproduce.main(["reproduce", "stray"])


if __name__ == "__main__":
    absltest.main()
