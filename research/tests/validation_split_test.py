"""--validation_examples in the harness: the held-out split, the runs that
report its accuracy and train (and account) on the rest, tuning that selects
by it, and the records and pages of runs with and without it."""

import dataclasses
import json
import math
import os
import tempfile
from unittest import mock

import keras
import numpy as np
from absl.testing import absltest

from research import common
from research import comparison
from research import datasets
from research import experiments
from research import imbalance
from research import models
from research import runs
from research import study
from research import study_plan
from research import study_report
from research import train_image
from research import train_text
from research import training
from research.tests import research_helpers

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _ids(n):
    """x whose rows name their example (id i in every column), labels
    i % 10."""
    ids = np.arange(n)
    return np.stack([ids, ids], axis=1), (ids % 10).astype(np.int32)


class SplitTest(absltest.TestCase):

    def test_disjoint_complete_and_sized(self):
        x, y = _ids(100)
        (x_train, y_train), (x_val, y_val) = datasets.split_validation(
            x, y, 30)
        self.assertEqual((len(x_train), len(y_train)), (70, 70))
        self.assertEqual((len(x_val), len(y_val)), (30, 30))
        train_ids, val_ids = x_train[:, 0], x_val[:, 0]
        self.assertEmpty(set(train_ids) & set(val_ids))
        self.assertEqual(sorted(np.concatenate([train_ids, val_ids])),
                         list(range(100)))
        # x and y stay aligned; both parts keep the original order.
        np.testing.assert_array_equal(y_train, train_ids % 10)
        np.testing.assert_array_equal(y_val, val_ids % 10)
        self.assertTrue(np.all(np.diff(train_ids) > 0))
        self.assertTrue(np.all(np.diff(val_ids) > 0))
        # A random choice, not the first (or last) 30 examples.
        self.assertNotEqual(list(val_ids), list(range(30)))
        self.assertNotEqual(list(val_ids), list(range(70, 100)))

    def test_deterministic_and_independent_of_seeds(self):
        x, y = _ids(100)
        first = datasets.split_validation(x, y, 30)
        # Whatever the run's seeds set (NumPy's, TensorFlow's, Python's
        # global state), the same examples are held out.
        for seed in (1, 7):
            np.random.seed(seed)
            keras.utils.set_random_seed(seed)
            np.random.random(5)
            again = datasets.split_validation(x, y, 30)
            for got, want in zip(again, first):
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])

    def test_tuples_and_dicts_of_arrays(self):
        ids = np.arange(20)
        words = np.array([f"w{i}" for i in ids], dtype=object)
        (pairs, y_pairs), (val_pairs, _) = datasets.split_validation(
            (words, words), ids, 5)
        (tokens, _), (val_tokens, y_val) = datasets.split_validation(
            {"token_ids": ids * 2}, ids, 5)
        self.assertEqual([w[1:] for w in val_pairs[0]],
                         [str(i) for i in y_val])
        np.testing.assert_array_equal(val_pairs[0], val_pairs[1])
        np.testing.assert_array_equal(val_tokens["token_ids"], 2 * y_val)
        self.assertLen(pairs[1], 15)
        self.assertLen(tokens["token_ids"], 15)
        np.testing.assert_array_equal(tokens["token_ids"], 2 * y_pairs)

    def test_none_and_too_many(self):
        x, y = _ids(10)
        (x_all, y_all), validation = datasets.split_validation(x, y, 0)
        self.assertIs(x_all, x)
        self.assertIs(y_all, y)
        self.assertIsNone(validation)
        for n in (10, 11):
            with self.assertRaisesRegex(
                    ValueError, f"validation_examples={n} < the 10"):
                datasets.split_validation(x, y, n)
        with self.assertRaisesRegex(ValueError, "validation_examples=-1"):
            datasets.split_validation(x, y, -1)
        with self.assertRaisesRegex(training.SettingsError,
                                    "validation_examples=10"):
            training.split_validation(
                x, y, research_helpers.train_config(validation_examples=10))


