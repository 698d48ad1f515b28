"""Tests of tf_dpadam.accounting.passes: epsilon without amplification (fixed batches)."""

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting

from tf_dpadam import accounting

DELTA = 1e-5


class WithoutAmplificationTest(parameterized.TestCase):
    """Shuffled fixed batches: each pass one Gaussian mechanism, composed."""

    def _gaussian_epsilon(self, passes, orders, sigma=1.0, delta=1e-5):
        accountant = dp_accounting.rdp.RdpAccountant(list(orders))
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(sigma), passes))
        return accountant.get_epsilon(delta)

    def test_the_issues_example(self):
        # N = 80, B = 8, sigma = 1, 3 epochs: 30 steps, 3 passes.
        eps, _ = accounting.compute_dp_sgd_privacy(
            80, 8, 1.0, 3, 1e-5, sampling="shuffled")
        self.assertAlmostEqual(eps, self._gaussian_epsilon(
            3, accounting.TF_PRIVACY_RDP_ORDERS), places=9)
        poisson, _ = accounting.compute_dp_sgd_privacy(80, 8, 1.0, 3, 1e-5)
        self.assertAlmostEqual(poisson, 4.848, places=3)
        self.assertAlmostEqual(eps, 9.018, places=3)
        # PLD: the Gaussian mechanism of multiplier 1 / sqrt(3), 8.39.
        pld = accounting.epsilon_without_amplification(
            steps=30, noise_multiplier=1.0, delta=1e-5, batches_per_pass=10,
            accountant="pld")
        self.assertAlmostEqual(pld, 8.385, places=3)

    def test_a_begun_pass_counts_whole(self):
        for steps, passes in ((1, 1), (10, 1), (11, 2), (20, 2), (21, 3)):
            self.assertAlmostEqual(
                accounting.epsilon_without_amplification(
                    steps=steps, noise_multiplier=1.0, delta=1e-5,
                    batches_per_pass=10),
                self._gaussian_epsilon(passes, accounting.RDP_ORDERS),
                places=9)

    def test_accumulation_across_passes_and_unknown_passes(self):
        passes = accounting.passes
        # k = 4 divides 8 batches a pass: 3 steps are 12 batches, 2 passes.
        self.assertEqual(passes.participation_bound(3, 8, 4), 2)
        # k = 3 does not divide 8: a step can hold an example twice.
        self.assertEqual(passes.participation_bound(3, 8, 3), 2 * 2)
        # Unknown passes: every physical batch may hold it, k^2 per step.
        self.assertEqual(passes.participation_bound(5, None, 2), 20)
        self.assertEqual(passes.participation_bound(0, None, 2), 0)

    def test_calibrated_steps_end_where_a_pass_would_exceed(self):
        # 3 passes of 10 steps fit a budget of 9.02 (RDP), a 4th does not.
        budget = self._gaussian_epsilon(3, accounting.RDP_ORDERS) + 1e-9
        self.assertEqual(
            accounting.calibrate_steps(
                target_epsilon=budget, num_examples=80, batch_size=8,
                noise_multiplier=1.0, delta=1e-5, sampling="shuffled",
                accountant="rdp"), 30)
        self.assertGreater(
            accounting.calibrate_steps(
                target_epsilon=budget, num_examples=80, batch_size=8,
                noise_multiplier=1.0, delta=1e-5, accountant="rdp"), 100)
        with self.assertRaisesRegex(ValueError, "single pass"):
            accounting.calibrate_steps(
                target_epsilon=0.1, num_examples=80, batch_size=8,
                noise_multiplier=1.0, delta=1e-5, sampling="shuffled")

    def test_bad_sampling(self):
        with self.assertRaisesRegex(ValueError, "sampling='random'"):
            accounting.compute_dp_sgd_privacy(80, 8, 1.0, 3, 1e-5,
                                              sampling="random")

if __name__ == "__main__":
    absltest.main()
