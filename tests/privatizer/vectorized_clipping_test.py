"""The vectorized path against ghost clipping on a multi-output model."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.privatizer import clipping
from tf_dpadam.privatizer import dp_math
from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.privatizer import vectorized_clipping

import helpers

_SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class VectorizedClippingTest(parameterized.TestCase):
    """Ghost clipping of a `make_private` model = its vectorized path."""

    @pytest.mark.slow
    def test_matches_private_model_per_example_path(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(
            8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)
        )(inputs)
        outputs = {
            "a": keras.layers.Dense(3, name="a")(h),
            "b": keras.layers.Dense(1, name="b")(h),
        }
        model = tf_dpadam.make_private(keras.Model(inputs, outputs), seed=0)
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0),
            loss={"a": _SCCE, "b": "mse"}, loss_weights={"a": 1.0, "b": 0.5},
        )
        x = helpers.normal((helpers.BATCH, 6))
        y = {"a": helpers.rng().integers(0, 3, size=helpers.BATCH),
             "b": helpers.normal((helpers.BATCH, 1), seed=1)}
        weights = np.linspace(0.5, 2.0, helpers.BATCH).astype("float32")
        weights[2] = 0.0
        mask = (weights != 0).astype("float32")

        @tf.function
        def vectorized(x, y, w):
            grads, losses, _ = vectorized_clipping.per_example_gradients(
                model, x, y, w)
            norms = dp_math.per_example_global_norms(grads)
            clip = tf.sort(norms)[helpers.BATCH // 2]
            summed, _ = clipping.clip_and_sum(grads, clip, mask=mask)
            return summed, norms, losses, clip

        summed, norms, losses, clip = vectorized(x, y, weights)
        loss_fn = ghost_clipping.compiled_loss_fn(model)

        @tf.function
        def ghost(x, y, w):
            return ghost_clipping.clipped_gradient_sum(
                model, loss_fn, x, y, w, clip, mask=mask
            )

        ghost_summed, ghost_norms, ghost_losses, _ = ghost(x, y, weights)
        np.testing.assert_allclose(ghost_norms, norms, rtol=2e-5)
        np.testing.assert_allclose(ghost_losses, losses, rtol=2e-5)
        for a, b in zip(ghost_summed, summed):
            np.testing.assert_allclose(a, b, rtol=5e-5, atol=1e-6)

    def test_dropout_masks_differ_between_examples(self):
        inputs = keras.Input((32,))
        dropped = keras.layers.Dropout(0.5)(inputs)
        outputs = keras.layers.Dense(
            1, use_bias=False, kernel_initializer="ones"
        )(dropped)
        model = tf_dpadam.make_private(keras.Model(inputs, outputs), seed=0)
        model.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0),
            loss="mse",
        )
        x = np.ones((8, 32), "float32")
        y = np.zeros((8, 1), "float32")

        @tf.function
        def per_example_kernel_grads():
            grads, _, _ = vectorized_clipping.per_example_gradients(
                model, x, y, None
            )
            return tf.cast(tf.not_equal(grads[0][:, :, 0], 0), tf.int32)

        first = per_example_kernel_grads().numpy()
        # Each example's gradient shows its own mask: they must not all agree.
        self.assertGreater(len({row.tobytes() for row in first}), 4)
        # And the masks change from one step to the next.
        second = per_example_kernel_grads().numpy()
        self.assertFalse(np.array_equal(first, second))


if __name__ == "__main__":
    absltest.main()
