"""The fallback rule: layers without a ghost rule, exact by a vectorized map."""

import pytest
import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized
from keras import ops

from tf_dpadam.privatizer import ghost_clipping

import helpers


class FallbackTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @pytest.mark.slow
    def test_unsupported_layers_are_fallback_units(self):

        class Scale(keras.layers.Layer):
            """A layer with its own weights and no ghost rule."""

            def build(self, input_shape):
                self.scale = self.add_weight(
                    shape=input_shape[-1:], initializer="random_normal"
                )

            def call(self, x):
                return x * self.scale + ops.sin(x)

        keras.utils.set_random_seed(0)
        inputs = keras.Input((5, 3))
        h = keras.layers.LSTM(4, return_sequences=True, unroll=True,
                              name="lstm")(inputs)
        h = Scale(name="scale")(h)
        h = keras.layers.EinsumDense("abc,bc->ab", 5, name="odd_einsum")(h)
        model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
        self.assertTrue(ghost_clipping.supports(model))
        self.assert_kinds(model, lstm="fallback", scale="fallback",
                          odd_einsum="fallback", out="ghost")
        x, y = helpers.normal((helpers.BATCH, 5, 3)), helpers.normal((helpers.BATCH, 2), seed=1)
        self.assert_lockstep(model, x, y)

    def test_subclass_with_weights_the_rule_does_not_know(self):

        class WeightNormDense(keras.layers.Dense):
            """Dense whose kernel is g * v / ||v||: `call` is Dense's own."""

            def build(self, input_shape):
                super().build(input_shape)
                self._kernel.trainable = False
                self.v = self.add_weight(shape=self._kernel.shape,
                                         initializer="random_normal")
                self.g = self.add_weight(shape=(self.units,),
                                         initializer="ones")

            @property
            def kernel(self):
                return self.g * self.v / ops.norm(self.v, axis=0)

        keras.utils.set_random_seed(0)
        model = helpers.sequential(
            (4,), WeightNormDense(3, activation="tanh", name="normed"),
            keras.layers.Dense(2, name="out"),
        )
        # The Dense rule would take the kernel for a variable and drop the
        # gradients of v and g.
        self.assert_kinds(model, normed="fallback", out="ghost")
        x, y = helpers.normal((helpers.BATCH, 4)), helpers.normal((helpers.BATCH, 2), seed=1)
        self.assert_lockstep(model, x, y)

    def test_fallback_units_under_xla(self):
        # (Keras' LSTM loop does not compile with XLA inside a vectorized map,
        # in the vectorized path either.)
        keras.utils.set_random_seed(0)
        model = helpers.sequential(
            (5, 3), keras.layers.Dense(4, name="in"),
            keras.layers.EinsumDense("abc,bc->ab", 5, name="odd_einsum"),
            keras.layers.Dense(2, name="out"),
        )
        self.assert_kinds(model, odd_einsum="fallback", out="ghost")
        x, y = helpers.normal((helpers.BATCH, 5, 3)), helpers.normal((helpers.BATCH, 2), seed=1)
        self.assert_lockstep(model, x, y, jit=True)

    def test_random_fallback_unit_is_refused(self):
        model = helpers.sequential(
            (5, 3), keras.layers.LSTM(4, dropout=0.5), keras.layers.Dense(2)
        )
        model.compile(loss=helpers.MSE)
        with self.assertRaisesRegex(
            ghost_clipping.GhostClippingUnsupportedError, "random"
        ):
            ghost_clipping.clipped_gradient_sum(
                model, ghost_clipping.compiled_loss_fn(model),
                helpers.normal((helpers.BATCH, 5, 3)), helpers.normal((helpers.BATCH, 2)), None, 1.0,
            )

    def test_dropout_between_ghost_layers_is_allowed(self):
        model = helpers.sequential(
            (16,), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dropout(0.5), keras.layers.Dense(2),
        )
        model.compile(loss=helpers.MSE)
        loss_fn = ghost_clipping.compiled_loss_fn(model)
        run = tf.function(
            lambda x, y: ghost_clipping.clipped_gradient_sum(model, loss_fn, x, y,
                                                    None, 0.1)
        )
        x, y = helpers.normal((helpers.BATCH, 16)), helpers.normal((helpers.BATCH, 2), seed=1)
        first = run(x, y)
        second = run(x, y)
        self.assertFalse(np.allclose(first[1], second[1]))  # new masks
        total = np.sqrt(sum(np.sum(np.square(g)) for g in first[0]))
        self.assertLessEqual(total, helpers.BATCH * 0.1 * (1 + 1e-5))


if __name__ == "__main__":
    absltest.main()
