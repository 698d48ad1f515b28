"""src/tf_dpadam/privatizer/dp_math.py: the pure DP-Adam functions against NumPy.

Each case is small enough to check by hand; the comments give the numbers.
"""

import math

import numpy as np
from absl.testing import absltest
import tensorflow as tf
from absl.testing import parameterized
from keras import ops

from tf_dpadam.privatizer import dp_math


def _numpy(value):
    return np.asarray(ops.convert_to_numpy(value))


class NoiseTest(absltest.TestCase):

    def test_default_gamma_is_a_floored_fraction_of_phi(self):
        # 0.04 * 2.4e-7 = 9.6e-9 (the paper's CIFAR-10 Phi gives ~1e-8),
        # in Keras' float32.
        self.assertAlmostEqual(float(_numpy(dp_math.default_gamma(2.4e-7))),
                               9.6e-9, delta=9.6e-9 * 1e-6)
        # Without noise the floor: 1e-14.
        self.assertAlmostEqual(float(_numpy(dp_math.default_gamma(0.0))),
                               dp_math.MIN_DEFAULT_GAMMA, delta=1e-20)


class ClippingTest(absltest.TestCase):

    def test_per_example_global_norms_over_all_variables(self):
        # Example 0: sqrt(3^2 + 4^2 + 0) = 5; example 1: sqrt(1 + 0 + 4 * 4)
        # = sqrt(17); example 2: all zeros.
        kernel = np.array([[[3.0], [0.0]], [[1.0], [0.0]], [[0.0], [0.0]]])
        bias = np.array([[4.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
        scale = np.array([[0.0], [4.0], [0.0]])
        np.testing.assert_allclose(
            _numpy(dp_math.per_example_global_norms([kernel, bias, scale])),
            [5.0, math.sqrt(17.0), 0.0], rtol=1e-6,
        )

    def test_clip_factors(self):
        # min(1, C / ||g||) with C = 2: norms 5 -> 0.4, 1 -> 1 (not
        # scaled up), 0 -> 1 (not nan), exactly C -> 1.
        np.testing.assert_allclose(
            _numpy(dp_math.clip_factors(np.array([5.0, 1.0, 0.0, 2.0]), 2.0)),
            [0.4, 1.0, 1.0, 1.0],
        )


class CorrectedDirectionTest(absltest.TestCase):

    def test_against_numpy(self):
        rng = np.random.default_rng(0)
        m_hat = rng.normal(size=50)
        v_hat = rng.uniform(0.0, 2.0, size=50)
        phi, gamma = 0.5, 0.02
        np.testing.assert_allclose(
            _numpy(dp_math.corrected_adam_direction(m_hat, v_hat, phi, gamma)),
            m_hat / np.sqrt(np.maximum(v_hat - phi, gamma)),
            rtol=1e-12,
        )

    def test_hand_computed_and_floored(self):
        # (v - Phi) = 4.5 - 0.5 = 4: 6 / 2 = 3. v - Phi = -0.3 < gamma'
        # = 0.25: floored, 1 / 0.5 = 2.
        np.testing.assert_allclose(
            _numpy(dp_math.corrected_adam_direction(
                np.array([6.0, 1.0]), np.array([4.5, 0.2]), 0.5, 0.25)),
            [3.0, 2.0],
        )

    def test_without_noise_it_is_adam_with_epsilon_inside_the_root(self):
        m_hat, v_hat = np.array([0.3, -0.2]), np.array([0.09, 0.01])
        np.testing.assert_allclose(
            _numpy(dp_math.corrected_adam_direction(m_hat, v_hat, 0.0, 1e-14)),
            [1.0, -2.0], rtol=1e-6,
        )


if __name__ == "__main__":
    absltest.main()
