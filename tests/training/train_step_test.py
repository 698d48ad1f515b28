"""The train step's helpers (`tf_dpadam.training.train_step`)."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.training import train_step

import helpers


class TrainStepTest(absltest.TestCase):

    def test_present_examples_follow_the_sample_weight(self):
        x = np.zeros((3, 2), "float32")
        np.testing.assert_array_equal(
            train_step.present_examples(x, None).numpy(), [1.0, 1.0, 1.0])
        np.testing.assert_array_equal(
            train_step.present_examples(
                x, tf.constant([0.5, 0.0, 2.0])).numpy(), [1.0, 0.0, 1.0])

    def test_example_mixing_layers_are_refused(self):
        model = keras.Sequential([keras.Input((2,)),
                                  keras.layers.BatchNormalization(name="bn")])
        with self.assertRaisesRegex(ValueError, "'bn'"):
            train_step.check_no_example_mixing(model)

    def test_a_keras_optimizer_is_refused(self):
        with self.assertRaisesRegex(ValueError, "optimizer="):
            train_step.require_dp_optimizer(keras.optimizers.SGD())

    def test_the_clipped_sum_by_each_mode_agrees(self):
        x, y = helpers.classification_data(6)
        sums = {}
        for clipping in ("ghost", "vectorized"):
            model = tf_dpadam.make_private(helpers.mlp(), clipping=clipping)
            model.compile(
                optimizer=tf_dpadam.DPSGD(l2_norm_clip=0.1,
                                          noise_multiplier=0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
            present = tf.ones(6)
            summed, norms, _, _ = train_step.clipped_sum(
                model, x, y, None, present, 0.1)
            self.assertEqual(model.clipping_used, clipping)
            # C = 0.1 clips every example: each adds a vector of norm C.
            self.assertTrue(np.all(norms.numpy() > 0.1))
            sums[clipping] = summed
        for ghost, vectorized in zip(sums["ghost"], sums["vectorized"]):
            np.testing.assert_allclose(ghost, vectorized, atol=1e-5)


if __name__ == "__main__":
    absltest.main()
