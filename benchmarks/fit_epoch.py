"""Epoch time of `fit` on arrays: Poisson batches (the default) vs shuffled.

    python -m benchmarks.fit_epoch                       # the paper's CNN
    python -m benchmarks.fit_epoch --cnn=small --epochs=3 --jit=true

A private model's `fit` on in-memory data draws Poisson batches
(`tf_dpadam.training.private_fit`): the expected batch size B, each step's rows
gathered by NumPy and padded (graphs: to the next multiple of 8 rows; XLA:
to the static capacity M). Before, `fit` took Keras' shuffled batches of
exactly B, which the accounting cannot amplify. This script trains the same
model on Fashion-MNIST-shaped data (N examples of 28x28x1) both ways in one
process, alternating the two after one warm-up epoch each (tracing), and
prints the median epoch time of each and their ratio (Poisson / shuffled).
The number of steps per epoch is the same (ceil(N / B)); the Poisson steps
hold B examples on average.
"""

import statistics
import time

from absl import app
from absl import flags
import keras
import numpy as np

import tf_dpadam
from research import models

flags.DEFINE_integer("num_examples", 12800, "N.")
flags.DEFINE_integer("batch_size", 256, "B.")
flags.DEFINE_integer("epochs", 3, "Timed epochs of each path (alternating).")
flags.DEFINE_enum("cnn", "paper", ["paper", "small"], "The model.")
flags.DEFINE_bool("jit", False, "XLA (jit_compile).")

FLAGS = flags.FLAGS


def _model():
    keras.utils.set_random_seed(0)
    if FLAGS.cnn == "small":
        base = models.make_small_cnn((28, 28, 1), 10)
    else:
        base = models.make_cnn((28, 28, 1), 10)
    model = tf_dpadam.make_private(base)
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0,
            batch_size=FLAGS.batch_size, learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], jit_compile=FLAGS.jit)
    return model


def _epoch_seconds(model, x, y, sampling):
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0,
              sampling=sampling)
    return time.perf_counter() - start


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    x = rng.random((FLAGS.num_examples, 28, 28, 1), "float32")
    y = rng.integers(0, 10, FLAGS.num_examples)
    samplings = ("poisson", "shuffled")
    trained = {s: _model() for s in samplings}
    for sampling in samplings:  # Warm-up: tracing.
        _epoch_seconds(trained[sampling], x, y, sampling)
    times = {s: [] for s in samplings}
    for epoch in range(FLAGS.epochs):
        order = samplings if epoch % 2 == 0 else samplings[::-1]
        for sampling in order:
            times[sampling].append(
                _epoch_seconds(trained[sampling], x, y, sampling))
    steps = -(-FLAGS.num_examples // FLAGS.batch_size)
    for sampling in samplings:
        median = statistics.median(times[sampling])
        print(f"{sampling:>8}: median epoch {median:.2f} s"
              f" ({steps} steps; epochs {[round(t, 2) for t in times[sampling]]})")
    ratio = (statistics.median(times["poisson"])
             / statistics.median(times["shuffled"]))
    print(f"ratio Poisson / shuffled epoch time: {ratio:.3f}"
          f" (cnn={FLAGS.cnn}, jit={FLAGS.jit}, N={FLAGS.num_examples},"
          f" B={FLAGS.batch_size})")


if __name__ == "__main__":
    app.run(main)
