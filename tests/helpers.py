"""Fixtures shared by the test files: small data, small models, seeds."""

import random

import keras
import numpy as np
import tensorflow as tf

from tf_dpadam import dp_math
from tf_dpadam import ghost_clipping
from tf_dpadam import keras_internals
from tf_dpadam import privatizer

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def classification_data(n, d=6, classes=3, seed=0):
    """`n` standard-normal float32 rows of width `d` and integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


def mlp(d=6, classes=3, hidden=8, seed=0, kernel_regularizer=None):
    """Dense(hidden, tanh) -> Dense(classes) logits, seeded."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((d,)),
        keras.layers.Dense(hidden, activation="tanh",
                           kernel_regularizer=kernel_regularizer),
        keras.layers.Dense(classes),
    ])


def numpy_values(variables):
    """The current values of Keras variables (or tensors) as NumPy arrays."""
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def seed_everything(seed):
    """What scripts do: every global seed there is."""
    keras.utils.set_random_seed(seed)
    tf.random.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# Ghost clipping in lockstep with explicit per-example clipping.

BATCH = 8
MSE = keras.losses.MeanSquaredError()


def rng(seed=0):
    return np.random.default_rng(seed)


def normal(shape, seed=0):
    """Standard-normal float32 values."""
    return rng(seed).normal(size=shape).astype("float32")


def sequential(input_shape, *layers, seed=0, dtype="float32"):
    """`keras.Sequential([keras.Input(input_shape), *layers])`, seeded."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input(input_shape, dtype=dtype), *layers]
    )


def reference_per_example_gradients(model, loss, x, y, sample_weight=None):
    """Explicit per-example gradients (vectorized map over one example)."""
    variables = model.trainable_variables

    def example_loss(x1, y1, w1):
        pred = model(x1, training=True)
        value = loss(y1, pred, sample_weight=w1)
        for extra in model.losses:
            value = value + keras.ops.sum(extra)
        return value, pred

    @tf.function
    def run(x, y, w):
        grads, losses, _ = privatizer.per_example_gradients(
            example_loss, variables, (x, y, w)
        )
        return grads, losses

    return run(x, y, sample_weight)


def ghost_clipped_sum(model, x, y, sample_weight, clip, mask, jit,
                      dynamic_batch=False):
    """`ghost_clipping.clipped_gradient_sum` in a `tf.function`."""
    loss_fn = ghost_clipping.compiled_loss_fn(model)

    @tf.function(jit_compile=jit)
    def run(x, y, w, mask):
        return ghost_clipping.clipped_gradient_sum(
            model, loss_fn, x, y, w, clip, mask=mask
        )

    args = (x, y, sample_weight, mask)
    if dynamic_batch:
        # Traced with an unknown batch size, as Keras does after a batch of
        # another size.
        run = run.get_concrete_function(*tf.nest.map_structure(
            lambda t: t if t is None
            else tf.TensorSpec([None, *t.shape[1:]], t.dtype), args
        ))
    return run(*args)


class GhostLockstepMixin:
    """`assert_lockstep` and `assert_kinds` for `absltest.TestCase`s."""

    def assert_lockstep(self, model, x, y, loss=MSE, sample_weight=None,
                        mask=None, jit=False, clip=None, dynamic_batch=False):
        """Ghost == explicit clipping, with about half the examples clipped.

        Returns the ghost norms.
        """
        if keras_internals.compile_loss(model) is None:
            model.compile(loss=loss)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        y = tf.convert_to_tensor(y)
        if sample_weight is not None:
            sample_weight = tf.convert_to_tensor(sample_weight)
        grads, losses = reference_per_example_gradients(
            model, loss, x, y, sample_weight
        )
        norms = dp_math.per_example_global_norms(grads).numpy()
        if clip is None:
            # Clip roughly half of the examples and leave the others alone.
            clip = float(np.median(norms)) * 1.0001
        self.assertGreater(np.sum(norms > clip), 0)
        self.assertGreater(np.sum(norms < clip), 0)
        expected, _ = privatizer.clip_and_sum(grads, clip, mask=mask)
        if mask is not None:
            mask = tf.convert_to_tensor(mask, "float32")
        summed, ghost_norms, ghost_losses, y_pred = ghost_clipped_sum(
            model, x, y, sample_weight, clip, mask, jit, dynamic_batch
        )
        np.testing.assert_allclose(ghost_norms, norms, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ghost_losses, losses, rtol=2e-5, atol=1e-6)
        self.assertEqual(len(summed), len(model.trainable_variables))
        scale = max(float(np.max(np.abs(e))) for e in expected)
        for variable, got, want in zip(
            model.trainable_variables, summed, expected
        ):
            self.assertEqual(tuple(got.shape), tuple(variable.shape))
            np.testing.assert_allclose(
                got, want, rtol=5e-5, atol=5e-6 * scale, err_msg=variable.path
            )
        self.assertEqual(
            tuple(y_pred.shape), tuple(model(x, training=False).shape)
        )
        return ghost_norms

    def assert_kinds(self, model, **expected):
        """`describe(model)[name]` starts with each expected kind."""
    
        described = ghost_clipping.describe(model)
        for name, kind in expected.items():
            self.assertTrue(
                described[name].startswith(kind), (name, described[name])
            )