class TrainingTest(absltest.TestCase):
    """A tiny model on 64 examples, 16 of them held out."""

    def _data(self, n=64):
        rng = np.random.default_rng(0)
        return (rng.normal(size=(n, 3)).astype("float32"),
                rng.integers(0, 2, size=n))

    def test_a_run_reports_validation_and_accounts_the_rest(self):
        x, y = self._data()
        train, validation = datasets.split_validation(x, y, 16)
        config = research_helpers.train_config(
            batch_size=8, physical_batch_size=None, epochs=4 * 8 / 48,
            validation_examples=16, model_dir=tempfile.mkdtemp())
        test = self._data(32)
        models_seen = []

        def train_fn(c):
            return training.fit_private(
                lambda: keras.Sequential([keras.Input((3,)),
                                          keras.layers.Dense(2)]),
                train, test, c, _LOSS, verbose=0,
                validation=validation, on_trained=models_seen.append)

        record = runs.execute(config.model_dir, config, data={},
                              train_fn=train_fn, command="c", machine={})
        metrics = runs.read_json(os.path.join(config.model_dir,
                                              runs.METRICS))
        # N = 48 (the 16 held out are not trained on): the steps, the
        # epsilon and the ledger count 48.
        self.assertEqual((metrics["num_examples"], metrics["steps"]), (48, 4))
        self.assertEqual(record.num_examples, 48)
        self.assertEqual(metrics["epsilon"], common.spent_epsilon(config, 4,
                                                                  48))
        self.assertNotEqual(metrics["epsilon"],
                            common.spent_epsilon(config, 4, 64))
        ledger = runs.read_json(os.path.join(config.model_dir, runs.LEDGER))
        self.assertEqual(ledger["settings"]["num_examples"], 48)
        # The held-out examples' metrics, measured on the trained model.
        (model,) = models_seen
        loss, accuracy = model.evaluate(*validation, verbose=0)
        self.assertAlmostEqual(metrics["validation_accuracy"], accuracy,
                               places=6)
        self.assertAlmostEqual(metrics["validation_loss"], loss, places=5)
        self.assertEqual(record.validation_accuracy,
                         metrics["validation_accuracy"])
        self.assertEqual(record.accuracy, metrics["test_accuracy"])
        self.assertEqual(metrics["config"]["validation_examples"], 16)
        # The curve is the test set's.
        self.assertAlmostEqual(metrics["history"][-1]["val_accuracy"],
                               metrics["test_accuracy"], places=6)

    def test_the_split_must_match_the_config(self):
        x, y = self._data()
        train, validation = datasets.split_validation(x, y, 16)

        def model_fn():
            return keras.Sequential([keras.Input((3,)),
                                     keras.layers.Dense(2)])

        for config, given in (
                (research_helpers.train_config(validation_examples=16),
                 None),
                (research_helpers.train_config(validation_examples=8),
                 validation),
                (research_helpers.train_config(), validation)):
            with self.assertRaisesRegex(training.SettingsError,
                                        "--validation_examples="):
                training.fit_private(model_fn, train, train, config, _LOSS,
                                     validation=given)

    def test_no_split_records_as_before(self):
        x, y = self._data()
        config = research_helpers.train_config(
            batch_size=8, physical_batch_size=None, epochs=2 * 8 / 64)
        results = training.fit_private(
            lambda: keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(2)]),
            (x, y), (x, y), config, _LOSS, verbose=0, validate=False)
        self.assertEqual(results["num_examples"], 64)
        self.assertNotIn("validation_accuracy", results)
        self.assertNotIn("validation_loss", results)
        self.assertNotIn("validation_examples", results["config"])


