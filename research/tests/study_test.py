"""research/study.py end to end on tiny Fashion-MNIST-format files: real
runs of the CNN in two cells calibrated to epsilon = 3 at equal epochs, read
back by a second call, a folder of other settings refused, the report
written, and each run's median (v_hat - Phi) / Phi against NumPy on its
checkpoint's optimizer state."""

import json
import os
import tempfile
from unittest import mock

import keras
import numpy as np
from absl.testing import absltest

from research import datasets
from research import imbalance
from research import study
from research import study_plan
from research.tests import research_helpers


def _numpy_median_ratio(checkpoint, config):
    """median over coordinates of (v / (1 - beta_2^t) - Phi) / Phi, from
    the saved optimizer's variables and the config's sigma, C and B."""
    model = keras.models.load_model(checkpoint)
    optimizer = model.optimizer
    t = int(optimizer.iterations.numpy())
    names = {v.path: v.numpy() for v in optimizer.variables}
    velocities = [value for path, value in names.items()
                  if "velocity" in path]
    assert len(velocities) == len(model.trainable_variables), names.keys()
    v = np.concatenate([x.ravel() for x in velocities]).astype(np.float64)
    phi = (config.noise_multiplier * config.l2_norm_clip
           / config.batch_size) ** 2
    return float(np.median((v / (1 - config.beta_2 ** t) - phi) / phi)), t


