"""examples/reproduce.py: the pure helpers on hand-made inputs, and the whole
tune -> seeds -> report pipeline on tiny Fashion-MNIST-format files."""

import gzip
import json
import math
import os
import struct
import tempfile

import numpy as np
from absl.testing import absltest
from absl.testing import flagsaver

from examples import reproduce
from examples.reproduce import Setting


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


_SGD = Setting("dpsgd", 1.0, None)
_ADAM = Setting("dpadam", 1e-3, 1e-8)
_BC = Setting("dpadam_corrected", 1e-3, None)


class HelpersTest(absltest.TestCase):

    def test_pick_best_per_optimizer(self):
        scored = [
            (Setting("dpsgd", 0.1, None), 0.60),
            (Setting("dpsgd", 1.0, None), 0.72),   # Best DP-SGD.
            (Setting("dpsgd", 10.0, None), math.nan),  # Diverged: never best.
            (Setting("dpadam", 1e-3, 1e-8), 0.70),  # Tie: the first listed.
            (Setting("dpadam", 1e-2, 1e-8), 0.70),
            (Setting("dpadam_corrected", 1e-3, None), None),  # Missing.
            (Setting("dpadam_corrected", 1e-2, None), 0.10),
        ]
        best = reproduce.pick_best(scored)
        self.assertEqual(best["dpsgd"], (Setting("dpsgd", 1.0, None), 0.72))
        self.assertEqual(best["dpadam"][0], Setting("dpadam", 1e-3, 1e-8))
        self.assertEqual(best["dpadam_corrected"][0],
                         Setting("dpadam_corrected", 1e-2, None))
        self.assertEmpty(reproduce.pick_best([]))

    def test_aggregate_seeds(self):
        # Mean 0.6; sample std sqrt((0.01 + 0 + 0.01) / 2) = 0.1.
        mean, std, n = reproduce.aggregate_seeds([0.5, 0.7, 0.6])
        self.assertAlmostEqual(mean, 0.6)
        self.assertAlmostEqual(std, 0.1)
        self.assertEqual(n, 3)
        self.assertEqual(reproduce.aggregate_seeds([0.8]), (0.8, 0.0, 1))
        mean, _, n = reproduce.aggregate_seeds([])
        self.assertTrue(math.isnan(mean))
        self.assertEqual(n, 0)

    def test_aggregate_curves_on_the_common_steps(self):
        steps, mean, std = reproduce.aggregate_curves([
            [(2, 0.2), (4, 0.4), (6, 0.6)],
            [(2, 0.4), (4, 0.6)],  # Seed without the last evaluation.
        ])
        np.testing.assert_array_equal(steps, [2, 4])
        np.testing.assert_allclose(mean, [0.3, 0.5])
        np.testing.assert_allclose(std, [0.1 * math.sqrt(2)] * 2)
        _, _, std = reproduce.aggregate_curves([[(1, 0.5)]])
        np.testing.assert_array_equal(std, [0.0])

    def test_compare_and_verdict(self):
        # Gap 0.05 > spread 0.01 + 0.02: beyond the seed spread.
        self.assertEqual(
            reproduce.compare((0.80, 0.01, 3), (0.75, 0.02, 3))[2], "better")
        # Gap 0.02 <= 0.01 + 0.02: within.
        self.assertEqual(
            reproduce.compare((0.77, 0.01, 3), (0.75, 0.02, 3))[2], "within")
        self.assertEqual(
            reproduce.compare((0.70, 0.01, 3), (0.75, 0.02, 3))[2], "worse")
        self.assertEqual(
            reproduce.compare((0.80, 0.0, 1), (0.75, 0.0, 1))[2], "unknown")
        paper = reproduce.PAPER_RESULTS["CIFAR-10"]
        text = reproduce.verdict_paragraph(
            {"dpsgd": (0.79, 0.01, 3), "dpadam": (0.75, 0.01, 3),
             "dpadam_corrected": (0.80, 0.01, 3)},
            paper, "CIFAR-10", "Fashion-MNIST")
        self.assertIn("DP-AdamBC beats DP-Adam by more than the seed spread",
                      text)
        self.assertIn("within the seed spread", text)  # 0.80 vs 0.79.
        self.assertIn("3.92 points", text)  # The paper's 60.27 - 56.35.

    def test_grids_names_and_configs(self):
        self.assertEqual(reproduce.parse_gammas(["None", "1e-9"]),
                         (None, 1e-9))
        with self.assertRaisesRegex(ValueError, "number"):
            reproduce.parse_floats(["fast"])
        with self.assertRaisesRegex(ValueError, "numeric gammas"):
            reproduce.make_grid("dpadam", (1e-3,), (None,))
        grid = reproduce.make_grid("dpadam_corrected", (1e-3, 1e-2),
                                   (None, 1e-9))
        self.assertLen(grid, 4)
        # DP-SGD has no gamma: one setting per learning rate.
        self.assertEqual(reproduce.make_grid("dpsgd", (1.0,), (1e-8, 1e-9)),
                         (Setting("dpsgd", 1.0, None),))
        names = {reproduce.run_name(s, seed) for s in grid for seed in (0, 1)}
        self.assertLen(names, 8)
        self.assertEqual(reproduce.run_name(_ADAM, 2),
                         "dpadam_lr0.001_g1e-08_seed2")
        base = reproduce.base_config("fashion_mnist")
        self.assertEqual((base.noise_multiplier, base.batch_size), (0.52, 256))
        config = reproduce.run_config(base, _BC, 3, "/tmp/x")
        self.assertEqual((config.optimizer, config.learning_rate,
                          config.epsilon, config.seed, config.model_dir),
                         ("dpadam_corrected", 1e-3, None, 3, "/tmp/x"))
        with self.assertRaisesRegex(ValueError, "epochs"):
            reproduce.base_config("fashion_mnist", target_epsilon=0)

    def test_render_markdown_on_hand_made_records(self):
        base = reproduce.base_config("fashion_mnist")
        plan = reproduce.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpsgd": (1.0,), "dpadam": (1e-3,),
                            "dpadam_corrected": (1e-3,)},
            gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
            seeds=(0, 1), runs_dir="/runs",
            data=reproduce.data_spec("fashion_mnist"))

        def record(setting, seed, accuracy):
            return reproduce.Record(
                name=reproduce.run_name(setting, seed), setting=setting,
                seed=seed, accuracy=accuracy, epsilon=6.99, steps=719,
                num_examples=60000, wall_seconds=60.0, resumed=False,
                history=((50, accuracy),), command="python -m x",
                machine=None)

        records = {r.name: r for r in (
            record(_SGD, 0, 0.80), record(_SGD, 1, 0.82),
            record(_ADAM, 0, 0.70), record(_ADAM, 1, 0.72),
            record(_BC, 0, 0.84),  # Seed 1 not run yet.
        )}
        best = {"dpsgd": _SGD, "dpadam": _ADAM, "dpadam_corrected": _BC}
        text = reproduce.render_markdown(
            plan=plan, records=records, best=best, command="python -m y",
            machine={"platform": "Linux-test", "cpu_count": 2},
            plots={"curves": "c.png", "tuning": "t.png"})
        self.assertIn("| DP-SGD | 1 | - | 2 | 81.00 ± 1.41 | 6.990 | 61.94 |",
                      text)
        self.assertIn("| DP-Adam | 0.001 | 1e-08 | 2 | 71.00 ± 1.41 |", text)
        self.assertIn("| DP-AdamBC | 0.001 | 0.04·Φ | 1 | 84.00 ± 0.00 |",
                      text)
        self.assertIn("fewer than two seeds", text)
        self.assertIn("Linux-test", text)
        self.assertIn("`python -m y`", text)
        self.assertIn("Total wall time: 300 s", text)
        self.assertIn("60000 training examples", text)
        self.assertIn("Steps per run: 719.", text)
        self.assertNotIn("little room", text)


