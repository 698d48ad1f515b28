"""Audits a DP training run from the outside, in one run (Steinke et al. 2023).

    python -m examples.audit                         # the real privatizer
    python -m examples.audit --break=no_noise        # must be caught: L > E
    python -m examples.audit --canaries=input        # black-box, mislabeled

Trains the paper's CNN on a Fashion-MNIST subset with m canaries, each
included with probability 1/2, guesses their inclusion from their scores
(`tf_dpadam.audit`), and prints as its last line

    audit: epsilon lower bound L (95% confidence) vs claimed epsilon E

E is the accountant's epsilon of the run (q, sigma, T, delta). L <= E is
consistent with the claim (not a proof of it); L > E means the run leaked
more than claimed. --canaries=gradient (white-box): Dirac gradients of norm
--canary_norm * C added to the clipped sum with the data's rate q;
--canaries=input (black-box): mislabeled test images in the training data.
--break=no_noise|no_clipping BREAKS the privatizer: such a run is NOT private.
"""

import gzip
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

import tf_dpadam  # TensorFlow loads on first use (--help needs none).
from tf_dpadam.common import command_line
from tf_dpadam.optimizers import registry

# --optimizer: tf_dpadam's registered names (and classes); learning rates.
OPTIMIZERS = registry.class_names()
LEARNING_RATES = dict.fromkeys(OPTIMIZERS, 1e-3) | {"dpsgd": 4.0}
BREAKS = ["none", "no_noise", "no_clipping"]  # tf_dpadam.audit.BREAKS
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's package.

flags.DEFINE_float("noise_multiplier", 2.0, "sigma.", lower_bound=0)
flags.DEFINE_float("l2_norm_clip", 1.0, "C, the per-example clip norm.")
flags.DEFINE_integer("batch_size", 50, "B, the expected batch size.",
                     lower_bound=1)
flags.DEFINE_integer("train_size", 2000, "N, the training examples.",
                     lower_bound=1)
flags.DEFINE_integer("steps", 400, "T, the DP steps.", lower_bound=1)
flags.DEFINE_enum("optimizer", "dpadam_corrected", list(OPTIMIZERS),
                  ", ".join(OPTIMIZERS.values()) + ".")
flags.DEFINE_float("learning_rate", None, "Default: 4 (dpsgd), 1e-3 (others).")
flags.DEFINE_integer("num_canaries", 1000, "m, the canaries.", lower_bound=1)
flags.DEFINE_integer("num_guesses", 200, "r: guess 'included' for the r/2"
                     " highest scores, 'excluded' for the r/2 lowest.",
                     lower_bound=1)
flags.DEFINE_enum("canaries", "gradient", ["gradient", "input"],
                  "White-box Dirac gradients, or mislabeled test images.")
flags.DEFINE_float("canary_norm", 10.0, "A gradient canary's norm / C.",
                   lower_bound=1)
flags.DEFINE_enum("score", "gradients", ["gradients", "movement"],
                  "Gradient canaries' score: the privatized gradients' sum"
                  " along the canary, or its weight's movement.")
flags.DEFINE_enum("break", "none", BREAKS, "Break the privatizer"
                  " (NOT private; for testing the auditor only).")
flags.DEFINE_float("delta", 1e-5, "delta of the claim.")
flags.DEFINE_float("confidence", 0.95, "Confidence of the lower bound.")
flags.DEFINE_integer("max_test_examples", None, "Measure the accuracy on the"
                     " first this many test images (default: all).",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "Model initialization and data subset.")
flags.DEFINE_integer("canary_seed", None, "Seed of the canaries (default:"
                     " fresh each run).")
flags.DEFINE_string("data_dir", FASHION_MNIST_DIR, "Fashion-MNIST's folder.")
FLAGS = flags.FLAGS


def load_fashion_mnist(folder):
    """`((x, y), (x_test, y_test))` from the gzipped IDX files in `folder`:
    float32 images in [0, 1] of shape (N, 28, 28, 1), int32 labels."""
    arrays = []
    for name in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3",
                 "t10k-labels-idx1"):
        with gzip.open(os.path.join(folder, f"{name}-ubyte.gz")) as f:
            data = f.read()
        shape = np.frombuffer(data, ">u4", data[3], offset=4)
        arrays.append(np.frombuffer(data, np.uint8,
                                    offset=4 + 4 * data[3]).reshape(shape))
    x, y, x_test, y_test = arrays
    return ((x[..., None] / np.float32(255), y.astype("int32")),
            (x_test[..., None] / np.float32(255), y_test.astype("int32")))


