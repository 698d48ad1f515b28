"""Trains the paper's 5-layer CNN with DP-SGD, DP-Adam or DP-AdamBC.

    python -m examples.train_image --dataset=fashion_mnist --optimizer=dpadam_corrected

Unset hyperparameters take the paper's values (`PAPER`). The run takes the
most Poisson-sampled steps whose epsilon (PLD) stays within --target_epsilon,
evaluating every --eval_every steps, and prints the test accuracy and the
epsilon spent. --model_dir checkpoints; a rerun resumes (`tf_dpadam.run_dir`).
"""

import contextlib
import functools
import gzip
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import keras
import numpy as np

import tf_dpadam
from tf_dpadam import command_line
from tf_dpadam import run_dir

# Tang & Lecuyer's hyperparameters (Appendix): C, sigma, B and DP-AdamBC's
# gamma' (None: 0.04 Phi); DP-Adam's gamma is 1e-8.
PAPER = {
    "cifar10": dict(l2_norm_clip=1.0, noise_multiplier=1.0, batch_size=2048,
                    gamma_prime=1e-8),
    "fashion_mnist": dict(l2_norm_clip=1.0, noise_multiplier=0.52,
                          batch_size=256, gamma_prime=None),
}
LEARNING_RATES = {"dpsgd": 4.0, "dpadam": 1e-3, "dpadam_corrected": 1e-3}
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's package.

flags.DEFINE_enum("dataset", "fashion_mnist", list(PAPER), "fashion_mnist:"
                  " Debian's files, else tensorflow-datasets (as cifar10).")
flags.DEFINE_string("data_dir", None, "Fashion-MNIST's folder, or tfds'.")
flags.DEFINE_enum("optimizer", "dpadam_corrected", list(LEARNING_RATES),
                  "Update rule on the privatized gradient.")
flags.DEFINE_float("learning_rate", None, "Default: the paper's.")
flags.DEFINE_float("epsilon", None, "gamma (DP-Adam) or gamma' (DP-AdamBC);"
                   " default: the paper's.")
flags.DEFINE_float("l2_norm_clip", None, "C; default: the paper's.")
flags.DEFINE_float("noise_multiplier", None, "sigma; default: the paper's.")
flags.DEFINE_integer("batch_size", None, "Expected batch size B; default: the"
                     " paper's.", lower_bound=1)
flags.DEFINE_float("target_epsilon", 7.0, "The most steps with this epsilon.")
flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
flags.DEFINE_integer("eval_every", 100, "Steps between evals.", lower_bound=1)
flags.DEFINE_integer("max_examples", None, "Train on the first this many.",
                     lower_bound=1)
flags.DEFINE_integer("max_steps", None, "At most this many (a quick run).",
                     lower_bound=1)
flags.DEFINE_string("model_dir", None, "Checkpoints and ledger; reruns resume.")
flags.DEFINE_bool("resume_counting_all_steps", False, "Resume a --model_dir"
                  " whose checkpoint and ledger.json disagree or lack one"
                  " another, counting the steps of both.")
flags.DEFINE_integer("seed", 0, "Seed of the model's initialization.")
flags.DEFINE_integer("noise_seed", None, "Seed of the noise and sampling, for"
                     " research only (NOT private); default: secret.")
FLAGS = flags.FLAGS


def read_idx(path):
    """A gzipped IDX file (MNIST's format) of bytes as a NumPy array."""
    with gzip.open(path) as f:
        data = f.read()
    shape = np.frombuffer(data, ">u4", data[3], offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)


def load_dataset(name, data_dir=None):
    """`((x_train, y_train), (x_test, y_test))`: float32 images in [0, 1]."""
    files = [os.path.join(data_dir or FASHION_MNIST_DIR,
                          f"{split}-{kind}-ubyte.gz")
             for split in ("train", "t10k")
             for kind in ("images-idx3", "labels-idx1")]
    if name == "fashion_mnist" and all(map(os.path.exists, files)):
        x, y, x_test, y_test = map(read_idx, files)
        splits = [(x[..., None], y), (x_test[..., None], y_test)]
    else:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
        splits = [tfds.as_numpy(tfds.load(name, split=split, batch_size=-1,
                                          as_supervised=True,
                                          data_dir=data_dir))
                  for split in ("train", "test")]
    return tuple((x.astype("float32") / 255.0, y.astype("int32"))
                 for x, y in splits)


def make_cnn(input_shape, num_classes):
    """The paper's CNN: 3x3 tanh convs of 32, 64, 128, 256 filters (2x2
    max-pools after the first three), a conv to the logits, global average
    pooling."""
    conv = functools.partial(keras.layers.Conv2D, kernel_size=3, padding="same")
    layers = [keras.Input(input_shape)]
    for filters in (32, 64, 128):
        layers += [conv(filters, activation="tanh"), keras.layers.MaxPooling2D()]
    layers += [conv(256, activation="tanh"), conv(num_classes),
               keras.layers.GlobalAveragePooling2D()]
    return keras.Sequential(layers, name="paper_cnn")


