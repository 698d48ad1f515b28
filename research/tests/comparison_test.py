"""research/comparison.py: seed statistics and the verdict, by hand."""

import math

import numpy as np
from absl.testing import absltest

from research import comparison
from research import experiments
from research.runs import Setting


class ComparisonTest(absltest.TestCase):

    def test_aggregate_seeds(self):
        # Mean 0.6; sample std sqrt((0.01 + 0 + 0.01) / 2) = 0.1.
        mean, std, n = comparison.aggregate_seeds([0.5, 0.7, 0.6])
        self.assertAlmostEqual(mean, 0.6)
        self.assertAlmostEqual(std, 0.1)
        self.assertEqual(n, 3)
        self.assertEqual(comparison.aggregate_seeds([0.8]), (0.8, 0.0, 1))
        mean, _, n = comparison.aggregate_seeds([])
        self.assertTrue(math.isnan(mean))
        self.assertEqual(n, 0)

    def test_aggregate_curves_on_the_common_steps(self):
        steps, mean, std = comparison.aggregate_curves([
            [(2, 0.2), (4, 0.4), (6, 0.6)],
            [(2, 0.4), (4, 0.6)],  # Seed without the last evaluation.
        ])
        np.testing.assert_array_equal(steps, [2, 4])
        np.testing.assert_allclose(mean, [0.3, 0.5])
        np.testing.assert_allclose(std, [0.1 * math.sqrt(2)] * 2)
        _, _, std = comparison.aggregate_curves([[(1, 0.5)]])
        np.testing.assert_array_equal(std, [0.0])

    def test_at_grid_edge(self):
        grid = experiments.make_grid("dpsgd", (0.1, 1.0, 10.0))
        self.assertEqual(
            [comparison.at_grid_edge(s, grid) for s in grid],
            [True, False, True])
        one = experiments.make_grid("dpsgd", (1.0,))
        self.assertFalse(comparison.at_grid_edge(Setting("dpsgd", 1.0, None),
                                                 one))

    def test_compare_and_verdict(self):
        # Gap 0.05 > spread 0.01 + 0.02: beyond the seed spread.
        self.assertEqual(
            comparison.compare((0.80, 0.01, 3), (0.75, 0.02, 3))[2], "better")
        # Gap 0.02 <= 0.01 + 0.02: within.
        self.assertEqual(
            comparison.compare((0.77, 0.01, 3), (0.75, 0.02, 3))[2], "within")
        self.assertEqual(
            comparison.compare((0.70, 0.01, 3), (0.75, 0.02, 3))[2], "worse")
        self.assertEqual(
            comparison.compare((0.80, 0.0, 1), (0.75, 0.0, 1))[2], "unknown")
        paper = comparison.PAPER_RESULTS["CIFAR-10"]
        text = comparison.verdict_paragraph(
            {"dpsgd": (0.79, 0.01, 3), "dpadam": (0.75, 0.01, 3),
             "dpadam_corrected": (0.80, 0.01, 3)},
            paper, "CIFAR-10", "Fashion-MNIST")
        self.assertIn("DP-AdamBC beats DP-Adam by more than the seed spread",
                      text)
        self.assertIn("within the seed spread", text)  # 0.80 vs 0.79.
        self.assertIn("3.92 points", text)  # The paper's 60.27 - 56.35.
        self.assertIn("Not enough", comparison.verdict_paragraph(
            {"dpsgd": (0.79, 0.01, 3)}, paper, "CIFAR-10", "Fashion-MNIST"))

    def test_compare_sentence(self):
        summary = {"dpadam_stp": (0.70, 0.01, 3), "dpadam": (0.75, 0.02, 3),
                   "dpadam_disk": (0.80, 0.0, 1)}
        text = comparison.compare_sentence(summary, "dpadam_stp", "dpadam")
        self.assertIn("70.00% against 75.00%", text)
        self.assertIn("a gap of -5.00 points, seed spread 3.00 points", text)
        self.assertIn("loses to DP-Adam by more than the seed spread", text)
        self.assertIn("says little", comparison.compare_sentence(
            summary, "dpadam_disk", "dpadam"))
        self.assertIn("Not enough finished runs to compare DP-SGD",
                      comparison.compare_sentence(summary, "dpsgd", "dpadam"))


if __name__ == "__main__":
    absltest.main()
