"""Per-example gradients and their clipped sum (`tf_dpadam.privatizer.clipping`)."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer import clipping


class ClippingTest(absltest.TestCase):

    def test_clip_and_sum_by_hand(self):
        # Example norms 5 and 0.5: the first is clipped to C = 1, the second
        # kept, the third masked out.
        grads = [tf.constant([[3.0, 4.0], [0.3, 0.4], [9.0, 9.0]])]
        summed, norms = clipping.clip_and_sum(
            grads, 1.0, mask=tf.constant([1.0, 1.0, 0.0]))
        np.testing.assert_allclose(summed[0].numpy(), [0.9, 1.2], rtol=1e-6)
        np.testing.assert_allclose(norms.numpy()[:2], [5.0, 0.5], rtol=1e-6)

    def test_a_non_finite_example_adds_nothing(self):
        grads = [tf.constant([[np.inf, 0.0], [0.3, 0.4]])]
        summed, _ = clipping.clip_and_sum(
            grads, 1.0, finite=tf.constant([True, True]))
        self.assertFalse(bool(clipping.all_finite(summed)))
        examples = (tf.constant([[1.0], [2.0]]), tf.constant([0, 1]), None)
        norms = tf.constant([np.inf, 0.5])
        (x, y, w), present = clipping.without_non_finite(
            examples, tf.constant([1.0, 1.0]), norms, tf.constant([0.1, 0.2]))
        # The first row is a copy of the finite example, marked absent.
        np.testing.assert_array_equal(x.numpy(), [[2.0], [2.0]])
        np.testing.assert_array_equal(y.numpy(), [1, 1])
        self.assertIsNone(w)
        np.testing.assert_array_equal(present.numpy(), [0.0, 1.0])

    def test_per_example_gradients_of_a_linear_loss(self):
        w = tf.Variable([1.0, 2.0])

        def loss(x):
            return tf.reduce_sum(x * w), x

        grads, losses, _ = clipping.per_example_gradients(
            loss, [w], (tf.constant([[1.0, 0.0], [0.0, 3.0]]),))
        np.testing.assert_allclose(grads[0].numpy(), [[1.0, 0.0], [0.0, 3.0]])
        np.testing.assert_allclose(losses.numpy(), [1.0, 6.0])


if __name__ == "__main__":
    absltest.main()
