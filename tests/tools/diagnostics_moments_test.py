"""src/tf_dpadam/tools/diagnostics/moments.py: the math, on hand-computed values."""

import numpy as np
from absl.testing import absltest

from tf_dpadam.tools import diagnostics
from tf_dpadam.privatizer import dp_math
from tf_dpadam.tools.diagnostics import moments

import helpers


class SummaryStatisticsTest(absltest.TestCase):

    def test_hand_computed_and_numpy(self):
        values = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], "float32")
        stats = moments.summary_statistics(values)
        # Sorted: 1 1 2 3 4 5 6 9. Linear quartiles at positions 1.75, 3.5
        # and 5.25: 1 + 0.75 * (2 - 1), (3 + 4) / 2, 5 + 0.25 * (6 - 5).
        self.assertEqual(stats, {"min": 1.0, "25%": 1.75, "median": 3.5,
                                 "75%": 5.25, "max": 9.0, "mean": 3.875})
        rng = np.random.default_rng(0)
        values = rng.lognormal(size=1001)
        stats = moments.summary_statistics(values)
        np.testing.assert_allclose(
            [stats[c] for c in moments.SUMMARY_COLUMNS],
            [values.min(), *np.percentile(values, [25, 50, 75]),
             values.max(), values.mean()],
            rtol=1e-12,
        )
        with self.assertRaisesRegex(ValueError, "at least one"):
            moments.summary_statistics([])


class AdamMathTest(absltest.TestCase):

    def test_adam_moments_and_bias_correction_in_lockstep(self):
        beta_1, beta_2 = 0.9, 0.999
        gradients = [np.array([1.0, -2.0]), np.array([0.5, 0.0]),
                     np.array([-1.0, 4.0])]
        m = v = np.zeros(2)
        ref_m = ref_v = np.zeros(2)
        for t, g in enumerate(gradients, start=1):
            m, v = moments.adam_moments(m, v, g, beta_1, beta_2)
            ref_m = beta_1 * ref_m + (1 - beta_1) * g
            ref_v = beta_2 * ref_v + (1 - beta_2) * g * g
            m_hat, v_hat = moments.bias_correct(m, v, beta_1, beta_2, t)
            np.testing.assert_allclose(m_hat, ref_m / (1 - beta_1**t))
            np.testing.assert_allclose(v_hat, ref_v / (1 - beta_2**t))
        # After one step the corrected moments are g and g^2 themselves.
        m, v = moments.adam_moments(np.zeros(2), np.zeros(2), gradients[0],
                                    beta_1, beta_2)
        m_hat, v_hat = moments.bias_correct(m, v, beta_1, beta_2, 1)
        np.testing.assert_allclose(m_hat, gradients[0])
        np.testing.assert_allclose(v_hat, gradients[0] ** 2)

    def test_second_moment_noise_std(self):
        # One step: v^p - v^c = 2 g z / B + (z / B)^2, noise part std
        # sqrt(2) Phi; many steps: sqrt(2 (1 - b2) / (1 + b2)) Phi.
        self.assertAlmostEqual(
            moments.second_moment_noise_std(2.0, 0.999, 1), 2 * 2**0.5
        )
        self.assertAlmostEqual(
            moments.second_moment_noise_std(1.0, 0.999, 10**6),
            (2 * 0.001 / 1.999) ** 0.5,
        )
        # Against the sum of the squared EMA weights itself.
        beta, t = 0.9, 7
        weights = [(1 - beta) * beta ** (t - s) / (1 - beta**t)
                   for s in range(1, t + 1)]
        self.assertAlmostEqual(sum(weights), 1.0)
        self.assertAlmostEqual(
            moments.second_moment_noise_std(3.0, beta, t),
            3.0 * (2 * sum(w * w for w in weights)) ** 0.5,
        )

    def test_directions(self):
        # 0 / sqrt(0) is 0, not nan (a coordinate that never had a gradient).
        np.testing.assert_array_equal(
            moments.adam_direction([2.0, 0.0, -3.0], [4.0, 0.0, 9.0]),
            [1.0, 0.0, -1.0],
        )
        # v - Phi = 3.5 for the first; 0.2 - 0.5 < gamma' = 0.25 is floored.
        corrected = moments.corrected_direction([7.0, 1.0], [4.0, 0.2], 0.5,
                                                0.25)
        self.assertIsInstance(corrected, np.ndarray)
        self.assertEqual(corrected.dtype, np.float64)
        np.testing.assert_allclose(corrected, [7.0 / np.sqrt(3.5), 1.0 / 0.5])

    def test_corrected_direction_is_the_optimizers_formula_in_float64(self):
        # The same values as the NumPy expression, bit for bit, on inputs
        # where float32 would round differently (v - Phi near 1e-12).
        rng = np.random.default_rng(1)
        m_hat = rng.normal(size=1000) * 1e-3
        v_hat = np.abs(rng.normal(size=1000)) * 1e-6
        phi, gamma = 4e-7, dp_math.DEFAULT_GAMMA_OVER_PHI * 4e-7
        np.testing.assert_array_equal(
            moments.corrected_direction(m_hat, v_hat, phi, gamma),
            m_hat / np.sqrt(np.maximum(v_hat - phi, gamma)),
        )


