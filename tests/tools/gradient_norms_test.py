"""`tf_dpadam.per_example_gradient_norms` against brute force.

Brute force: a one-example `GradientTape` per example, with the
regularization loss, the global L2 norm over every trainable weight. Checked
for ghost and vectorized clipping, uneven batches, Poisson padding rows (left
out), augmentation views (K > 1) and a keras-hub task model on raw strings;
the weights do not move, and bad input raises.
"""

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam

import helpers


def _brute_force_norms(model, loss, x, y):
    norms = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            row = tf.nest.map_structure(lambda v: v[i:i + 1], x)
            value = loss(y[i:i + 1], model(row, training=True))
            value += sum(keras.ops.sum(extra) for extra in model.losses)
        grads = tape.gradient(value, model.trainable_variables)
        norms.append(np.sqrt(sum(np.sum(np.square(tf.convert_to_tensor(g)))
                                 for g in grads)))
    return np.array(norms)


def _private(model, clipping="auto", loss=helpers.LOSS, **kwargs):
    private = tf_dpadam.make_private(model, clipping=clipping,
                                     **kwargs)
    private.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=0.01, noise_multiplier=1.0, batch_size=4),
        loss=loss)
    return private


def _double(x):
    return 2.0 * x


class PerExampleGradientNormsTest(parameterized.TestCase):

    @parameterized.parameters("ghost", "vectorized")
    @pytest.mark.slow
    def test_equals_brute_force(self, clipping):
        x, y = helpers.classification_data(10)
        model = helpers.mlp(kernel_regularizer=keras.regularizers.L2(0.1))
        want = _brute_force_norms(model, helpers.LOSS, x, y)
        before = helpers.numpy_values(model.weights)
        private = _private(model, clipping)
        # 10 examples in batches of 3: the last batch has one.
        got = tf_dpadam.per_example_gradient_norms(private, x, y,
                                                   batch_size=3)
        self.assertEqual(private.clipping_used, clipping)
        self.assertEqual(got.shape, (10,))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        # Far above C = 0.01: the clipping does not enter the norms.
        self.assertGreater(got.min(), 0.1)
        for b, a in zip(before, helpers.numpy_values(model.weights)):
            np.testing.assert_array_equal(a, b)

    @pytest.mark.slow
    def test_padding_rows_are_left_out(self):
        x, y = helpers.classification_data(6)
        model = helpers.mlp()
        want = _brute_force_norms(model, helpers.LOSS, x, y)
        weights = np.array([1, 0, 1, 1, 0, 1], "float32")
        dataset = tf.data.Dataset.from_tensor_slices(
            (x, y, weights)).batch(4)
        got = tf_dpadam.per_example_gradient_norms(_private(model), dataset)
        np.testing.assert_allclose(got, want[weights > 0], rtol=1e-5)

    def test_views_of_augmentation_multiplicity(self):
        # K = 2 views of 2x: the example's mean loss over them is the loss
        # at 2x, so its norm is the brute-force norm at 2x.
        x, y = helpers.classification_data(5)
        model = helpers.mlp()
        want = _brute_force_norms(model, helpers.LOSS, 2.0 * x, y)
        private = _private(model, augment=_double, augmult=2)
        got = tf_dpadam.per_example_gradient_norms(private, x, y)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        # Without the views the norms differ: the test sees them.
        plain = _brute_force_norms(model, helpers.LOSS, x, y)
        self.assertGreater(np.max(np.abs(plain - want) / want), 1e-3)

    @pytest.mark.slow
    def test_task_model_on_strings(self):
        model = helpers.tiny_bert_classifier(seed=0)
        sentences = np.array(["the movie was good", "bad film",
                              "a great story", "terrible acting", "story"])
        labels = np.array([1, 0, 1, 0, 1])
        token_ids, _, _ = keras.utils.unpack_x_y_sample_weight(
            model.preprocessor(tf.constant(sentences)))
        want = _brute_force_norms(
            model, helpers.LOSS,
            {k: v.numpy() for k, v in token_ids.items()}, labels)
        got = tf_dpadam.per_example_gradient_norms(
            _private(model), sentences, labels, batch_size=2)
        np.testing.assert_allclose(got, want, rtol=1e-4)

    def test_bad_input_raises(self):
        x, y = helpers.classification_data(4)
        model = helpers.mlp()
        with self.assertRaisesRegex(ValueError, "make_private"):
            tf_dpadam.per_example_gradient_norms(model, x, y)
        private = tf_dpadam.make_private(model)
        with self.assertRaisesRegex(ValueError, "compile"):
            tf_dpadam.per_example_gradient_norms(private, x, y)
        private = _private(model)
        with self.assertRaisesRegex(ValueError, "batch_size"):
            tf_dpadam.per_example_gradient_norms(private, x, y,
                                                 batch_size=0)
        with self.assertRaisesRegex(ValueError, "Expected x"):
            tf_dpadam.per_example_gradient_norms(private, iter([x]))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
        with self.assertRaisesRegex(ValueError, "batch_size"):
            tf_dpadam.per_example_gradient_norms(private, dataset,
                                                 batch_size=2)


if __name__ == "__main__":
    absltest.main()
