"""Membership inference against a non-private and two DP models (LiRA).

    python -m examples.membership --plot=roc.png

A pool of 2 * --num_members Fashion-MNIST training images: the target
models train on its first half (members) and never see the second
(non-members). Three targets of one small CNN, the same epochs and expected
batch size: non-private (Adam), and DP-AdamBC through make_private (Poisson
batches) at epsilon 7 and 1 (PLD, delta 1e-5). Each is attacked with the
global loss threshold and with offline LiRA (Carlini et al. 2022): k shadow
models per setting, each trained the same way on a random half of the pool.
Prints one row per model (test accuracy, AUC, TPR at FPR 0.1% and 1%, with
95% bootstrap intervals) and saves the LiRA ROC curves on log-log axes.
--augment trains every model on random mirrors and shifts; --queries
gives LiRA those views of each image.
"""

import gzip
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

import tf_dpadam  # TensorFlow loads on first use (--help needs none).
from tf_dpadam.common import command_line

flags.DEFINE_string("data_dir", "/usr/share/datasets/fashion-mnist",
                    "Fashion-MNIST's IDX files (Debian's package).")
flags.DEFINE_integer("num_members", 2000, "Members (and non-members).",
                     lower_bound=2)
flags.DEFINE_integer("num_shadows", 8, "Shadow models per setting (even).",
                     lower_bound=2)
flags.DEFINE_integer("epochs", 30, "Epochs of every model.", lower_bound=1)
flags.DEFINE_integer("batch_size", 128, "Expected batch size B.",
                     lower_bound=1)
flags.DEFINE_list("epsilons", ["inf", "7", "1"], "The targets' epsilons (inf:"
                  " non-private).")
flags.DEFINE_float("delta", 1e-5, "delta of the DP models.")
flags.DEFINE_integer("max_test_examples", 2000, "Test images for accuracy.",
                     lower_bound=1)
flags.DEFINE_enum("queries", "none", ["none", "flip", "flip_shift"],
                  "LiRA's views of each image: the image alone, also"
                  " mirrored, or also shifted by 2 pixels (10 views).")
flags.DEFINE_bool("augment", False, "Train every model on random mirrors and"
                  " shifts of up to 2 pixels (reflected border).")
flags.DEFINE_string("plot", None, "Where to save the ROC curves (PNG).")
flags.DEFINE_integer("seed", 0, "Seed of the data split, masks and models.")
FLAGS = flags.FLAGS
MAX_SHIFT = 2  # Pixels: --augment's shifts and --queries' views agree.


def read_idx(path):
    """A gzipped IDX file (MNIST's format) of bytes as a NumPy array."""
    with gzip.open(path) as f:
        data = f.read()
    shape = np.frombuffer(data, ">u4", data[3], offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)


def load(data_dir, split):
    """Images in [0, 1] of shape (n, 28, 28, 1) and int32 labels."""
    x, y = (read_idx(os.path.join(data_dir, f"{split}-{kind}-ubyte.gz"))
            for kind in ("images-idx3", "labels-idx1"))
    return x[..., None].astype("float32") / 255.0, y.astype("int32")


def make_cnn(augment=False):
    """A small CNN: two 3x3 conv + max-pool blocks, a dense layer, logits;
    with `augment`, random mirrors and shifts in training (not inference)."""
    import keras  # pylint: disable=g-import-not-at-top
    shift = MAX_SHIFT / 28
    augmentation = [keras.layers.RandomFlip("horizontal"),
                    keras.layers.RandomTranslation(
                        shift, shift, fill_mode="reflect")] if augment else []
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        *augmentation,
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10)])


def make_train_fn(noise_multiplier, *, epochs, batch_size, seed, augment):
    """`train_fn(x, y) -> model`: Adam if `noise_multiplier` is None, else
    DP-AdamBC with C = 1 and Poisson batches of expected size B."""
    import keras  # pylint: disable=g-import-not-at-top
    calls = [0]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_fn(x, y):
        keras.backend.clear_session()
        keras.utils.set_random_seed(seed + calls[0])
        calls[0] += 1
        model = make_cnn(augment)
        if noise_multiplier is None:
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
            model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0)
            return model
        model = tf_dpadam.make_private(model)
        model.compile(optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
            batch_size=batch_size, learning_rate=2e-3), loss=loss)
        steps = tf_dpadam.accounting.steps_for_epochs(
            epochs=epochs, num_examples=len(y), batch_size=batch_size)
        model.fit(x, y, epochs=1, steps_per_epoch=steps, verbose=0)
        return model

    return train_fn


