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

    def test_noise_stddev_and_phi(self):
        # sigma C = 1.5 * 0.4 = 0.6; Phi = (0.6 / 12)^2 = 0.0025.
        self.assertAlmostEqual(dp_math.noise_stddev(0.4, 1.5), 0.6)
        self.assertAlmostEqual(dp_math.noise_variance_phi(0.6, 12), 0.0025)
        # The same in float32 from tensors (the privatizer's Phi).
        self.assertAlmostEqual(
            float(dp_math.noise_variance_phi(tf.constant(0.6), 12.0)),
            0.0025, places=8)
        # No noise, no bias.
        self.assertEqual(dp_math.noise_variance_phi(0.0, 8), 0.0)

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


class DPConfigTest(parameterized.TestCase):

    def test_normalizes_types_and_denominator(self):
        config = dp_math.DPConfig(l2_norm_clip=1, noise_multiplier=2,
                                  batch_size=np.int64(16),
                                  accumulation_steps=np.int32(4))
        self.assertEqual(
            (config.l2_norm_clip, config.noise_multiplier, config.batch_size,
             config.accumulation_steps), (1.0, 2.0, 16, 4))
        self.assertIs(type(config.batch_size), int)
        self.assertIs(type(config.l2_norm_clip), float)
        self.assertEqual(config.noise_stddev, 2.0)
        self.assertEqual(config.denominator(10), 16)
        counted = dp_math.DPConfig(l2_norm_clip=1.0, noise_multiplier=0.0)
        self.assertEqual(counted.denominator(10), 10)
        self.assertEqual(counted.accumulation_steps, 1)

    @parameterized.named_parameters(
        ("clip_zero", dict(l2_norm_clip=0.0),
         "Expected l2_norm_clip=0.0 to be a finite number > 0."),
        ("clip_inf", dict(l2_norm_clip=math.inf),
         "Expected l2_norm_clip=inf to be a finite number > 0."),
        ("clip_bool", dict(l2_norm_clip=True),
         "Expected l2_norm_clip=True to be a finite number > 0."),
        ("sigma_negative", dict(noise_multiplier=-0.5),
         "Expected noise_multiplier=-0.5 to be a finite number >= 0."),
        ("sigma_nan", dict(noise_multiplier=math.nan),
         "Expected noise_multiplier=nan to be a finite number >= 0."),
        ("batch_zero", dict(batch_size=0),
         "Expected batch_size=0 to be None or an int > 0."),
        ("batch_float", dict(batch_size=8.0),
         "Expected batch_size=8.0 to be None or an int > 0."),
        ("accumulation_zero", dict(accumulation_steps=0),
         "Expected gradient_accumulation_steps=0 to be None or an int >= 1."),
        ("accumulation_bool", dict(accumulation_steps=True),
         "Expected gradient_accumulation_steps=True to be None or an int"
         " >= 1."),
    )
    def test_validation_messages(self, overrides, message):
        kwargs = dict(l2_norm_clip=1.0, noise_multiplier=1.0)
        kwargs.update(overrides)
        with self.assertRaises(ValueError) as raised:
            dp_math.DPConfig(**kwargs)
        self.assertEqual(str(raised.exception), message)


if __name__ == "__main__":
    absltest.main()
