"""What ghost clipping's step records: passes, tap gradients, regularization."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer.ghost_clipping import plan as plan_lib
from tf_dpadam.privatizer.ghost_clipping import recording as recording_lib

import helpers


def _model():
    keras.utils.set_random_seed(0)
    return helpers.sequential(
        (4,), keras.layers.Dense(
            3, activation="tanh",
            kernel_regularizer=keras.regularizers.L2(0.3),
            bias_regularizer=keras.regularizers.L1(0.2)),
        keras.layers.Dense(2))


class RecordingTest(absltest.TestCase):

    def _pass(self, model, plan, x, reset, scale):
        """One recorded pass; its tape, total and Recording."""
        with tf.GradientTape() as tape:
            recording = recording_lib.Recording(tape, tf.shape(x)[0],
                                                x.shape[0])
            with recording_lib.recorded(plan.rules, recording, reset=reset):
                total = scale * tf.reduce_sum(model(x) ** 2)
        return tape, total, recording

    def test_a_second_pass_adds_records_and_its_own_tap_gradients(self):
        model = _model()
        plan = plan_lib.Plan(model)
        x = tf.constant(helpers.normal((helpers.BATCH, 4)))
        tape, total, _ = self._pass(model, plan, x, True, 1.0)
        first = recording_lib.tap_gradients(tape, total, plan,
                                            model.trainable_variables)
        counts = [len(rule.records) for rule in plan.rules]
        self.assertEqual(counts, [1, 1])
        tape, total, _ = self._pass(model, plan, x, False, 3.0)
        self.assertEqual([len(rule.records) for rule in plan.rules], [2, 2])
        second = recording_lib.tap_gradients(
            tape, total, plan, model.trainable_variables, first=counts)
        # One record per rule in the second pass: 3 times the first's
        # gradients (the same weights, the loss times 3).
        for a, b in zip(first, second):
            self.assertLen(b, 1)
            np.testing.assert_allclose(b[0][0], 3.0 * a[0][0], rtol=1e-5)
        # A pass that resets starts over.
        self._pass(model, plan, x, True, 1.0)
        self.assertEqual([len(rule.records) for rule in plan.rules], [1, 1])

    def test_regularization_at_shifted_weights(self):
        model = _model()
        kernel, bias = model.layers[0].kernel, model.layers[0].bias
        d_kernel = helpers.normal(kernel.shape, seed=1)
        d_bias = helpers.normal(bias.shape, seed=2)
        total, grads = recording_lib.regularization(
            model, offsets={id(kernel): d_kernel, id(bias): d_bias})
        k = kernel.numpy() + d_kernel
        b = bias.numpy() + d_bias
        np.testing.assert_allclose(
            total, 0.3 * np.sum(k ** 2) + 0.2 * np.sum(np.abs(b)), rtol=1e-5)
        np.testing.assert_allclose(grads[id(kernel)], 0.6 * k, rtol=1e-5)
        np.testing.assert_allclose(grads[id(bias)], 0.2 * np.sign(b),
                                   rtol=1e-6)
        # At the weights themselves (no offsets).
        _, here = recording_lib.regularization(model)
        np.testing.assert_allclose(here[id(kernel)], 0.6 * kernel.numpy(),
                                   rtol=1e-5)
        self.assertNotIn(id(model.layers[1].kernel), grads)


if __name__ == "__main__":
    absltest.main()
