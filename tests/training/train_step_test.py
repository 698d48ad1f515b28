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


class StepStateTest(absltest.TestCase):
    """The one key of the shared clipped sum and of the guard's rechecks."""

    def _model(self):
        base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                 keras.layers.Dense(2)])
        model = tf_dpadam.make_private(base, check_independence=False)
        self._compile(model)
        return model

    def _compile(self, model):
        model.compile(optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0,
                                                noise_multiplier=1.0),
                      loss="mse")

    def test_equal_until_what_the_trace_depends_on_changes(self):
        model = self._model()
        first = train_step.StepState(model)
        self.assertEqual(first, train_step.StepState(model))
        self.assertNotEqual(first, train_step.StepState(model, groups=[0]))
        self._compile(model)  # A new optimizer and compiled loss.
        recompiled = train_step.StepState(model)
        self.assertNotEqual(first, recompiled)
        self.assertTrue(first.same_variables(recompiled))
        model.base_model.layers[0].trainable = False
        frozen = train_step.StepState(model)
        self.assertNotEqual(recompiled, frozen)
        self.assertFalse(recompiled.same_variables(frozen))
        model.augmult = 2
        self.assertNotEqual(frozen, train_step.StepState(model))

    def test_shared_sum_is_made_again_only_on_change(self):
        model = self._model()
        function = train_step.shared_clipped_sum(model)
        self.assertIsNotNone(function)
        self.assertIs(train_step.shared_clipped_sum(model), function)
        self._compile(model)
        self.assertIsNot(train_step.shared_clipped_sum(model), function)


if __name__ == "__main__":
    absltest.main()
