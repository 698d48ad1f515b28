"""The one-time cost of the independence guard (`tf_dpadam.independence`).

    PYTHONPATH=. python benchmarks/guard_cost.py

For a small MLP (B = 256, 20 features) and the paper's CNN on 28x28x1
inputs (B = 256), prints the seconds of `independence.check` on a fresh
model (eager, cold) and of the first `fit` step (trace and step included)
with the guard on and off; the difference is what the guard adds once.
"""

import time

import keras
import numpy as np
import tensorflow as tf
from absl import app

import tf_dpadam
from research import models
from tf_dpadam import independence

BATCH = 256


def _mlp():
    return keras.Sequential([
        keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def _cnn():
    return models.make_cnn((28, 28, 1), 10)


def _private(build, check_independence):
    keras.utils.set_random_seed(0)
    private = tf_dpadam.make_private(
        build(), seed=0, check_independence=check_independence)
    private.compile(
        optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                  batch_size=BATCH, learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return private


def _data(shape):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH,) + shape).astype("float32")
    y = rng.integers(0, 10, BATCH)
    return x, y


def _seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name, build, shape):
    x, y = _data(shape)
    data = (tf.constant(x), tf.constant(y))
    private = _private(build, True)
    check = _seconds(lambda: independence.check(private, data))
    dataset = tf.data.Dataset.from_tensors((x, y))
    first_step = {}
    for on in (False, True):
        private = _private(build, on)
        first_step[on] = _seconds(
            lambda: private.fit(dataset, epochs=1, verbose=0))
    print(f"{name}: independence.check {check:.2f} s; first fit step"
          f" {first_step[True]:.2f} s with the guard,"
          f" {first_step[False]:.2f} s without")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    measure("MLP 20-64-64-10, B=256", _mlp, (20,))
    measure("paper CNN 28x28x1, B=256", _cnn, (28, 28, 1))


if __name__ == "__main__":
    app.run(main)
