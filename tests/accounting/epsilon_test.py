"""Tests of tf_dpadam.accounting.epsilon: epsilon after T steps (RDP, PLD), TF-Privacy's numbers."""

import contextlib
import io
import re

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting

from tf_dpadam import accounting

DELTA = 1e-5

# A cheap setting for the PLD searches: q = 0.01, sigma = 1.
SMALL = dict(num_examples=10_000, batch_size=100, noise_multiplier=1.0)


def _eps(steps, accountant="rdp", **setting):
    return accounting.epsilon_after_steps(
        steps=steps, delta=DELTA, accountant=accountant, **setting
    )


class ComputeDpSgdPrivacyTest(parameterized.TestCase):

    # Golden values of tensorflow-privacy 0.9.0's compute_dp_sgd_privacy.
    # TF-Privacy's orders put only integers between 5 and 63, so the optimal
    # orders are integers and our values agree to about 1e-13; the order list
    # [1 + x / 10 for x in range(1, 100)] + ... would give (2.59666, 8.1) and
    # (1.55985, 9.7) instead, which the order assertion (and, for the second,
    # the tolerance) rejects.
    @parameterized.parameters(
        ((60000, 256, 1.1, 60, 1e-5), 2.597079519657094, 8.0),
        ((60000, 256, 1.0, 15, 1e-5), 1.5710682146464534, 10.0),
    )
    def test_tf_privacy_golden_values(self, args, epsilon, order):
        got_epsilon, got_order = accounting.compute_dp_sgd_privacy(*args)
        self.assertAlmostEqual(got_epsilon, epsilon, delta=1e-6 * epsilon)
        self.assertEqual(got_order, order)
        self.assertIsInstance(got_epsilon, float)
        self.assertIsInstance(got_order, float)

    def test_prints_nothing(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            accounting.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
        self.assertEqual(out.getvalue(), "")


class EpsilonAfterStepsTest(parameterized.TestCase):

    def test_opacus_published_value(self):
        # Opacus' published RDP example: sigma = 1.5, q = 0.04, 2,250 steps,
        # delta = 1e-5 -> epsilon 7.329. With our dense orders: 7.3285 (order
        # 3.9); with Opacus' default alphas, [1 + x / 10 for x in
        # range(1, 100)] + list(range(12, 64)): 7.3293.
        setting = dict(
            num_examples=60000, batch_size=2400, noise_multiplier=1.5
        )
        epsilon = _eps(2250, **setting)
        self.assertAlmostEqual(epsilon, 7.329, delta=0.005 * 7.329)

        opacus_alphas = [1 + x / 10.0 for x in range(1, 100)] + list(
            range(12, 64)
        )
        rdp = dp_accounting.rdp.RdpAccountant(opacus_alphas)
        rdp.compose(accounting.dp_sgd_event(0.04, 1.5, 2250))
        self.assertAlmostEqual(rdp.get_epsilon(DELTA), 7.329, delta=1e-3)
        # A denser list of orders can only help.
        self.assertLessEqual(epsilon, rdp.get_epsilon(DELTA))
        # PLD is tighter than RDP here.
        self.assertLess(_eps(2250, "pld", **setting), epsilon)

    @parameterized.parameters(1, 7, 548, 100_000)
    def test_rdp_equals_accountant_on_the_composed_event(self, steps):
        # The scaled one-step curve must give exactly what the RdpAccountant
        # gives for SelfComposedDpEvent(PoissonSampledDpEvent(...), T).
        accountant = dp_accounting.rdp.RdpAccountant(
            list(accounting.RDP_ORDERS)
        )
        accountant.compose(accounting.dp_sgd_event(2048 / 50000, 1.0, steps))
        expected = accountant.get_epsilon(DELTA)
        got = _eps(
            steps, num_examples=50000, batch_size=2048, noise_multiplier=1.0
        )
        self.assertEqual(got, expected)

    def test_pld_equals_accountant_on_the_composed_event(self):
        accountant = dp_accounting.pld.PLDAccountant(
            value_discretization_interval=(
                accounting.PLD_VALUE_DISCRETIZATION_INTERVAL
            )
        )
        accountant.compose(accounting.dp_sgd_event(0.01, 1.0, 300))
        self.assertEqual(
            _eps(300, "pld", **SMALL), accountant.get_epsilon(DELTA)
        )

    @parameterized.parameters("rdp", "pld")
    def test_zero_steps_and_monotone(self, accountant):
        self.assertEqual(_eps(0, accountant, **SMALL), 0.0)
        values = [_eps(t, accountant, **SMALL) for t in (1, 10, 100)]
        self.assertEqual(values, sorted(values))
        self.assertGreater(values[0], 0.0)

    def test_steps_for_epochs(self):
        self.assertEqual(accounting.steps_for_epochs(60, 60000, 256), 14063)
        self.assertEqual(accounting.steps_for_epochs(1, 60000, 60000), 1)
        self.assertEqual(accounting.steps_for_epochs(0, 100, 10), 0)
        # 0.1 * 3000 / 100 = 3.0000000000000004 in floating point.
        self.assertEqual(accounting.steps_for_epochs(0.1, 3000, 100), 3)
        self.assertEqual(accounting.steps_for_epochs(0.25, 1000, 100), 3)

    def test_training_steps_from_epochs_or_steps(self):
        sizes = dict(num_examples=60000, batch_size=256)
        self.assertEqual(accounting.training_steps(epochs=60, **sizes), 14063)
        self.assertEqual(accounting.training_steps(steps=7, **sizes), 7)
        for kwargs, message in (
            (dict(), "exactly one of epochs=None and steps=None"),
            (dict(epochs=1, steps=2), "exactly one of epochs=1 and steps=2"),
            (dict(epochs=0), "Expected epochs=0 > 0."),
            (dict(steps=0), "Expected steps=0 > 0."),
            (dict(steps=1.5), "Expected steps=1.5 to be an integer."),
        ):
            with self.assertRaisesRegex(ValueError, re.escape(message)):
                accounting.training_steps(**kwargs, **sizes)

if __name__ == "__main__":
    absltest.main()
