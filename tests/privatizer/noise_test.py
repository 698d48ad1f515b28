"""Noise and division by B (`tf_dpadam.privatizer.noise`)."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer import noise

_SEED = tf.constant([3, 4], tf.int64)


class NoiseTest(absltest.TestCase):

    def test_phi(self):
        # sigma C = 0.6, B = 12: Phi = (0.6 / 12)^2 = 0.0025.
        self.assertAlmostEqual(noise.noise_variance_phi(0.6, 12), 0.0025)
        # The same in float32 from tensors (the privatizer's Phi).
        self.assertAlmostEqual(
            float(noise.noise_variance_phi(tf.constant(0.6), 12.0)),
            0.0025, places=8)
        # No noise, no bias.
        self.assertEqual(noise.noise_variance_phi(0.0, 8), 0.0)

    def test_divide_returns_the_gradient_and_its_phi(self):
        summed = [tf.zeros((400, 500)), tf.ones((3,))]
        seed = tf.constant([1, 2], tf.int64)
        grads, phi = noise.divide(noise.add_noise(summed, 0.6, seed), 0.6,
                                  12.0)
        self.assertAlmostEqual(float(phi), 0.0025, places=8)
        # Value out: the noised sum divided by B, nothing else.
        expected = noise.scale(noise.add_noise(summed, 0.6, seed), 12.0)
        for got, want in zip(grads, expected):
            np.testing.assert_array_equal(got.numpy(), want.numpy())
        # Its variance per coordinate is Phi (200,000 draws: the relative
        # standard error of the variance is 0.3%; 4 of them = 1.3%).
        self.assertAlmostEqual(float(np.var(grads[0].numpy())) / 0.0025,
                               1.0, delta=0.013)

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


class PhiloxKeyTest(absltest.TestCase):
    """The noise's Philox key by one kernel outside XLA: the very values of
    `tf.random.stateless_*(alg="philox")`, with far fewer ops."""

    def _seeds(self):
        rng = np.random.default_rng(5)
        for dtype in (np.int32, np.int64):
            info = np.iinfo(dtype)
            for _ in range(6):
                yield tf.constant(rng.integers(info.min, info.max, size=2,
                                               dtype=dtype))

    def test_the_values_of_tensorflows_philox_in_graphs_and_eagerly(self):
        for seed in self._seeds():
            for run in (lambda f: f(), lambda f: tf.function(f)()):
                np.testing.assert_array_equal(
                    run(lambda: noise.gaussian([7, 3], 1.7, "float32", seed)),
                    run(lambda: tf.random.stateless_normal(
                        [7, 3], seed=seed, stddev=1.7, alg="philox")))
                np.testing.assert_array_equal(
                    run(lambda: noise.split(seed, 5)),
                    run(lambda: tf.random.experimental.stateless_split(
                        seed, 5, alg="philox")))
                # Secure mode: the sum of normals from the split seeds.
                parts = tf.random.experimental.stateless_split(
                    seed, noise.SECURE_MODE_DRAWS, alg="philox")
                part = 1.7 / noise.SECURE_MODE_DRAWS ** 0.5
                np.testing.assert_array_equal(
                    run(lambda: noise.gaussian([4], 1.7, "float32", seed,
                                               secure_mode=True)),
                    run(lambda: tf.add_n([tf.random.stateless_normal(
                        [4], seed=s, stddev=part, alg="philox")
                        for s in tf.unstack(parts)])))

    def test_under_xla_the_values_of_tensorflows_xla_philox(self):
        seed = tf.constant([123456789012345, -98765432109876], tf.int64)

        def compiled(function):
            return tf.function(function, jit_compile=True)().numpy()

        theirs = compiled(lambda: tf.random.stateless_normal(
            [64], seed=seed, alg="philox"))
        np.testing.assert_array_equal(
            compiled(lambda: noise.gaussian([64], 1.0, "float32", seed,
                                            xla=True)), theirs)
        np.testing.assert_array_equal(
            compiled(lambda: noise.draw([tf.zeros([64])], 1.0, seed,
                                        xla=True)[0]),
            compiled(lambda: tf.random.stateless_normal(
                [64], seed=tf.random.experimental.stateless_split(
                    seed, 1, alg="philox")[0], alg="philox")))
        # Why the step says when it is compiled: XLA derives another key
        # from the kernel (the test can fail).
        self.assertFalse(np.array_equal(
            compiled(lambda: noise.gaussian([64], 1.0, "float32", seed)),
            theirs))

    def test_one_kernel_instead_of_tensorflows_python_scramble(self):
        seed = tf.constant([1, 2], tf.int64)

        def num_ops(xla):
            graph = tf.function(lambda: noise.draw(
                [tf.zeros([3])] * 4, 1.0, seed, xla=xla)
            ).get_concrete_function().graph
            return len(graph.get_operations())

        self.assertLess(num_ops(False) * 3, num_ops(True))
