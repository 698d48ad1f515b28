"""The cost of correlated noise alone: one step's draw, then its correlation.

`benchmarks/benchmark.py --configs=banded` times whole DP steps of the
paper's CNN with b = 1, 4 and 8 bands, but on this shared machine a step
(0.4-0.7 s) varies by more than the correlation costs. This times the part
that b changes, in isolation: drawing the independent noise of the CNN's
trainable weights (Philox, as the step does), then, for b > 1, the
recursion w_t = (z_t - sum_j m_j w_{t-j}) / m_0 over the secret history
(`correlated_noise.correlate` and `noise_history.NoiseHistory`), in one
`tf.function`, as milliseconds per step (mean of `--steps` calls after a
warm-up).

    PYTHONPATH=src python benchmarks/correlated_noise_cost.py
"""

import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from tf_dpadam.privatizer import correlated_noise
from tf_dpadam.training import noise_history

flags.DEFINE_list("bands", ["1", "4", "8"], "Bands to time.")
flags.DEFINE_integer("steps", 200, "Timed calls per setting.")
FLAGS = flags.FLAGS

# The trainable weights of the paper's Fashion-MNIST CNN (benchmark.py's
# "cnn"): 287,722 numbers.
SHAPES = ((3, 3, 1, 32), (32,), (3, 3, 32, 32), (32,), (3, 3, 32, 64),
          (64,), (3, 3, 64, 64), (64,), (3, 3, 64, 128), (128,),
          (1152, 128), (128,), (128, 10), (10,))


def milliseconds_per_step(bands, steps):
    """Mean time of one draw (and correlation, for b > 1)."""
    strategy = correlated_noise.BandedToeplitz.bisr(bands)
    history = noise_history.NoiseHistory()

    @tf.function
    def step(seed):
        noise = [tf.random.stateless_normal(s, seed=seed, alg="philox")
                 for s in SHAPES]
        if bands > 1:
            state = history.state(strategy, SHAPES)
            noise, _, state = correlated_noise.correlate(strategy, noise,
                                                         state)
            history.assign(state)
        return tf.add_n([tf.reduce_sum(n) for n in noise])

    for i in range(5):
        step(tf.constant([1, i], tf.int64))
    start = time.perf_counter()
    for i in range(steps):
        step(tf.constant([1, i], tf.int64)).numpy()
    return (time.perf_counter() - start) / steps * 1000


def main(argv):
    del argv
    print(f"{int(sum(np.prod(s) for s in SHAPES)):,} noise coordinates")
    base = None
    for bands in map(int, FLAGS.bands):
        ms = milliseconds_per_step(bands, FLAGS.steps)
        base = ms if base is None else base
        print(f"b = {bands}: {ms:.2f} ms per step ({ms - base:+.2f} ms)")


if __name__ == "__main__":
    app.run(main)
