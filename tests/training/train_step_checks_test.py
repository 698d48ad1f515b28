"""Issue 34: the private train step where plain Keras has its own answer.

* No gradient path from the loss to any trainable weight (an integer cast in
  the last layer): Keras refuses ("No gradients provided for any
  variable"); the private step trained 10 steps on noise alone. It must
  refuse before any step, naming the weights.
* Nothing trainable: Keras logs the batch's loss (1.14 in the issue) where
  the private step logged 0.0. The reference here is NumPy's mean squared
  error of the frozen model's predictions.
"""

import contextlib
from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadam
from tf_dpadam.training import train_step_checks

N, B = 32, 8


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, 3)).astype("float32"),
            rng.normal(size=(N, 1)).astype("float32") + 1.0)


class _IntegerCast(keras.layers.Layer):
    """Rounds through int32: a value, and no gradient."""

    def call(self, x):
        return tf.cast(tf.cast(x, tf.int32), x.dtype)


def _base(kind):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    if kind == "dropout":
        hidden = keras.layers.Dropout(0.5)(hidden)
    out = keras.layers.Dense(1, name="out")(hidden)
    if kind == "cast":
        out = _IntegerCast()(out)
    elif kind == "half_cast":
        # One branch cut, the other differentiable: trainable, as in Keras.
        side = keras.layers.Dense(1, name="side")(inputs)
        out = keras.layers.Add()([_IntegerCast()(out), side])
    return keras.Model(inputs, out)


def _private(base, clipping="auto", **compile_kwargs):
    model = tf_dpadam.make_private(base, clipping=clipping)
    model.compile(optimizer=tf_dpadam.DPSGD(
        l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=B,
        learning_rate=0.1), loss="mse", **compile_kwargs)
    return model


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


class NoGradientPathTest(parameterized.TestCase):

    @parameterized.product(clipping=["auto", "vectorized"],
                           run_eagerly=[False, True],
                           how=["fit", "train_on_batch"])
    @pytest.mark.slow
    def test_refused_before_any_step(self, clipping, run_eagerly, how):
        keras.utils.set_random_seed(0)
        model = _private(_base("cast"), clipping, run_eagerly=run_eagerly)
        x, y = _data()
        before = _weights(model)
        with self.assertRaisesRegex(
                ValueError,
                r"No gradients provided for any variable: the loss of model"
                r" .* has no gradient path to any of its 4 trainable weights"
                r" \(hidden/kernel, hidden/bias, out/kernel, out/bias\)"):
            if how == "fit":
                model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                          sampling="shuffled")
            else:
                model.train_on_batch(x[:B], y[:B])
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)
        for got, want in zip(_weights(model), before):
            np.testing.assert_array_equal(got, want)

    @pytest.mark.slow
    def test_refused_under_xla_too(self):
        model = _private(_base("cast"), jit_compile=True)
        x, y = _data()
        with self.assertRaisesRegex(ValueError, "No gradients provided"):
            model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                      sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations.numpy()), 0)

    def test_keras_refuses_the_same_model(self):
        # The behaviour we match: plain Keras on the same architecture.
        base = _base("cast")
        base.compile(optimizer="sgd", loss="mse")
        x, y = _data()
        with self.assertRaisesRegex(ValueError, "No gradients provided"):
            base.fit(x, y, batch_size=B, epochs=1, verbose=0)

    @pytest.mark.slow
    def test_a_partly_cut_model_trains(self):
        keras.utils.set_random_seed(0)
        model = _private(_base("half_cast"))
        x, y = _data()
        before = _weights(model)
        model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                  sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations.numpy()), N // B)
        self.assertFalse(all(np.array_equal(a, b) for a, b
                             in zip(_weights(model), before)))

    @parameterized.parameters("plain", "dropout")
    @pytest.mark.slow
    def test_a_differentiable_model_is_unchanged(self, kind):
        # The check traces in a graph of its own (no random state drawn,
        # nothing run): the weights after an epoch are those of a model
        # whose check is skipped (same seeds).
        x, y = _data()
        results = []
        for check in (True, False):
            keras.utils.set_random_seed(0)
            model = tf_dpadam.make_private(_base(kind), seed=3)
            model.compile(optimizer=tf_dpadam.DPSGD(
                l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=B,
                learning_rate=0.1), loss="mse")
            skip = mock.patch.object(train_step_checks,
                                     "check_gradient_path")
            with contextlib.ExitStack() as stack, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not check:
                    stack.enter_context(skip)
                model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                          sampling="shuffled", shuffle=False)
            results.append(_weights(model))
        for got, want in zip(*results):
            np.testing.assert_array_equal(got, want)


class NothingTrainableTest(parameterized.TestCase):

    @parameterized.parameters(False, True)
    @pytest.mark.slow
    def test_logs_the_loss_as_keras_does(self, run_eagerly):
        keras.utils.set_random_seed(0)
        base = _base("plain")
        base.trainable = False
        model = _private(base, run_eagerly=run_eagerly)
        x, y = _data()
        with self.assertWarnsRegex(UserWarning, "any trainable weights"):
            history = model.fit(x, y, batch_size=N, epochs=1, verbose=0,
                                sampling="shuffled")
        expected = float(np.mean((base.predict(x, verbose=0) - y) ** 2))
        self.assertGreater(expected, 0.5)
        self.assertAlmostEqual(history.history["loss"][0], expected,
                               places=5)
        # Keras' own fit of the same frozen model logs the same loss.
        base.compile(optimizer="sgd", loss="mse")
        keras_history = base.fit(x, y, batch_size=N, epochs=1, verbose=0)
        self.assertAlmostEqual(history.history["loss"][0],
                               keras_history.history["loss"][0], places=5)


if __name__ == "__main__":
    absltest.main()
