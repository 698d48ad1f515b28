"""Tests of tf_dpadam.accounting.calibration: steps and noise multiplier for a target epsilon."""

import contextlib
import io
import re

from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam import accounting
from tf_dpadam.accounting import epsilon as accounting_epsilon

DELTA = 1e-5

# A cheap setting for the PLD searches: q = 0.01, sigma = 1.
SMALL = dict(num_examples=10_000, batch_size=100, noise_multiplier=1.0)


def _eps(steps, accountant="rdp", **setting):
    return accounting.epsilon_after_steps(
        steps=steps, delta=DELTA, accountant=accountant, **setting
    )


class CalibrateStepsTest(parameterized.TestCase):

    def _assert_bracket(self, steps, target, accountant, **setting):
        self.assertIsInstance(steps, int)
        self.assertGreaterEqual(steps, 1)
        self.assertLessEqual(_eps(steps, accountant, **setting), target)
        self.assertGreater(_eps(steps + 1, accountant, **setting), target)

    @parameterized.product(accountant=["rdp", "pld"], target=[1.0, 3.0])
    def test_brackets_exactly(self, accountant, target):
        steps = accounting.calibrate_steps(
            target_epsilon=target, delta=DELTA, accountant=accountant, **SMALL
        )
        self._assert_bracket(steps, target, accountant, **SMALL)

    def test_target_equal_to_an_epsilon_is_inclusive(self):
        steps = accounting.calibrate_steps(
            target_epsilon=_eps(37, **SMALL), delta=DELTA, accountant="rdp",
            **SMALL
        )
        self.assertEqual(steps, 37)

    # The paper's settings (Tang & Lecuyer), delta = 1e-5, target epsilon 7.
    # Values obtained with dp-accounting 0.6.0:
    #   CIFAR-10 (N=50,000, B=2048, sigma=1):   RDP T = 548  (22.4 epochs),
    #                                            PLD T = 664  (27.2 epochs);
    #   SNLI (N=550,152, B=256, sigma=0.4):     RDP T = 1320 (0.61 epochs),
    #                                            PLD T = 5468 (2.54 epochs).
    # Only the RDP searches run here (the PLD ones take a few seconds each).
    @parameterized.named_parameters(
        ("cifar10", 50_000, 2048, 1.0, 400, 700),
        ("snli", 550_152, 256, 0.4, 1000, 1700),
    )
    def test_paper_settings(self, n, batch_size, sigma, low, high):
        setting = dict(
            num_examples=n, batch_size=batch_size, noise_multiplier=sigma
        )
        steps = accounting.calibrate_steps(
            target_epsilon=7.0, delta=DELTA, accountant="rdp", **setting
        )
        self._assert_bracket(steps, 7.0, "rdp", **setting)
        self.assertBetween(steps, low, high)

    @parameterized.parameters("rdp", "pld")
    def test_one_step_over_target_raises(self, accountant):
        smallest = _eps(1, accountant, **SMALL)
        with self.assertRaisesRegex(
            ValueError, re.escape(f"target_epsilon=0.001 >= {smallest!r}")
        ):
            accounting.calibrate_steps(
                target_epsilon=0.001,
                delta=DELTA,
                accountant=accountant,
                **SMALL,
            )


class CalibrateNoiseMultiplierTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("rdp_epochs_small_sigma", "rdp", dict(epochs=3), 8.0),
        ("rdp_steps_large_sigma", "rdp", dict(steps=1000), 0.3),
        ("pld_steps", "pld", dict(steps=300), 1.0),
    )
    def test_meets_target_and_one_percent_less_does_not(
        self, accountant, length, target
    ):
        setting = dict(num_examples=10_000, batch_size=100)
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=target, delta=DELTA, accountant=accountant,
            **length, **setting,
        )
        steps = length.get("steps") or accounting.steps_for_epochs(
            length["epochs"], **setting
        )

        def eps(s):
            return _eps(steps, accountant, noise_multiplier=s, **setting)

        self.assertLessEqual(eps(sigma), target)
        self.assertGreater(eps(0.99 * sigma), target)

    def test_prints_and_logs_nothing(self):
        # Probing sigma = 0.5 at q = 0.04 makes dp-accounting's series for
        # a few low fractional orders fail to converge; it excludes those
        # orders and would log one warning per order.
        accounting_epsilon.rdp_one_step.cache_clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertNoLogs(
            "absl", level="WARNING"
        ):
            sigma = accounting.calibrate_noise_multiplier(
                target_epsilon=7.0, num_examples=50_000, batch_size=2048,
                epochs=20, delta=DELTA, accountant="rdp",
            )
        self.assertEqual(out.getvalue(), "")
        self.assertBetween(sigma, 0.9, 1.0)

    def test_epochs_and_steps_agree(self):
        common = dict(
            target_epsilon=2.0, num_examples=60000, batch_size=256, delta=DELTA,
            accountant="rdp",
        )
        self.assertEqual(
            accounting.calibrate_noise_multiplier(epochs=60, **common),
            accounting.calibrate_noise_multiplier(steps=14063, **common),
        )

if __name__ == "__main__":
    absltest.main()