class BinariesTest(absltest.TestCase):

    def test_image_split_after_the_cap_and_the_cut_whatever_the_seed(self):
        images = research_helpers.tiny_images(num_train=200)
        (x_all, y_all), _ = images
        seen = []

        def fake_fit(model_fn, train, test, config, loss, **kwargs):
            seen.append((train, kwargs["validation"]))
            return {}

        for seed in (0, 5):
            config = research_helpers.train_config(
                seed=seed, validation_examples=20, imbalance_ratio=0.5,
                epochs=1.0)
            with mock.patch.object(datasets, "load_image_dataset",
                                   return_value=images), \
                    mock.patch.object(training, "fit_private", fake_fit):
                train_image.run("fashion_mnist", None, config,
                                max_examples=150)
        # The examples the run would train on without the split: the
        # first 150, cut to the imbalance (seed 0, as every run).
        x_cut, y_cut = imbalance.imbalanced_subset(x_all[:150], y_all[:150],
                                                   0.5)
        for (x_train, y_train), (x_val, y_val) in seen:
            self.assertLen(y_val, 20)
            self.assertLen(y_train, len(y_cut) - 20)
            rows = {x.tobytes() for x in x_cut}
            self.assertTrue(all(x.tobytes() in rows for x in x_val))
            self.assertTrue(all(x.tobytes() in rows for x in x_train))
            self.assertEmpty({x.tobytes() for x in x_train}
                             & {x.tobytes() for x in x_val})
        # The same images held out for both seeds.
        np.testing.assert_array_equal(seen[0][1][0], seen[1][1][0])
        np.testing.assert_array_equal(seen[0][0][1], seen[1][0][1])

    def test_image_run_records_validation_accuracy(self):
        config = research_helpers.train_config(
            epochs=2 * 16 / 48, validation_examples=16)
        with mock.patch.object(datasets, "load_image_dataset",
                               return_value=research_helpers.tiny_images()):
            results = train_image.run("fashion_mnist", None, config)
        self.assertEqual((results["num_examples"], results["steps"]),
                         (48, 2))
        self.assertBetween(results["validation_accuracy"], 0.0, 1.0)
        self.assertEqual(results["epsilon"],
                         common.spent_epsilon(config, 2, 48))

    def test_random_access_data_is_refused(self):
        config = research_helpers.train_config(validation_examples=4)
        with self.assertRaisesRegex(training.SettingsError,
                                    "--validation_examples needs in-memory"):
            train_image.run(None, tempfile.mkdtemp(), config,
                            data_source="anything")
        with self.assertRaisesRegex(training.SettingsError,
                                    "--validation_examples needs in-memory"):
            train_text.run(None, tempfile.mkdtemp(), None, 16, config,
                           backbone=models.make_tiny_bert(sequence_length=16),
                           data_source="anything")

    def test_text_split_reaches_the_cached_features(self):
        # The held-out sentences are tokenized and run through the frozen
        # part like the others; the training itself is TrainingTest's.
        folder = research_helpers.write_sst2_tsv()
        backbone = models.make_tiny_bert(sequence_length=16)
        seen = []

        def fake_fit(model_fn, train, test, config, loss, **kwargs):
            seen.append((train, kwargs["validation"]))
            return {}

        config = research_helpers.train_config(validation_examples=8)
        with mock.patch.object(training, "fit_private", fake_fit):
            train_text.run("sst2_tsv", folder, None, 16, config,
                           backbone=backbone, feature_cache={})
        ((x_train, y_train), (x_val, y_val)), = seen
        self.assertEqual((len(y_train), len(y_val)), (40, 8))
        # The frozen part's outputs (token states), as the training
        # sentences', not token ids.
        self.assertEqual(sorted(x_val), sorted(x_train))
        self.assertNotIn("token_ids", x_val)
        for name, values in x_val.items():
            self.assertEqual(values.shape, (8, *x_train[name].shape[1:]))
        self.assertIn(np.float32, [v.dtype for v in x_val.values()])
        # The labels of the sentences the split holds out.
        (_, y_all), _ = datasets.load_text_dataset("sst2_tsv", folder)[0]
        _, (_, want) = datasets.split_validation(np.arange(48), y_all, 8)
        np.testing.assert_array_equal(y_val, want)


def _cells(validation_examples=0, batch_sizes=(16,)):
    return [study_plan.make_cell(target_epsilon=3.0, batch_size=b,
                                 num_examples=64, noise_multiplier=2.0,
                                 eval_every=2,
                                 validation_examples=validation_examples)
            for b in batch_sizes]


def _plan(runs_dir, validation_examples=0, edge_extensions=0):
    variants = study_plan.default_variants()
    return study_plan.make_plan(
        "paper_cnn", cells=_cells(validation_examples),
        variants=[variants["dpadam"]], seeds=(0,), runs_dir=runs_dir,
        data=study_plan.data_spec(64), edge_extensions=edge_extensions)


