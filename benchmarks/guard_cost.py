"""The cost of the independence guard (`tf_dpadam.independence`).

    PYTHONPATH=. python benchmarks/guard_cost.py [--steps=300] [--repeats=3]

For a small MLP (B = 256, 20 features) and the paper's CNN on 28x28x1
inputs (B = 256), graph mode, prints from one run:

* once: the first `fit` step (trace and step) with the guard on and off;
* a warm check (`model.independence_guard.check(batch)` once the probe is
  traced) against a step, and the steady-state cost that the check
  adds at the default rate (`rate * check / step`, per step);
* measured: the seconds per step of `--steps` steps with the guard on (at
  its default rate) and off, alternated `--repeats` times (means), and
  their ratio
  (noisy on a shared machine: the estimate above is the steadier number).
"""

import time

import keras
import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import tf_dpadam
from research import models

BATCH = 256

_STEPS = flags.DEFINE_integer("steps", 300, "Steps per timed fit.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed fits per setting.")


def _mlp():
    return keras.Sequential([
        keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def _cnn():
    return models.make_cnn((28, 28, 1), 10)


def _private(build, check_independence):
    keras.utils.set_random_seed(0)
    private = tf_dpadam.make_private(
        build(), check_independence=check_independence)
    private.compile(
        optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                  batch_size=BATCH, learning_rate=0.01),
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


def measure(name, build, shape, steps, repeats):
    x, y = _data(shape)
    one = tf.data.Dataset.from_tensors((x, y))
    many = one.repeat(steps)
    models_by_setting, first = {}, {}
    for on in (False, True):
        private = _private(build, on)
        first[on] = _seconds(lambda: private.fit(one, verbose=0))
        models_by_setting[on] = private
    guarded = models_by_setting[True]
    guard = guarded.independence_guard
    batch = (tf.constant(x), tf.constant(y))
    check = min(_seconds(lambda: guard.check(batch)) for _ in range(3))
    per_step = {False: [], True: []}
    for repeat in range(repeats):
        # Alternated, and in the other order every other time.
        for on in (False, True) if repeat % 2 == 0 else (True, False):
            per_step[on].append(_seconds(lambda: models_by_setting[on].fit(
                many, verbose=0)) / steps)
    off, on = np.mean(per_step[False]), np.mean(per_step[True])
    print(f"{name}:")
    print(f"  once: first fit step {first[True]:.2f} s with the guard,"
          f" {first[False]:.2f} s without")
    print(f"  warm check {check * 1e3:.1f} ms = {check / off:.1f} steps;"
          f" at rate {guard.rate:g} the guard adds"
          f" {100 * guard.rate * check / off:.2f}% per step")
    print(f"  measured: {on * 1e3:.2f} ms/step with the guard,"
          f" {off * 1e3:.2f} ms/step without, ratio {on / off:.3f}"
          f" (mean of {repeats} x {steps} steps, alternated;"
          f" {guard.checks} checks in all)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    measure("MLP 20-64-64-10, B=256", _mlp, (20,), _STEPS.value,
            _REPEATS.value)
    measure("paper CNN 28x28x1, B=256", _cnn, (28, 28, 1), _STEPS.value,
            _REPEATS.value)


if __name__ == "__main__":
    app.run(main)
