"""tf_dpadam.privatizer.preclip: the pre-clipping transform of per-example gradients."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer import preclip


class TransformGradientsTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        self.grads = [rng.normal(size=(4, 3, 2)).astype("float32"),
                      rng.normal(size=(4, 2)).astype("float32")]
        self.shifted = [rng.normal(size=g.shape).astype("float32")
                        for g in self.grads]
        self.scales = [rng.uniform(0.5, 2, size=g.shape[1:]).astype("float32")
                       for g in self.grads]

    def check(self, got, want):
        self.assertLen(got, len(want))
        for g, w in zip(got, want):
            self.assertEqual(g.dtype, "float32")
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)

    def test_scales(self):
        transform = preclip.PerExampleTransform(scales=self.scales)
        self.check(preclip.transform_gradients(self.grads, transform),
                   [g * s[None] for g, s in zip(self.grads, self.scales)])

    def test_shifts_and_scales(self):
        transform = preclip.PerExampleTransform(
            scales=self.scales, shifts=[0 * s for s in self.scales],
            shift_weight=0.25)
        self.check(
            preclip.transform_gradients(self.grads, transform, self.shifted),
            [(0.75 * g + 0.25 * h) * s[None]
             for g, h, s in zip(self.grads, self.shifted, self.scales)])

    def test_shifts_need_the_shifted_gradients(self):
        transform = preclip.PerExampleTransform(
            shifts=[0 * s for s in self.scales], shift_weight=0.5)
        with self.assertRaisesRegex(ValueError, "shifted_grads"):
            preclip.transform_gradients(self.grads, transform)

    def test_an_empty_transform_is_refused(self):
        with self.assertRaisesRegex(ValueError, "scales or shifts"):
            preclip.PerExampleTransform()


class ShiftedValueTest(absltest.TestCase):

    def test_in_the_variable_dtype_without_a_gradient_to_the_shift(self):
        variable = keras.Variable(np.array([1.0, 2.0], "float32"))
        shift = tf.constant([0.5, -1.0], "float64")
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(shift)
            value = preclip.shifted_value(variable, shift)
        self.assertEqual(value.dtype, "float32")
        np.testing.assert_allclose(value, [1.5, 1.0])
        self.assertIsNone(tape.gradient(value, shift))
        self.assertIsNotNone(tape.gradient(value, variable))


if __name__ == "__main__":
    absltest.main()