class StudyTest(absltest.TestCase):

    def test_runs_resume_refuse_and_report(self):
        work = tempfile.mkdtemp()
        runs_dir = os.path.join(work, "runs")
        output_dir = os.path.join(work, "docs")
        settings = dict(
            num_examples=64, runs_dir=runs_dir, data=study_plan.data_spec(),
            batch_sizes=["16", "32"], epsilons=["3"], epochs=1.0,
            variants=["dpsgd", "dpadam", "dpadam_corrected"], lr_span=0,
            seeds=["0"], eval_every=2)
        plan = study.make_study_plan("regime_map", **settings)
        train = study_plan.make_train_fn()
        trained = []

        def train_fn(config):
            trained.append(config)
            with mock.patch.object(
                    datasets, "load_image_dataset",
                    return_value=research_helpers.tiny_images()):
                return train(config)

        path = study.study(plan, train_fn, phase="all",
                           output_dir=output_dir, command="python -m x",
                           machine={"cpu_count": 2})
        self.assertLen(trained, 6)  # 2 cells x 3 variants x 1 rate.
        records = study_plan.collect(plan)
        self.assertLen(records, 6)
        for run, record in records.items():
            cell = plan.cell(run.cell)
            # Equal epochs (1: 4 steps of 16, 2 of 32), epsilon = 3 spent.
            self.assertEqual(record.record.steps * cell.base.batch_size, 64)
            self.assertBetween(record.record.epsilon, 3 - 1e-3, 3.0)
            if run.variant == "dpsgd":
                self.assertEmpty(record.moments)
                continue
            config = study_plan.planned_config(plan, run)
            want, t = _numpy_median_ratio(
                os.path.join(config.model_dir, "checkpoint.keras"), config)
            self.assertEqual(t, record.record.steps)
            self.assertAlmostEqual(record.moments["median_vc_over_phi"],
                                   want, delta=1e-4 * max(1, abs(want)))
            self.assertEqual("below_gamma" in record.moments,
                             run.variant == "dpadam_corrected")

        # A second call reads every run back.
        trained.clear()
        study.study(plan, train_fn, phase="all", output_dir=output_dir,
                    command="python -m x", machine={"cpu_count": 2})
        self.assertEmpty(trained)

        # The report: its tables hold the runs' numbers, its PNGs exist.
        with open(path) as f:
            page = f.read()
        for run, record in records.items():
            self.assertIn(f"| {run.cell} | {plan.variant(run.variant).label}"
                          f" | {run.learning_rate:g} | 0 |"
                          f" {100 * record.accuracy:.2f} |", page)
        bc = records[study_plan.Run("eps3_B32", "dpadam_corrected",
                                    plan.grids[("eps3_B32",
                                                "dpadam_corrected")][0], 0)]
        adam = records[study_plan.Run("eps3_B32", "dpadam", plan.grids[
            ("eps3_B32", "dpadam")][0], 0)]
        self.assertIn(f"| eps3_B32 | 32 | DP-AdamBC |"
                      f" {100 * (bc.accuracy - adam.accuracy):+.2f} ± 0.00 |",
                      page)
        total = sum(r.record.wall_seconds for r in records.values())
        self.assertIn(f"total training time {total:.0f} s", page)
        for name in ("tuning", "gap_vs_batch", "gap_vs_vc"):
            png = os.path.join(output_dir,
                               f"REGIME_MAP_fashion_mnist_{name}.png")
            self.assertGreater(os.path.getsize(png), 1000)
            self.assertIn(os.path.basename(png), page)

        # Its summary JSON, and RESULTS.md's section rendered from it.
        with open(os.path.join(output_dir,
                               "REGIME_MAP_fashion_mnist.json")) as f:
            summary = json.load(f)
        self.assertEqual((summary["runs"], summary["planned"]), (6, 6))
        self.assertLen(summary["best"], 6)
        bc_row = [r for r in summary["best"] if r["cell"] == "eps3_B32"
                  and r["variant"] == "dpadam_corrected"][0]
        self.assertEqual(bc_row["mean"], bc.accuracy)
        self.assertEqual(bc_row["median_vc_over_phi"],
                         bc.moments["median_vc_over_phi"])
        gap = [g for g in summary["gaps"] if g["cell"] == "eps3_B32"
               and g["variant"] == "dpadam_corrected"][0]
        self.assertAlmostEqual(gap["gap"], bc.accuracy - adam.accuracy)
        with open(os.path.join(output_dir, "RESULTS.md")) as f:
            index = f.read()
        self.assertIn("## Regime map: when does DP-AdamBC help?", index)
        sigma = plan.cell("eps3_B32").base.noise_multiplier
        self.assertIn(f"| 3 | 32 | {sigma:.4g} | 2 | paper | none | none |"
                      f" DP-AdamBC | {bc_row['learning_rate']:g} |"
                      f" {100 * bc.accuracy:.2f} ± 0.00 (1 seed) |", index)
        self.assertIn("(REGIME_MAP_fashion_mnist.md)", index)
        self.assertIn("(REGIME_MAP_fashion_mnist_gap_vs_batch.png)", index)

        # A folder trained with other settings is refused before training.
        other = study.make_study_plan("regime_map", augmult=2, **settings)
        with self.assertRaisesRegex(ValueError, r"other hyperparameters"
                                                r" \(augmult\)"):
            study.study(other, train_fn, phase="all", output_dir=output_dir,
                        command="python -m x", machine={})
        self.assertEmpty(trained)
        # So is one whose sigma another accountant calibrated.
        self.assertIn("| eps3_B32 | 3 | PLD | 1e-05 | 32 |", page)
        rdp = study.make_study_plan("regime_map",
                                    calibration_accountant="rdp", **settings)
        self.assertGreater(rdp.cell("eps3_B32").base.noise_multiplier,
                           sigma)
        with self.assertRaisesRegex(ValueError, r"other hyperparameters"
                                                r" \(noise_multiplier\)"):
            study.study(rdp, train_fn, phase="all", output_dir=output_dir,
                        command="python -m x", machine={})
        self.assertEmpty(trained)


