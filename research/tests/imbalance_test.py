"""research/imbalance.py: the geometric class sizes and per-class accuracy."""

import dataclasses

import keras
import numpy as np
import pytest
from absl.testing import absltest

from research import common
from research import datasets
from research import imbalance
from research import study_moments
from research import train_image


class ClassSizesTest(absltest.TestCase):

    def test_geometric(self):
        sizes = imbalance.geometric_class_sizes([6000] * 10, 0.01)
        self.assertEqual(sizes[0], 6000)
        self.assertEqual(sizes[-1], 60)
        # Class c keeps 6000 * 0.01^(c/9), floored: each 0.599 of the one
        # before.
        for c, size in enumerate(sizes):
            self.assertEqual(size, int(6000 * 0.01 ** (c / 9)))
        self.assertEqual(sizes[:3], [6000, 3596, 2156])
        self.assertEqual(imbalance.geometric_class_sizes([5, 7], 1.0),
                         [5, 7])
        self.assertEqual(imbalance.geometric_class_sizes([10, 10], 1e-6),
                         [10, 1])

    def test_bad_arguments(self):
        for ratio in (0.0, 1.5, -0.1):
            with self.assertRaisesRegex(ValueError, "ratio"):
                imbalance.geometric_class_sizes([3, 3], ratio)
            with self.assertRaisesRegex(ValueError, "--imbalance_ratio"):
                imbalance.check_ratio_flag("imbalance_ratio", ratio)
        imbalance.check_ratio_flag("imbalance_ratio", 1.0)
        with self.assertRaisesRegex(ValueError, "2 classes"):
            imbalance.geometric_class_sizes([3], 0.5)

    def test_subset(self):
        y = np.repeat(np.arange(4), 100)
        np.random.default_rng(0).shuffle(y)
        x = np.arange(400) * 10
        xs, ys = imbalance.imbalanced_subset(x, y, 0.1, seed=3)
        self.assertEqual(np.bincount(ys).tolist(),
                         imbalance.geometric_class_sizes([100] * 4, 0.1))
        # Rows stay together and in their order.
        np.testing.assert_array_equal(y[xs // 10], ys)
        self.assertTrue(np.all(np.diff(xs) > 0))
        again = imbalance.imbalanced_subset(x, y, 0.1, seed=3)
        np.testing.assert_array_equal(again[0], xs)


class AccuracyTest(absltest.TestCase):

    def test_class_accuracies(self):
        labels = [0, 0, 1, 1, 1, 2]
        predicted = [0, 1, 1, 1, 0, 0]
        got = imbalance.class_accuracies(labels, predicted, 4)
        np.testing.assert_allclose(got[:3], [0.5, 2 / 3, 0.0])
        self.assertTrue(np.isnan(got[3]))

    def test_per_class_measure(self):
        # A fixed linear model: class = argmax of the first 3 features.
        model = keras.Sequential([keras.Input((3,)),
                                  keras.layers.Dense(3, use_bias=False)])
        model.set_weights([np.eye(3, dtype="float32")])
        x = np.eye(3, dtype="float32")[[0, 1, 2, 2, 1]]
        y = np.array([0, 1, 2, 0, 1])
        measured = imbalance.per_class_measure(x, y)(model)
        np.testing.assert_allclose(measured["class_accuracies"],
                                   [0.5, 1.0, 1.0])
        self.assertAlmostEqual(measured["mean_class_accuracy"], 2.5 / 3)
        self.assertEqual(measured["worst_class_accuracy"], 0.5)

    def test_combine_measures(self):
        both = imbalance.combine_measures(lambda m: {"a": m}, None,
                                          lambda m: {"b": 2 * m})
        self.assertEqual(both(3), {"a": 3, "b": 6})
        twice = imbalance.combine_measures(lambda m: {"a": 1},
                                           lambda m: {"a": 2})
        with self.assertRaisesRegex(ValueError, "Measured twice.*'a'"):
            twice(0)


class TrainImageTest(absltest.TestCase):

    @pytest.mark.slow
    def test_an_imbalanced_run_reports_each_class(self):
        try:
            datasets.fashion_mnist_files()
        except datasets.DatasetUnavailableError as error:
            self.skipTest(str(error))
        config = dataclasses.replace(
            common.base_config("fashion_mnist", epochs=1.0, batch_size=64),
            optimizer="dpadam_stp", learning_rate=1e-3, epsilon=1e-8,
            cnn="small", imbalance_ratio=0.1, eval_every=1000)
        results = train_image.run("fashion_mnist", None, config,
                                  max_examples=1000, max_test_examples=500,
                                  max_steps=2, verbose=0,
                                  measure=study_moments.final_moments)
        # The study's own measure (Adam's moments) is kept beside the
        # classes'.
        self.assertIn("median_vc_over_phi", results["final_moments"])
        counts = np.bincount(
            datasets.load_image_dataset("fashion_mnist")[0][1][:1000],
            minlength=10)
        self.assertEqual(results["num_examples"],
                         sum(imbalance.geometric_class_sizes(counts, 0.1)))
        self.assertLen(results["class_accuracies"], 10)
        self.assertEqual(results["worst_class_accuracy"],
                         min(results["class_accuracies"]))
        self.assertEqual(results["config"]["imbalance_ratio"], 0.1)


if __name__ == "__main__":
    absltest.main()
