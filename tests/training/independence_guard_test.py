"""Tests of `tf_dpadam.independence.guard` and `probe`: when the guard checks,
that checking changes nothing in training, and what it sees that the
outputs do not (a gradient that mixes, a mixing that starts later).

Which models it refuses and accepts: sensitivity_zoo_test (refusals, with
the measured remove-one sensitivity), guard_misses_test (the mixing that the
first guard missed), guard_corpus_test (models shaped like keras.io's and
keras-hub's, none refused, each step exact).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized
from keras import ops

import tf_dpadam
from tf_dpadam.training import independence

B = 8


def _data(seed=1, n=B):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 6)).astype("float32"),
            rng.integers(0, 3, n))


class MixesFromStep(keras.layers.Layer):
    """Per-example for its first `start` calls in training, then centers
    the batch (a model whose mixing the first check cannot see)."""

    def __init__(self, start, **kwargs):
        super().__init__(**kwargs)
        self.start = start
        self.calls = self.add_weight(shape=(), initializer="zeros",
                                     trainable=False, name="calls")

    def call(self, x, training=False):
        if not training:
            return x
        self.calls.assign_add(1.0)
        centered = x - ops.mean(x, axis=0, keepdims=True)
        return ops.where(self.calls > self.start, centered, x)


def _rezero():
    """h + Dense_0(h - batch mean of h), the Dense zero-initialized
    (ReZero / LayerScale style): the outputs do not mix until its kernel
    moves, its per-example gradient (centered h_i times delta_i) does at
    once."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    centered = keras.layers.Lambda(
        lambda t: t - ops.mean(t, axis=0, keepdims=True))(h)
    scaled = keras.layers.Dense(8, use_bias=False,
                                kernel_initializer="zeros")(centered)
    return keras.Model(inputs, keras.layers.Dense(3)(
        keras.layers.Add()([h, scaled])))


def _model(*middle, dropout=0.0):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
              *middle]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    return keras.Sequential(layers + [keras.layers.Dense(3)])


def _private(model, rate=None, jit_compile=False, clipping="auto",
             noise_multiplier=0.0, learning_rate=0.1, loss=None):
    private = tf_dpadam.make_private(model, seed=0, clipping=clipping)
    if rate is not None:
        private.independence_guard.rate = rate
    private.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
            batch_size=B, learning_rate=learning_rate),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(
            from_logits=True),
        jit_compile=jit_compile)
    return private


def _dataset(steps, seed=1):
    x, y = _data(seed, B * steps)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(B)


