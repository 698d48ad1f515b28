"""Tests of tf_dpadam.accounting.pld: the PLD accountant, with bounded cost."""

import contextlib
import re
import resource
import time

from absl.testing import absltest
from absl.testing import parameterized
import dp_accounting

from tf_dpadam import accounting
from tf_dpadam.accounting import pld

DELTA = 1e-5
Q = 256 / 60000  # The setting, with sigma = 6.
MNIST_SIGMA_6 = dict(num_examples=60000, batch_size=256, noise_multiplier=6)


def _eps(steps, accountant, **setting):
    return accounting.epsilon_after_steps(
        steps=steps, delta=DELTA, accountant=accountant, **setting)


@contextlib.contextmanager
def _bounded(test):
    """Fails `test` if the block takes >= 10 s or grows the peak memory of
    the process by >= 1 GB (the issue's requirement)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    yield
    test.assertLess(time.monotonic() - start, 10.0)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    test.assertLess(growth, 1 << 20)  # KB.


class PldTest(parameterized.TestCase):

    @parameterized.parameters(1, 2, 3, 9, 10, 2000)
    def test_equals_the_accountant_sparse_and_dense(self, steps):
        # A one-step PMF of 23 points: dp-accounting composes it sparsely
        # while 23**T <= 1000 (T <= 2), densely after; here from T = 10 on
        # a dense copy (its mixture with itself at weight 1/2).
        accountant = dp_accounting.pld.PLDAccountant(
            value_discretization_interval=pld.PLD_VALUE_DISCRETIZATION_INTERVAL)
        accountant.compose(accounting.dp_sgd_event(Q, 6.0, steps))
        self.assertEqual(pld.pld_epsilon(Q, 6.0, steps, DELTA),
                         accountant.get_epsilon(DELTA))

    def test_ten_million_steps_in_seconds(self):
        # 44 s in dp-accounting (its 23**T, an integer of 13 million
        # digits): the same distribution, 300,000 points.
        self.assertLess(pld.pld_points(Q, 6.0, 10**7), pld.MAX_PLD_POINTS)
        with _bounded(self):
            self.assertAlmostEqual(_eps(10**7, "pld", **MNIST_SIGMA_6),
                                   13.926, places=3)

    def test_refuses_a_huge_distribution_quickly(self):
        # --epochs=1e9 of the privacy command line: 234,375,000,000 steps,
        # whose PLD would have 7e9 points (23.5 GB before the limit).
        with _bounded(self), self.assertRaisesRegex(
                pld.PLDTooLargeError,
                r"Expected steps=234375000000 few enough for the PLD"
                r" accountant .* more than MAX_PLD_POINTS = 524,288"):
            _eps(234_375_000_000, "pld", **MNIST_SIGMA_6)
        with _bounded(self):  # RDP costs the same at any T.
            self.assertGreater(_eps(234_375_000_000, "rdp", **MNIST_SIGMA_6),
                               1e4)
        self.assertTrue(issubclass(pld.PLDTooLargeError, ValueError))

    @parameterized.parameters(
        (1e-3, 0.1, "noise_multiplier=0.1 >= 0.1923"),  # q < 1
        (1.0, 0.05, "noise_multiplier=0.05 >= 0.06673"),  # a Gaussian
        (1.0, 1e-300, "noise_multiplier=1e-300 >= 0.06673"),
    )
    def test_refuses_a_tiny_noise_multiplier_before_building(self, q, sigma,
                                                             message):
        with _bounded(self), self.assertRaisesRegex(
                pld.PLDTooLargeError, re.escape(message)):
            _eps(1, "pld", num_examples=1000, batch_size=round(q * 1000),
                 noise_multiplier=sigma)

    @parameterized.parameters(0.02, 0.1, 1.0, 6.0)
    def test_the_points_estimate_bounds_one_step(self, sigma):
        # Within 3% above dp-accounting's (q = 1: the widest).
        points = pld.pld_points(1.0, sigma, 1) if sigma >= 0.0667 else None
        estimate = pld.gaussian_pld_points(sigma)
        if points is not None:
            self.assertBetween(estimate / points, 1.0, 1.03)
        self.assertEqual(sigma >= pld.smallest_pld_noise_multiplier(),
                         estimate <= pld.MAX_PLD_POINTS)


if __name__ == "__main__":
    absltest.main()