class SelectionTest(absltest.TestCase):
    """Test and validation accuracy disagree: the test set peaks at the
    grid's lowest rate, the validation split at its highest."""

    @staticmethod
    def _test_accuracy(config):
        return 0.9 - 10 * config.learning_rate

    @staticmethod
    def _validation_accuracy(config):
        return 0.5 + 10 * config.learning_rate

    def test_study_selects_by_validation(self):
        plan = _plan(tempfile.mkdtemp(), validation_examples=16,
                     edge_extensions=1)
        (key,) = plan.grids
        grid = plan.grids[key]
        self.assertEqual(plan.cells[0].base.validation_examples, 16)
        records = study_plan.execute(
            plan, study_plan.tuning_runs(plan),
            research_helpers.fake_train_fn(
                self._test_accuracy, validation=self._validation_accuracy),
            command="c", machine={})
        self.assertEqual(study_plan.best_learning_rates(plan, records),
                         {key: max(grid)})
        # The edge extension follows the validation split: above the grid.
        self.assertEqual(study_plan.next_edge_rate(plan, records, key),
                         study_plan.half_decade_step(max(grid), 1))
        # The report's best (and its test accuracy) is that rate's.
        summary = study_report.best_summaries(plan, records)[key]
        self.assertEqual(summary["lr"], max(grid))
        self.assertAlmostEqual(summary["mean"],
                               0.9 - 10 * max(grid))

    def test_study_without_validation_selects_by_test_as_before(self):
        plan = _plan(tempfile.mkdtemp(), edge_extensions=1)
        (key,) = plan.grids
        grid = plan.grids[key]
        records = study_plan.execute(
            plan, study_plan.tuning_runs(plan),
            research_helpers.fake_train_fn(self._test_accuracy),
            command="c", machine={})
        self.assertTrue(all(r.validation_accuracy is None
                            for r in records.values()))
        self.assertEqual(study_plan.best_learning_rates(plan, records),
                         {key: min(grid)})
        self.assertEqual(study_plan.next_edge_rate(plan, records, key),
                         study_plan.half_decade_step(min(grid), -1))

    def test_mixed_records_raise(self):
        plan = _plan(tempfile.mkdtemp(), validation_examples=16)
        (key,) = plan.grids
        grid = plan.grids[key]
        records = study_plan.execute(
            plan, study_plan.tuning_runs(plan),
            research_helpers.fake_train_fn(
                self._test_accuracy,
                validation=lambda c: (None if c.learning_rate == max(grid)
                                      else 0.5)),
            command="c", machine={})
        with self.assertRaisesRegex(
                ValueError, "eps3_B16 / dpadam mix 2 with a validation"
                            " accuracy and 1 without"):
            study_plan.best_learning_rates(plan, records)

    def test_reproduce_uses_the_same_rule(self):
        plan = research_helpers.recorded_plan(tempfile.mkdtemp())
        plan = dataclasses.replace(plan, base=dataclasses.replace(
            plan.base, validation_examples=16))
        pairs = [(s, plan.tune_seed) for grid in plan.grids.values()
                 for s in grid]
        experiments.execute_runs(
            plan, pairs, research_helpers.fake_train_fn(
                self._test_accuracy, validation=self._validation_accuracy),
            "c", {})
        records = experiments.collect(plan)
        best = experiments.best_of_tuning(plan, records)
        for name, grid in plan.grids.items():
            self.assertEqual(best[name].learning_rate,
                             max(s.learning_rate for s in grid))
        # Without validation accuracies, the test set's best, as before.
        plain = research_helpers.recorded_plan(tempfile.mkdtemp())
        experiments.execute_runs(
            plain, pairs, research_helpers.fake_train_fn(self._test_accuracy),
            "c", {})
        best = experiments.best_of_tuning(plain, experiments.collect(plain))
        for name, grid in plain.grids.items():
            self.assertEqual(best[name].learning_rate,
                             min(s.learning_rate for s in grid))

    def test_reproduce_refuses_mixed_records(self):
        plan = research_helpers.recorded_plan(tempfile.mkdtemp())
        pairs = [(s, plan.tune_seed) for grid in plan.grids.values()
                 for s in grid]
        experiments.execute_runs(
            plan, pairs, research_helpers.fake_train_fn(
                self._test_accuracy,
                validation=lambda c: (0.5 if c.optimizer == "dpsgd"
                                      and c.learning_rate == 1.0 else None)),
            "c", {})
        with self.assertRaisesRegex(ValueError, "dpsgd mix 1 with"):
            experiments.best_of_tuning(plan, experiments.collect(plan))

    def test_the_shared_rule(self):
        # Validation where every record has it (a NaN loses), else test.
        found = {0.1: _Scored(0.2, math.nan), 0.3: _Scored(0.1, 0.4),
                 1.0: _Scored(0.9, 0.3)}
        key = ("cell", "variant")
        self.assertEqual(study_plan._best_rate(found, key), 0.3)  # pylint: disable=protected-access
        self.assertEqual(comparison.selection_accuracies(
            [found[1.0], found[0.3]], "g"), [0.3, 0.4])
        plain = {lr: _Scored(r.accuracy, None) for lr, r in found.items()}
        self.assertEqual(study_plan._best_rate(plain, key), 1.0)  # pylint: disable=protected-access
        with self.assertRaisesRegex(ValueError, "g mix 1 with a validation"
                                                " accuracy and 1 without"):
            comparison.selection_accuracies([found[0.3], plain[0.3]], "g")