def make_optimizer(name, *, learning_rate, epsilon, **dp):
    """The tf_dpadam optimizer `name`, with the DP arguments `dp`; `epsilon`
    is gamma' of DP-AdamBC (DP-Adam's default: 1e-8)."""
    if name == "dpsgd":
        return tf_dpadam.DPSGD(learning_rate=learning_rate, **dp)
    if name == "dpadam":
        return tf_dpadam.DPAdam(learning_rate=learning_rate, **dp,
                                epsilon=1e-8 if epsilon is None else epsilon)
    return tf_dpadam.DPAdamCorrected(learning_rate=learning_rate,
                                     epsilon=epsilon, **dp)


def fit_calls(done, steps, every):
    """`(initial_epoch, epochs, steps_per_epoch)` of the `fit` calls taking
    the steps `done + 1 ... steps`, each epoch ending at a multiple of
    `every` or at `steps` (so the progress bar counts the steps it takes)."""
    calls = []
    while done < steps:
        epoch = done // every
        length = min((epoch + 1) * every, steps) - done
        if calls and calls[-1][1:] == (epoch, length):
            calls[-1] = (calls[-1][0], epoch + 1, length)
        else:
            calls.append((epoch, epoch + 1, length))
        done += length
    return calls


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    try:
        train()
    except ValueError as error:  # Settings that cannot train: one line.
        raise app.UsageError(str(error)) from error


def train():
    paper, name = PAPER[FLAGS.dataset], FLAGS.optimizer
    dp = {key: paper[key] if FLAGS[key].value is None else FLAGS[key].value
          for key in ("l2_norm_clip", "noise_multiplier", "batch_size")}
    (x, y), (x_test, y_test) = load_dataset(FLAGS.dataset, FLAGS.data_dir)
    x, y = x[:FLAGS.max_examples], y[:FLAGS.max_examples]
    steps = FLAGS.max_steps or tf_dpadam.calibrate_steps(  # No search if set.
        target_epsilon=FLAGS.target_epsilon, num_examples=len(y),
        delta=FLAGS.delta, accountant="pld", batch_size=dp["batch_size"],
        noise_multiplier=dp["noise_multiplier"])

    def build():
        keras.utils.set_random_seed(FLAGS.seed)
        model = tf_dpadam.make_private(
            make_cnn(x.shape[1:], int(y.max()) + 1), seed=FLAGS.noise_seed)
        model.compile(
            optimizer=make_optimizer(
                name, **dp,
                learning_rate=FLAGS.learning_rate or LEARNING_RATES[name],
                epsilon=(paper["gamma_prime"] if FLAGS.epsilon is None
                         else FLAGS.epsilon)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])  # Poisson padding has weight 0.
        return model

    callbacks = [tf_dpadam.PrivacyBudget(
        num_examples=len(y), accountant="pld", delta=FLAGS.delta,
        target_epsilon=FLAGS.target_epsilon)]
    model_dir = FLAGS.model_dir
    with run_dir.hold(model_dir) if model_dir else contextlib.nullcontext():
        model = (model_dir and run_dir.load_checkpoint(model_dir)) or build()
        if model_dir:  # Refuses other privacy settings, before any step.
            ledger = run_dir.begin_ledger(model_dir, run_dir.privacy_settings(
                **dp, num_examples=len(y), optimizer=name,
                physical_batch_size=None, delta=FLAGS.delta,
                accumulation_steps=model.optimizer.dp_accumulation_steps),
                model, count_all_steps=FLAGS.resume_counting_all_steps)
            callbacks.append(run_dir.AtomicCheckpoint(model_dir, ledger))
        # The run's steps are its model's ledger's (> 0 on a resume).
        for initial_epoch, epochs, length in fit_calls(
                model.privacy_ledger.steps, steps, FLAGS.eval_every):
            model.fit(x, y, initial_epoch=initial_epoch, epochs=epochs,
                      steps_per_epoch=length, callbacks=callbacks,
                      validation_data=(x_test, y_test),
                      validation_batch_size=512,
                      verbose=1 if sys.stdout.isatty() else 2)
            if model.stop_training:  # PrivacyBudget: --target_epsilon.
                break
        _, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    print(f"test accuracy {accuracy:.4f} after {model.privacy_ledger.steps}"
          f" steps; spent epsilon {model.spent_epsilon(FLAGS.delta):.3f} at"
          f" delta {FLAGS.delta:g}")


if __name__ == "__main__":
    command_line.run(main)
