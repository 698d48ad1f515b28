"""Fixtures shared by the test files: small data, small models, seeds."""

import random

import keras
import numpy as np
import tensorflow as tf

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