class ScheduleTest(parameterized.TestCase):

    @pytest.mark.slow
    def test_first_call_only_at_rate_zero(self):
        private = _private(_model(), rate=0.0)
        private.fit(_dataset(4), verbose=0)
        self.assertEqual(private.independence_guard.checks, 1)
        private.fit(_dataset(4), verbose=0)
        self.assertEqual(private.independence_guard.checks, 1)

    @pytest.mark.slow
    def test_every_call_at_rate_one(self):
        private = _private(_model(), rate=1.0)
        private.fit(_dataset(4), verbose=0)
        self.assertEqual(private.independence_guard.checks, 4)

    def test_default_rate_is_documented_and_small(self):
        private = _private(_model())
        self.assertEqual(private.independence_guard.rate,
                         independence.CHECK_RATE)
        self.assertEqual(independence.CHECK_RATE, 0.01)

    @pytest.mark.slow
    def test_checked_again_after_compile_with_another_loss(self):
        private = _private(_model(), rate=0.0)
        private.fit(_dataset(2), verbose=0)
        private.compile(
            optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0,
                                      batch_size=B, learning_rate=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        private.fit(_dataset(2), verbose=0)
        self.assertEqual(private.independence_guard.checks, 2)

    @pytest.mark.slow
    def test_a_later_mixing_step_is_refused_when_checked(self):
        # The layer mixes from its 3rd training call on: the first check
        # passes; at rate 1 a later call is checked and refused before it
        # trains.
        private = _private(_model(MixesFromStep(2, name="later")), rate=1.0)
        with self.assertRaisesRegex(ValueError, "'later'.*mixes"):
            private.fit(_dataset(6), verbose=0)
        self.assertLess(int(private.optimizer.iterations), 6)
        # At rate 0 the same model trains its 6 steps: what the random
        # later checks are for.
        unchecked = _private(_model(MixesFromStep(2)), rate=0.0)
        unchecked.fit(_dataset(6), verbose=0)
        self.assertEqual(int(unchecked.optimizer.iterations), 6)

    @pytest.mark.slow
    def test_changed_trainable_weights_warn_once(self):
        model = _model()
        private = _private(model, rate=0.0)
        private.fit(_dataset(2), verbose=0)
        model.layers[0].trainable = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            private.fit(_dataset(2), verbose=0)
            private.fit(_dataset(2), verbose=0)
        found = [w for w in caught
                 if "trainable weights changed" in str(w.message)]
        self.assertLen(found, 1)
        # And the changed set is checked (a new key).
        self.assertEqual(private.independence_guard.checks, 2)


class CheckingChangesNothingTest(parameterized.TestCase):

    @parameterized.parameters(False, True)
    @pytest.mark.slow
    def test_weights_equal_with_and_without_checks(self, jit_compile):
        # Dropout, noise and a check at every call: the guard restores
        # every random state, so the trajectory is the unchecked one.
        trained = []
        for check in (True, False):
            private = tf_dpadam.make_private(
                _model(dropout=0.3), seed=0, check_independence=check)
            if check:
                private.independence_guard.rate = 1.0
            private.compile(
                optimizer=tf_dpadam.DPAdamCorrected(
                    l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=B,
                    learning_rate=0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=jit_compile)
            private.fit(_dataset(3), verbose=0)
            if check:
                self.assertEqual(private.independence_guard.checks, 3)
            trained.append([np.asarray(w) for w in private.get_weights()])
        for a, b in zip(*trained):
            np.testing.assert_array_equal(a, b)


class WhatTheOutputsDoNotShowTest(parameterized.TestCase):

    @parameterized.parameters(("auto", False), ("ghost", True))
    @pytest.mark.slow
    def test_a_gradient_that_mixes_is_refused(self, clipping, jit_compile):
        # ReZero around batch centering: at 0 the outputs and the losses
        # are per-example, the scale's gradient is not.
        private = _private(_rezero(), clipping=clipping,
                           jit_compile=jit_compile)
        with self.assertRaisesRegex(
                ValueError, "gradient norm.*changed.*replaced by copies"
                ".*zero-initialized scale"):
            private.train_on_batch(*_data())

    @pytest.mark.slow
    def test_vectorized_rezero_is_private_and_accepted(self):
        # On the vectorized path each example's gradient is that of a batch
        # of one, where the centered h is 0: nothing mixes, nothing is
        # refused.
        private = _private(_rezero(), clipping="vectorized")
        private.train_on_batch(*_data())
        self.assertEqual(private.independence_guard.checks, 1)

    @pytest.mark.slow
    def test_one_example_batches_warn_and_check_later(self):
        private = _private(_model())
        x, y = _data()
        with self.assertWarnsRegex(UserWarning, "could not check"):
            private.train_on_batch(np.repeat(x[:1], B, 0),
                                   np.repeat(y[:1], B, 0))
        self.assertEqual(private.independence_guard.checks, 0)
        private.train_on_batch(x, y)
        self.assertEqual(private.independence_guard.checks, 1)

    @pytest.mark.slow
    def test_probability_heads_are_checked_as_values(self):
        # The false alarm of the first guard: Keras computes a probability
        # loss from the logits hidden on a softmax's output, which copies
        # lose. Saturated logits made it "1e13 times the tolerance".
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(10, activation="softmax",
                               kernel_initializer=keras.initializers
                               .RandomNormal(stddev=30.0))])
        private = _private(model, loss="sparse_categorical_crossentropy")
        private.train_on_batch(*_data())
        self.assertEqual(private.independence_guard.checks, 1)


if __name__ == "__main__":
    absltest.main()
