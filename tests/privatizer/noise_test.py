"""Noise and division by B (`tf_dpadam.privatizer.noise`)."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer import noise

_SEED = tf.constant([3, 4], tf.int64)


class NoiseTest(absltest.TestCase):

    def test_no_noise_returns_float32_unchanged(self):
        grads = [tf.constant([1.5, -2.0], tf.bfloat16)]
        out = noise.add_noise(grads, 0.0, _SEED)
        self.assertEqual(out[0].dtype, tf.float32)
        np.testing.assert_array_equal(out[0].numpy(), [1.5, -2.0])

    def test_equal_shapes_get_independent_noise(self):
        zeros = [tf.zeros(1000), tf.zeros(1000)]
        first, second = noise.add_noise(zeros, 1.0, _SEED)
        self.assertLess(abs(np.corrcoef(first, second)[0, 1]), 0.1)

    def test_std_with_and_without_secure_mode(self):
        for secure in (False, True):
            draws = noise.gaussian([20000], 3.0, tf.float32, _SEED,
                                   secure_mode=secure)
            self.assertAlmostEqual(float(np.std(draws)), 3.0, delta=0.09)

    def test_share_zero_adds_no_noise(self):
        out = noise.add_noise([tf.ones(5)], 2.0, _SEED, share=0.0)
        np.testing.assert_array_equal(out[0].numpy(), np.ones(5))

    def test_scale_divides_in_float32(self):
        out = noise.scale([tf.constant([3.0], tf.float16)], 4)
        self.assertEqual(out[0].dtype, tf.float32)
        np.testing.assert_allclose(out[0].numpy(), [0.75])


if __name__ == "__main__":
    absltest.main()