class ImbalanceStudyTest(absltest.TestCase):

    def test_worst_class_reaches_the_report(self):
        # A cut training set: each run also measures every class's test
        # accuracy beside Adam's moments, and the report and its JSON show
        # the worst class's mean over seeds.
        work = tempfile.mkdtemp()
        (_, y_train), _ = research_helpers.tiny_images(num_train=200)
        num_examples = sum(imbalance.geometric_class_sizes(
            np.bincount(y_train, minlength=10), 0.25))
        plan = study.make_study_plan(
            "regime_map", num_examples=num_examples,
            runs_dir=os.path.join(work, "runs"), data=study_plan.data_spec(),
            batch_sizes=["16"], epsilons=["3"], epochs=1.0,
            variants=["dpadam_stp"], lr_span=0, seeds=["0", "1"],
            eval_every=100, imbalance_ratio=0.25)
        train = study_plan.make_train_fn()

        def train_fn(config):
            with mock.patch.object(
                    datasets, "load_image_dataset",
                    return_value=research_helpers.tiny_images(num_train=200)):
                return train(config)

        path = study.study(plan, train_fn, phase="all",
                           output_dir=os.path.join(work, "docs"),
                           command="python -m x", machine={})
        records = study_plan.collect(plan)
        self.assertLen(records, 2)
        worst = [r.worst_class_accuracy for r in records.values()]
        for record in records.values():
            self.assertIn("median_vc_over_phi", record.moments)
            self.assertBetween(record.worst_class_accuracy, 0.0,
                               record.accuracy)
        with open(path) as f:
            page = f.read()
        self.assertIn("worst class (%), mean ± std", page)
        self.assertIn(f" {100 * np.mean(worst):.2f} ±"
                      f" {100 * np.std(worst, ddof=1):.2f} |", page)
        with open(path[:-3] + ".json") as f:
            summary = json.load(f)
        self.assertAlmostEqual(summary["best"][0]["worst_class_mean"],
                               np.mean(worst))
        self.assertEqual(summary["cells"][0]["imbalance_ratio"], 0.25)


class StudyPlanSettingsTest(absltest.TestCase):

    def test_issue_37_studies(self):
        common = dict(runs_dir="/tmp/unused", data=study_plan.data_spec())
        cut = study.make_study_plan("class_imbalance", num_examples=20_000,
                                    cnn="small", imbalance_ratio=0.05,
                                    **common)
        self.assertEqual([v.name for v in cut.variants],
                         list(study.FIVE_OPTIMIZERS))
        self.assertEqual([c.name for c in cut.cells],
                         ["eps3_B256_imbalance0.05"])
        # The paper CNN's recorded cell: sigma 0.52 and RDP's 719 steps.
        paper = study.make_study_plan(
            "paper_cnn", num_examples=60_000, noise_multiplier=0.52,
            calibration_accountant="rdp", **common)
        (cell,) = paper.cells
        self.assertEqual((cell.name, cell.steps, cell.base.cnn),
                         ("eps7_B256", 719, "paper"))
        self.assertEqual(len(paper.variants), 5)

    def test_cnn_reaches_the_runs_and_the_estimate(self):
        settings = dict(num_examples=60_000, runs_dir="/tmp/unused",
                        data=study_plan.data_spec(), batch_sizes=["2048"],
                        epsilons=["3"], epochs=40.0, variants=["dpsgd"],
                        lr_span=0, seeds=["0"])
        paper = study.make_study_plan("best_recipe", **settings)
        small = study.make_study_plan("best_recipe", cnn="small", **settings)
        self.assertEqual([c.base.cnn for c in paper.cells], ["paper"])
        self.assertEqual([c.base.cnn for c in small.cells], ["small"])
        run = study_plan.tuning_runs(small)[0]
        self.assertEqual(study_plan.planned_config(small, run).cnn, "small")
        cell = small.cells[0]
        evaluations = -(-cell.steps // cell.base.eval_every) * (
            study.EVALUATION_SECONDS)
        self.assertAlmostEqual(
            study.estimate_seconds(small, 50.0) - evaluations,
            study.SMALL_CNN_COST * (study.estimate_seconds(paper, 50.0)
                                    - evaluations),
            places=6)


if __name__ == "__main__":
    absltest.main()