class IndexTest(absltest.TestCase):

    def test_two_tasks_side_by_side(self):
        def summary(task, name, paper, rows):
            return {
                "task": task, "name": name, "paper_dataset": paper,
                "optimizers": rows, "verdict": f"verdict of {name}",
                "privacy": {"l2_norm_clip": 1.0, "noise_multiplier": 0.5,
                            "batch_size": 256, "delta": 1e-5,
                            "target_epsilon": 7.0, "steps": [536]},
                "data": "some data", "commands": [f"python -m {task}"],
                "machine": {"platform": "p", "cpu_count": 2},
                "runs": 15, "wall_seconds": 7200.0,
                "files": {"report": f"R_{task}.md",
                          "curves": f"R_{task}_curves.png"},
            }

        def row(mean, std, lr):
            return {"learning_rate": lr, "gamma": "-", "mean": mean,
                    "std": std, "seeds": 3, "epsilon": 6.99}

        text = reproduce.render_index([
            summary("fashion_mnist", "Fashion-MNIST", "CIFAR-10",
                    {"dpsgd": row(0.78, 0.004, 1.0),
                     "dpadam_corrected": row(0.81, 0.005, 1e-3)}),
            summary("sst2", "SST-2", "SNLI", {"dpadam": row(0.8, 0.01, 0.01)}),
        ])
        self.assertIn("| optimizer | Fashion-MNIST (ours) | SST-2 (ours) | "
                      "CIFAR-10 (paper) | SNLI (paper) |", text)
        self.assertIn("| DP-SGD | 78.00 ± 0.40 (3 seeds, lr 1) | not run | "
                      "61.94 | 41.31 |", text)
        self.assertIn("| DP-Adam | not run | 80.00 ± 1.00 (3 seeds, lr 0.01)"
                      " | 56.35 | 53.04 |", text)
        self.assertIn("verdict of SST-2", text)
        self.assertIn("2.00 h over 15 runs", text)
        self.assertIn("steps per run: 536", text)
        self.assertIn("- Command: `python -m sst2`", text)


