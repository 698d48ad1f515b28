"""Whole DP-AdamBC steps with correlated noise against one band, interleaved.

On this shared machine a step's time drifts with the load by more than
b bands change it, so `benchmark.py --configs=banded` (one process per
variant, one after the other) cannot resolve a 10% difference. This script
builds the paper's CNN once per b (`--bands`, the first is the reference)
in one process, warms each up, then runs `--rounds` rounds: in each, every
model takes `--steps` steps (`fit` on cyclic Poisson batches of the
repeated batch, which continue the noise's cycle), in an order rotated from
round to round. Per round it takes the CPU time (all threads) and the wall
time of each model's steps, divides them by the reference's of the same
round, and prints the median and the quartiles of those ratios: the load
of one round weighs on all the models of the round alike.

    PYTHONPATH=src:. python benchmarks/correlated_noise_steps.py

Memory: `benchmark.py --configs=banded` (a process per variant) measures
the peaks.
"""

import os
import resource
import statistics
import time

from absl import app
from absl import flags
import numpy as np

flags.DEFINE_list("bands", ["1", "4", "8"], "b of each model; the first is"
                  " the reference.")
flags.DEFINE_integer("batch", 256, "Examples per step (B).")
flags.DEFINE_integer("steps", 8, "Steps per model and round (a multiple of"
                     " every b).")
flags.DEFINE_integer("rounds", 15, "Rounds.")
flags.DEFINE_list("input_shape", ["28", "28", "1"], "The CNN's input"
                  " (Fashion-MNIST's).")
flags.DEFINE_bool("jit", False, "XLA.")
FLAGS = flags.FLAGS


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _model(bands, x, y):
    """A compiled private CNN with b = `bands` and its `steps(n)`."""
    import keras
    import tensorflow as tf

    import tf_dpadam
    from research import models
    from tf_dpadam.accounting import plans
    from tf_dpadam.data import sampling

    model = tf_dpadam.make_private(models.make_cnn(x.shape[1:], 10))
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=FLAGS.batch,
            noise_strategy=bands),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=FLAGS.jit)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()

    def steps(n):
        # Timing only: the repeated batch passes for cyclic Poisson batches
        # that continue the noise's cycle (fit refuses other data with
        # b > 1); no epsilon is read.
        sampling.register_poisson(dataset, plans.PoissonPlan(
            FLAGS.batch * 64, FLAGS.batch, 1, groups=bands,
            group_offset=model.noise_history.draws % bands))
        model.fit(dataset, steps_per_epoch=n, verbose=0)

    return steps


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    bands = [int(b) for b in FLAGS.bands]
    if any(FLAGS.steps % b for b in bands):
        raise ValueError(f"Expected --steps={FLAGS.steps} to be a multiple"
                         f" of every --bands {bands}.")
    shape = tuple(int(d) for d in FLAGS.input_shape)
    rng = np.random.default_rng(0)
    x = rng.random((FLAGS.batch, *shape), "float32")
    y = rng.integers(0, 10, FLAGS.batch)
    runners = {}
    for b in bands:
        runners[b] = _model(b, x, y)
        runners[b](2 * FLAGS.steps)  # Warm-up: traces, first steps.
    cpu = {b: [] for b in bands}
    wall = {b: [] for b in bands}
    for r in range(FLAGS.rounds):
        order = bands[r % len(bands):] + bands[:r % len(bands)]
        for b in order:
            cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
            runners[b](FLAGS.steps)
            cpu[b].append((_cpu_seconds() - cpu_start) / FLAGS.steps)
            wall[b].append((time.perf_counter() - wall_start) / FLAGS.steps)
    reference = bands[0]
    print(f"Paper CNN {shape}, B = {FLAGS.batch}, DP-AdamBC, jit="
          f"{FLAGS.jit}: {FLAGS.rounds} rounds of {FLAGS.steps} steps per"
          f" model; load average {os.getloadavg()[0]:.2f} at the end.")
    print("b  CPU s/step  wall s/step  CPU ratio (median [quartiles])"
          "  wall ratio (median [quartiles])")
    for b in bands:
        line = [f"{b:<2} {statistics.median(cpu[b]):10.4f}"
                f"  {statistics.median(wall[b]):11.4f}"]
        for times in (cpu, wall):
            ratios = [mine / theirs for mine, theirs
                      in zip(times[b], times[reference])]
            q1, q2, q3 = np.percentile(ratios, [25, 50, 75])
            line.append(f"  {q2:.3f} [{q1:.3f}, {q3:.3f}]")
        print("".join(line))


if __name__ == "__main__":
    app.run(main)