class SnapshotSummaryTest(absltest.TestCase):

    def test_moment_summary_of_a_hand_made_snapshot(self):
        summary = moments.moment_summary(helpers.hand_made_snapshot())
        self.assertEqual(list(summary), list(diagnostics.SUMMARY_ROWS))
        v = np.array([1.0, 4.0, 9.0, 16.0])
        expected = {
            "v_clean": v,
            "v_private": v + 0.5,
            "v_private_minus_phi": v,
            "abs_m_clean": np.sqrt(v),
            "abs_m_private": np.sqrt(v),
            "abs_update_clean": np.ones(4),
            "abs_update_private": np.sqrt(v / (v + 0.5)),
            "abs_update_corrected": np.ones(4),
        }
        for name, values in expected.items():
            for column in moments.SUMMARY_COLUMNS:
                np.testing.assert_allclose(
                    summary[name][column],
                    moments.summary_statistics(values)[column],
                    rtol=1e-12, err_msg=f"{name} {column}",
                )

    def test_moment_comparison_of_a_hand_made_snapshot(self):
        comparison = moments.moment_comparison(helpers.hand_made_snapshot())
        self.assertEqual(list(comparison), list(diagnostics.COMPARISON_ROWS))
        v = np.array([1.0, 4.0, 9.0, 16.0])
        self.assertAlmostEqual(comparison["median_v_clean_over_phi"], 13.0)
        self.assertAlmostEqual(comparison["median_v_private_over_phi"], 14.0)
        self.assertAlmostEqual(comparison["bias_over_phi"], 1.0)
        self.assertAlmostEqual(comparison["std_over_phi"], 0.0)
        # sqrt(2 * 0.001 * (1 + b^3) / (1.999 * (1 - b^3))), b = 0.999.
        self.assertAlmostEqual(comparison["noise_std_over_phi"],
                               0.81650, places=4)
        self.assertEqual(comparison["floored_fraction"], 0.0)
        self.assertAlmostEqual(comparison["median_log10_error_corrected"], 0.0)
        self.assertAlmostEqual(
            comparison["median_log10_error_private"],
            np.median(np.log10((v + 0.5) / v)),
        )
        self.assertAlmostEqual(comparison["cosine_corrected"], 1.0)
        self.assertAlmostEqual(comparison["norm_ratio_corrected"], 1.0)
        # Same signs, shrunk unevenly: cosine just below 1, norm below 1.
        self.assertLess(comparison["cosine_private"], 1.0)
        self.assertGreater(comparison["cosine_private"], 0.99)
        self.assertLess(comparison["norm_ratio_private"], 1.0)

    def test_without_noise_ratios_to_phi_are_nan(self):
        s = helpers.hand_made_snapshot()
        noiseless = moments.MomentSnapshot(
            step=1, phi=0.0, gamma=1e-14, noise_phi=0.0, beta_1=0.9,
            beta_2=0.999, m_clean=s.m_clean, v_clean=s.v_clean,
            m_private=s.m_clean.copy(), v_private=s.v_clean.copy(),
        )
        comparison = moments.moment_comparison(noiseless)
        for name in ("median_v_clean_over_phi", "median_v_private_over_phi",
                     "bias_over_phi", "std_over_phi", "noise_std_over_phi"):
            self.assertTrue(np.isnan(comparison[name]), msg=name)
        self.assertAlmostEqual(comparison["cosine_private"], 1.0)


if __name__ == "__main__":
    absltest.main()