class PipelineTest(absltest.TestCase):

    def test_tune_seeds_report_on_tiny_fashion_mnist(self):
        data_dir = tempfile.mkdtemp()
        _tiny_fashion_mnist(data_dir)
        work = tempfile.mkdtemp()
        runs_dir = os.path.join(work, "runs")
        output_dir = os.path.join(work, "docs")
        # 64 examples, B = 16, one epoch: 4 steps, evaluated at 2 and 4.
        base = reproduce.base_config(
            "fashion_mnist", batch_size=16, noise_multiplier=1.0,
            target_epsilon=None, epochs=1.0, eval_every=2)
        spec = reproduce.data_spec("fashion_mnist", max_examples=None)
        plan = reproduce.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpsgd": (0.1, 1.0), "dpadam": (1e-3, 1e-2),
                            "dpadam_corrected": (1e-3, 1e-2)},
            gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
            seeds=(0, 1), runs_dir=runs_dir, data=spec)
        train = reproduce.make_train_fn("fashion_mnist", data_dir=data_dir)
        trained = []

        def train_fn(config):
            trained.append((config.optimizer, config.learning_rate,
                            config.seed))
            return train(config)

        machine = {"platform": "test-machine", "cpu_count": 2}
        path = reproduce.reproduce(plan, train_fn, phase="all",
                                   output_dir=output_dir,
                                   command="python -m examples.reproduce",
                                   machine=machine)
        # 6 tuning runs at seed 0, then seed 1 of each best setting (its
        # seed 0 is the tuning run, read back).
        self.assertLen(trained, 9)
        self.assertEqual(sorted(s for _, _, s in trained), [0] * 6 + [1] * 3)
        self.assertEqual(path, os.path.join(output_dir,
                                            "RESULTS_fashion_mnist.md"))
        for name in ("RESULTS_fashion_mnist_curves.png",
                     "RESULTS_fashion_mnist_tuning.png"):
            with open(os.path.join(output_dir, name), "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        with open(path, encoding="utf-8") as f:
            text = f.read()

        # The best setting per optimizer is the best seed-0 accuracy on disk.
        accuracies = {}
        for name in os.listdir(runs_dir):
            with open(os.path.join(runs_dir, name, "metrics.json")) as f:
                metrics = json.load(f)
            self.assertEqual(metrics["steps"], 4)
            self.assertEqual([r["step"] for r in metrics["history"]], [2, 4])
            accuracies[name] = metrics["test_accuracy"]
        self.assertLen(accuracies, 9)
        records = reproduce.collect(plan)
        best = reproduce.best_of_tuning(plan, records)
        for optimizer, grid in plan.grids.items():
            top = max(accuracies[reproduce.run_name(s, 0)] for s in grid)
            self.assertEqual(
                accuracies[reproduce.run_name(best[optimizer], 0)], top)
            # Both seeds of the best setting are in the final table.
            mean, std, n = reproduce.aggregate_seeds(
                accuracies[reproduce.run_name(best[optimizer], s)]
                for s in (0, 1))
            label = reproduce.OPTIMIZER_NAMES[optimizer]
            self.assertIn(f"| {label} | {best[optimizer].learning_rate:g} | "
                          f"{reproduce.format_gamma(best[optimizer])} | 2 | "
                          f"{100 * mean:.2f} ± {100 * std:.2f} |", text)
            # Every grid point is in the tuning table.
            for setting in grid:
                self.assertRegex(
                    text, rf"\| {label} \| {setting.learning_rate:g} \| "
                          r"[^|]+ \| \d+\.\d\d( \*\*\(best\)\*\*)? \| ")
        for expected in ("test-machine", "`python -m examples.reproduce`",
                         "Fashion-MNIST", "CIFAR-10", "61.94", "56.35",
                         "60.27", "RESULTS_fashion_mnist_curves.png",
                         "RESULTS_fashion_mnist_tuning.png", "wall (s)",
                         "seed spread", "Steps per run: 4. Under 100"):
            self.assertIn(expected, text)

        # RESULTS.md sums up the task from RESULTS_fashion_mnist.json.
        with open(os.path.join(output_dir, "RESULTS.md"),
                  encoding="utf-8") as f:
            index = f.read()
        for optimizer in plan.grids:
            mean, std, _ = reproduce.aggregate_seeds(
                accuracies[reproduce.run_name(best[optimizer], s)]
                for s in (0, 1))
            self.assertIn(f"{100 * mean:.2f} ± {100 * std:.2f} (2 seeds, lr "
                          f"{best[optimizer].learning_rate:g})", index)
        for expected in ("Fashion-MNIST (ours)", "CIFAR-10 (paper)",
                         "[RESULTS_fashion_mnist.md](RESULTS_fashion_mnist.md)",
                         "(RESULTS_fashion_mnist_curves.png)",
                         "`python -m examples.reproduce`", "test-machine"):
            self.assertIn(expected, index)

        # Finished runs are read back, never retrained.
        def refuse(config):
            raise AssertionError(f"Retrained {config}.")

        for phase in ("report", "all"):
            reproduce.reproduce(plan, refuse, phase=phase,
                                output_dir=output_dir, command="again",
                                machine=machine)
        # Runs on other data are refused rather than mixed in.
        other = reproduce.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpsgd": (0.1,), "dpadam": (1e-3,),
                            "dpadam_corrected": (1e-3,)},
            gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
            seeds=(0,), runs_dir=runs_dir,
            data=reproduce.data_spec("fashion_mnist", max_examples=32))
        with self.assertRaisesRegex(ValueError, "other data"):
            reproduce.reproduce(other, refuse, phase="tune",
                                output_dir=output_dir, command="x",
                                machine=machine)

    def test_seeds_phase_needs_the_tuning(self):
        base = reproduce.base_config("fashion_mnist", target_epsilon=None,
                                     epochs=1.0)
        plan = reproduce.make_plan(
            "fashion_mnist", base=base,
            learning_rates={"dpsgd": (1.0,), "dpadam": (1e-3,),
                            "dpadam_corrected": (1e-3,)},
            gammas={"dpadam": (1e-8,), "dpadam_corrected": (None,)},
            seeds=(0,), runs_dir=tempfile.mkdtemp(), data={})
        with self.assertRaisesRegex(ValueError, "--phase=tune first"):
            reproduce.reproduce(plan, None, phase="seeds",
                                output_dir=tempfile.mkdtemp(), command="x",
                                machine={})

    def test_main_rejects_stray_arguments(self):
        with flagsaver.flagsaver():
            with self.assertRaises(Exception):
                reproduce.main(["reproduce", "stray"])


if __name__ == "__main__":
    absltest.main()