def row_name(epsilon):
    return "non-private" if np.isinf(epsilon) else f"DP, ε = {epsilon:g}"


def attack(epsilon, pool, test, n):
    """Trains the target and the shadows of one setting; returns (row of
    the table, the LiRA result)."""
    membership = tf_dpadam.membership
    (x, y), (x_test, y_test) = pool, test
    sigma, steps = None, tf_dpadam.accounting.steps_for_epochs(
        epochs=FLAGS.epochs, num_examples=n, batch_size=FLAGS.batch_size)
    if np.isfinite(epsilon):
        sigma = tf_dpadam.calibrate_noise_multiplier(
            target_epsilon=epsilon, num_examples=n, steps=steps,
            batch_size=FLAGS.batch_size, delta=FLAGS.delta)
    train_fn = make_train_fn(sigma, epochs=FLAGS.epochs,
                             batch_size=FLAGS.batch_size, seed=FLAGS.seed,
                             augment=FLAGS.augment)
    target = train_fn(x[:n], y[:n])  # Members: the first half of the pool.
    accuracy = np.mean(np.argmax(target.predict(x_test, verbose=0), -1)
                       == y_test)
    loss = membership.model_scores(target, x, y, score="loss")
    max_shift = MAX_SHIFT if FLAGS.queries == "flip_shift" else 0
    queries = None if FLAGS.queries == "none" else membership.image_queries(
        flip=True, max_shift=max_shift)
    shadows = membership.train_shadows(
        train_fn, x, y, num_shadows=FLAGS.num_shadows, seed=FLAGS.seed + 1,
        queries=queries)
    lira = membership.lira_offline(
        membership.model_scores(target, x, y, queries=queries), shadows,
        global_variance=True)
    results = [membership.evaluate_attack(s[:n], s[n:], seed=FLAGS.seed)
               for s in (loss, lira)]
    row = [row_name(epsilon), "-" if sigma is None else f"{sigma:.2f}",
           f"{accuracy:.3f}"]
    for result in results:
        row.append(f"{result.auc:.3f}")
        for alpha in (0.001, 0.01):
            low, high = result.intervals[alpha]
            row.append(f"{100 * result.tpr_at_fpr[alpha]:.2f}%"
                       f" [{100 * low:.2f}, {100 * high:.2f}]")
    return row, results[1]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.num_shadows % 2:
        raise app.UsageError("--num_shadows must be even.")
    n = FLAGS.num_members
    try:
        x, y = load(FLAGS.data_dir, "train")
    except OSError as error:
        raise app.UsageError(f"--data_dir: {error}; it must hold Fashion-"
                             "MNIST's four *-ubyte.gz files") from error
    order = np.random.default_rng(FLAGS.seed).permutation(len(y))[:2 * n]
    pool = x[order], y[order]
    x_test, y_test = load(FLAGS.data_dir, "t10k")
    test = x_test[:FLAGS.max_test_examples], y_test[:FLAGS.max_test_examples]
    header = ["model", "sigma", "test acc.", "loss AUC", "loss TPR@0.1%",
              "loss TPR@1%", "LiRA AUC", "LiRA TPR@0.1%", "LiRA TPR@1%"]
    rows, curves = [], {}
    for epsilon in map(float, FLAGS.epsilons):
        row, curves[f"LiRA, {row_name(epsilon)}"] = attack(epsilon, pool,
                                                            test, n)
        rows.append(row)
        print(f"done: {row[0]}", flush=True)
    print(f"{n} members, {n} non-members, {FLAGS.num_shadows} shadows per"
          f" setting, {FLAGS.epochs} epochs, B = {FLAGS.batch_size},"
          f" augment={FLAGS.augment}, queries={FLAGS.queries};"
          " TPR with 95% bootstrap intervals")
    for line in (header, ["---"] * len(header), *rows):
        print("| " + " | ".join(line) + " |")
    if FLAGS.plot:
        membership = tf_dpadam.membership
        membership.save_roc_plot(curves, FLAGS.plot, title="Offline LiRA,"
                                 f" {n} Fashion-MNIST members")
        print(f"ROC curves: {FLAGS.plot}")


if __name__ == "__main__":
    command_line.run(main)
