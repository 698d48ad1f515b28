"""The clean gradient of `diagnostics=True` (`tf_dpadam.training.clean_gradients`)."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.training import clean_gradients


class CleanGradientsTest(absltest.TestCase):

    def test_records_the_sum_over_b_and_non_finite_examples(self):
        clean = clean_gradients.CleanGradients()
        variables = [keras.Variable(np.zeros(2, "float32"))]
        clean.build(variables)
        made = clean.variables
        clean.build(variables)  # Same shapes: the same variables.
        self.assertIs(clean.variables, made)
        clean.before_noise([tf.constant([2.0, 6.0])], 4.0)
        np.testing.assert_allclose(clean.variables[0].numpy(), [0.5, 1.5])
        clean.after_clipping(tf.constant([1.0, np.nan, np.inf]),
                             tf.constant([0.1, 0.2, 0.3]),
                             tf.constant([1.0, 1.0, 0.0]))
        # The absent example (present 0) is not counted.
        self.assertEqual(float(clean.non_finite_count.numpy()), 1.0)
        self.assertTrue(clean.observes_clean_sum)


if __name__ == "__main__":
    absltest.main()