@dataclasses.dataclass(frozen=True)
class _Scored:
    """What tuning reads of a record."""

    accuracy: float
    validation_accuracy: float | None


class AccountingTest(absltest.TestCase):

    def test_cells_calibrate_for_the_examples_trained_on(self):
        # Epochs: sigma spends epsilon = 3 in round(epochs (N - V) / B)
        # steps over N - V = 5,000 of 6,000 examples.
        cell = study_plan.make_cell(target_epsilon=3.0, batch_size=128,
                                    num_examples=6000, epochs=1.0,
                                    validation_examples=1000)
        self.assertEqual(cell.num_examples, 5000)
        self.assertEqual(cell.name, "eps3_B128")
        self.assertEqual(cell.steps, round(5000 / 128))
        self.assertEqual(cell.base.validation_examples, 1000)
        spent = common.steps_epsilon(
            steps=cell.steps, num_examples=5000, batch_size=128,
            noise_multiplier=cell.base.noise_multiplier, delta=1e-5)
        self.assertBetween(spent, 3.0 - study_plan.EPSILON_TOLERANCE, 3.0)
        # Over all 6,000 the same sigma would spend less: not calibrated
        # for them.
        self.assertLess(common.steps_epsilon(
            steps=cell.steps, num_examples=6000, batch_size=128,
            noise_multiplier=cell.base.noise_multiplier, delta=1e-5),
            3.0 - study_plan.EPSILON_TOLERANCE)
        # The runs' own step count (`training.poisson_plan`) over the
        # examples they train on is the cell's.
        self.assertEqual(common.total_steps(cell.base, 5000), cell.steps)
        # A fixed sigma: the steps calibrated over N - V.
        fixed = study_plan.make_cell(target_epsilon=3.0, batch_size=128,
                                     num_examples=6000,
                                     noise_multiplier=1.0,
                                     validation_examples=1000)
        self.assertEqual(fixed.steps, common.total_steps(fixed.base, 5000))
        self.assertNotEqual(fixed.steps,
                            common.total_steps(fixed.base, 6000))
        with self.assertRaisesRegex(ValueError, "validation_examples=64 <"):
            study_plan.make_cell(target_epsilon=3.0, batch_size=16,
                                 num_examples=64, noise_multiplier=2.0,
                                 validation_examples=64)

    def test_study_plan_passes_the_split_to_every_run(self):
        plan = study.make_study_plan(
            "paper_cnn", num_examples=6000, runs_dir="/tmp/unused",
            data=study_plan.data_spec(), epsilons=["8"], batch_sizes=["128"],
            noise_multiplier=1.0, variants=["dpsgd"],
            validation_examples=1000)
        (cell,) = plan.cells
        self.assertEqual(cell.num_examples, 5000)
        run = study_plan.tuning_runs(plan)[0]
        self.assertEqual(
            study_plan.planned_config(plan, run).validation_examples, 1000)
        self.assertIn("N=5000 (validation: 1000 held out)",
                      study.describe(plan, 50.0))