def make_cnn(input_shape, num_classes):
    """The paper's 5-layer tanh CNN (see examples/train_image.py)."""
    import keras  # pylint: disable=g-import-not-at-top
    layers = [keras.Input(input_shape)]
    for filters in (32, 64, 128):
        layers += [keras.layers.Conv2D(filters, 3, padding="same",
                                       activation="tanh"),
                   keras.layers.MaxPooling2D()]
    layers += [keras.layers.Conv2D(256, 3, padding="same", activation="tanh"),
               keras.layers.Conv2D(num_classes, 3, padding="same"),
               keras.layers.GlobalAveragePooling2D()]
    return keras.Sequential(layers)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.num_guesses > FLAGS.num_canaries:
        raise app.UsageError("--num_guesses: must be <= --num_canaries")
    broken = FLAGS["break"].value
    if broken != "none":
        print(f"*** --break={broken}: the privatizer is DELIBERATELY BROKEN;"
              " this run is NOT private (testing the auditor) ***")
    try:
        (x_train, y_train), (x_test, y_test) = load_fashion_mnist(
            FLAGS.data_dir)
    except OSError as error:
        raise app.UsageError(f"--data_dir: {error}; it must hold Fashion-"
                             "MNIST's four *-ubyte.gz files") from error
    import keras  # pylint: disable=g-import-not-at-top
    audit = tf_dpadam.audit
    rng = np.random.default_rng(FLAGS.seed)
    subset = rng.choice(len(x_train), FLAGS.train_size, replace=False)
    x, y = x_train[subset], y_train[subset]
    input_canaries = gradient_canaries = None
    if FLAGS.canaries == "input":  # Mislabeled test images.
        chosen = rng.choice(len(x_test), FLAGS.num_canaries, replace=False)
        input_canaries = audit.InputCanaries(
            x_test[chosen], y_test[chosen], num_classes=10,
            seed=FLAGS.canary_seed)
        x, y = input_canaries.training_data(x, y)
    batches = tf_dpadam.data.poisson_batches(
        (x, y), expected_batch_size=FLAGS.batch_size,
        steps_per_epoch=FLAGS.steps, pad_to_multiple_of=32)
    keras.utils.set_random_seed(FLAGS.seed)
    model = tf_dpadam.make_private(make_cnn(x.shape[1:], 10))
    dp = dict(l2_norm_clip=FLAGS.l2_norm_clip, batch_size=FLAGS.batch_size,
              noise_multiplier=FLAGS.noise_multiplier,
              learning_rate=(FLAGS.learning_rate
                             or LEARNING_RATES[FLAGS.optimizer]),
              gradient_accumulation_steps=(batches.accumulation_steps
                                           if batches.accumulation_steps > 1
                                           else None))
    optimizer = registry.optimizer_class(FLAGS.optimizer)(
        **dp, **({} if FLAGS.optimizer in ("dpsgd", "dpadam_corrected")
                 else dict(epsilon=1e-8)))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"])
    if input_canaries is None:  # Dirac gradients, sampled at the rate q.
        gradient_canaries = audit.GradientCanaries(
            num_canaries=FLAGS.num_canaries,
            sampling_probability=batches.sampling_rate,
            norm_multiple=FLAGS.canary_norm, seed=FLAGS.canary_seed)
        gradient_canaries.attach(model)
    else:
        input_canaries.start(model)
    audit.break_privatizer(model, broken)
    model.fit(batches.dataset, epochs=1, shuffle=False,
              steps_per_epoch=FLAGS.steps * batches.accumulation_steps,
              verbose=1 if sys.stdout.isatty() else 2)

    guesses = dict(num_guesses=FLAGS.num_guesses, delta=FLAGS.delta,
                   confidence=FLAGS.confidence)
    if gradient_canaries is not None:
        result = gradient_canaries.result(model, kind=FLAGS.score, **guesses)
    else:
        result = input_canaries.result(model, **guesses)
    claimed = float("inf") if FLAGS.noise_multiplier == 0 else (
        tf_dpadam.epsilon_after_steps(
            steps=FLAGS.steps, num_examples=len(y),
            batch_size=FLAGS.batch_size,
            noise_multiplier=FLAGS.noise_multiplier, delta=FLAGS.delta,
            accountant="pld"))
    n = FLAGS.max_test_examples
    _, accuracy = model.evaluate(x_test[:n], y_test[:n], batch_size=1000,
                                 verbose=0)
    print(f"{FLAGS.canaries} canaries, q = {batches.sampling_rate:.4f},"
          f" T = {FLAGS.steps}, sigma = {FLAGS.noise_multiplier:g},"
          f" C = {FLAGS.l2_norm_clip:g}, {FLAGS.optimizer}; test accuracy"
          f" {accuracy:.4f}")
    print(result.describe(claimed))
    best = audit.best_possible_bound(FLAGS.num_canaries, FLAGS.delta,
                                     FLAGS.confidence)
    print(f"(no audit with {FLAGS.num_canaries} canaries can show more than"
          f" {best:.2f})")
    print(f"audit: epsilon lower bound {result.epsilon_lower_bound:.3f}"
          f" ({FLAGS.confidence:.0%} confidence) vs claimed epsilon"
          f" {claimed:.3f}")


if __name__ == "__main__":
    command_line.run(main)