class RecordsTest(absltest.TestCase):

    def test_omitted_at_zero_and_read_back_as_zero(self):
        plain = research_helpers.train_config(model_dir="x")
        held = dataclasses.replace(plain, validation_examples=16)
        self.assertNotIn("validation_examples", common.config_record(plain))
        self.assertNotIn("validation_examples",
                         runs.comparable_config(plain))
        self.assertEqual(common.config_record(held)["validation_examples"],
                         16)
        folder = tempfile.mkdtemp()
        # A run recorded before the field reads back as V = 0 ...
        runs.write_json(os.path.join(folder, runs.SIDECAR),
                        {"config": runs.comparable_config(plain),
                         "data": {}})
        runs.check_run_dir(folder, plain, {})
        # ... and is not a run with a validation split.
        with self.assertRaisesRegex(ValueError,
                                    r"\(validation_examples\)"):
            runs.check_run_dir(folder, held, {})
        # Its metrics without the field read back without a validation
        # accuracy.
        runs.write_json(os.path.join(folder, runs.SIDECAR),
                        {"config": runs.comparable_config(plain),
                         "data": {}, "status": "done"})
        runs.write_json(os.path.join(folder, runs.METRICS), {
            "config": runs.comparable_config(plain), "steps": 4,
            "planned_steps": 4, "test_accuracy": 0.5, "epsilon": 1.0,
            "num_examples": 64})
        record = runs.load_record(folder, plain, {})
        self.assertIsNone(record.validation_accuracy)
        self.assertEqual(record.accuracy, 0.5)
        with self.assertRaisesRegex(ValueError, "validation_examples=-1"):
            common.check_validation_examples("validation_examples", -1)


class ReportTest(absltest.TestCase):

    def _page(self, validation_examples):
        work = tempfile.mkdtemp()
        plan = _plan(os.path.join(work, "runs"),
                     validation_examples=validation_examples)
        validation = (SelectionTest._validation_accuracy
                      if validation_examples else None)
        records = study_plan.run_phase(
            plan, research_helpers.fake_train_fn(
                SelectionTest._test_accuracy, validation=validation),
            "tune", command="c", machine={})
        path = study_report.write_report(plan, records,
                                         os.path.join(work, "docs"), "c", {})
        with open(path) as f:
            page = f.read()
        with open(path[:-3] + ".json") as f:
            self.summary = json.load(f)
        return plan, records, page

    def test_a_study_with_validation_says_so(self):
        plan, records, page = self._page(16)
        self.assertIn(
            "Learning rates were chosen by accuracy on a validation split"
            " of 16 training images held out from training (48 trained"
            " on)", page)
        self.assertIn("accuracies reported on this page are on the test"
                      " set", page)
        (key,) = plan.grids
        best = max(plan.grids[key])
        for run, r in records.items():
            self.assertIn(
                f"| {run.cell} | DP-Adam | {run.learning_rate:g} |"
                f" {100 * r.validation_accuracy:.2f} |"
                f" {100 * r.accuracy:.2f} |"
                f" {'✓' if run.learning_rate == best else ''} |", page)
        self.assertIn("| validation V (held out of training) |", page)
        # RESULTS.md's section says how its rates were chosen.
        (cell,) = self.summary["cells"]
        self.assertEqual((cell["validation_examples"], cell["num_examples"]),
                         (16, 48))
        self.assertIn("the best learning rate of each optimizer (chosen by"
                      " accuracy on a validation split of 16 training images"
                      " held out from training), test accuracy",
                      "\n".join(study_report.render_summary(self.summary)))

    def test_a_study_without_validation_is_unchanged(self):
        _, _, page = self._page(0)
        self.assertNotIn("validation", page.lower())
        self.assertNotIn("chosen", page)
        self.assertNotIn("validation_examples", self.summary["cells"][0])
        self.assertIn("the best learning rate of each optimizer, test"
                      " accuracy", "\n".join(
                          study_report.render_summary(self.summary)))


if __name__ == "__main__":
    absltest.main()
