"""Trains the paper's 5-layer CNN with any DP optimizer of tf_dpadam.

    python -m examples.train_image --dataset=fashion_mnist --optimizer=dpadam_corrected

Unset hyperparameters take the paper's values (`PAPER`). It takes the most
Poisson steps within --target_epsilon (PLD), evaluates every --eval_every
steps, prints the test accuracy and epsilon; --model_dir checkpoints, resumes.
"""

import functools
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

# The paper's (Appendix): C, sigma, B, DP-AdamBC's gamma' (None: 0.04 Phi).
PAPER = {"cifar10": dict(l2_norm_clip=1.0, noise_multiplier=1.0,
                         batch_size=2048, gamma_prime=1e-8),
         "fashion_mnist": dict(l2_norm_clip=1.0, noise_multiplier=0.52,
                               batch_size=256, gamma_prime=None)}
# --optimizer (as a --model_dir records it): tf_dpadam's registered names.
OPTIMIZERS = registry.class_names()
LEARNING_RATES = dict.fromkeys(OPTIMIZERS, 1e-3) | {"dpsgd": 4.0}
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's package.
DOWNLOADS = {"fashion_mnist": "http://fashion-mnist.s3-website.eu-central-1"
             ".amazonaws.com/", "cifar10": "https://www.cs.toronto.edu/"}

flags.DEFINE_enum("dataset", "fashion_mnist", list(PAPER), "Dataset.")
flags.DEFINE_string("data_dir", None, f"Default {FASHION_MNIST_DIR}: Fashion-"
                    "MNIST's *-ubyte.gz files, or tensorflow-datasets' data.")
flags.DEFINE_enum("optimizer", "dpadam_corrected", list(OPTIMIZERS),
                  ", ".join(OPTIMIZERS.values()) + " (tf_dpadam's).")
flags.DEFINE_float("learning_rate", None, "Default: 4 (dpsgd), 1e-3 (others).")
flags.DEFINE_float("adam_epsilon", None, "Adam's epsilon (not the budget):"
                   " dpadam_corrected's gamma', in the root (default 0.04 Phi"
                   " for fashion_mnist, 1e-8 for cifar10); else gamma (1e-8).")
flags.DEFINE_float("l2_norm_clip", None, "C; default: the paper's, 1.0.")
flags.DEFINE_float("noise_multiplier", None, "sigma; default: the paper's,"
                   " 0.52 (fashion_mnist), 1.0 (cifar10).")
flags.DEFINE_integer("batch_size", None, "Expected B; default: the paper's,"
                     " 256 (fashion_mnist), 2048 (cifar10).", lower_bound=1)
command_line.define_deprecated_alias("epsilon", "adam_epsilon")
flags.DEFINE_integer("noise_bands", 1, "BandMF noise's bands.", lower_bound=1)
flags.DEFINE_float("target_epsilon", 7.0, "The most steps with this epsilon.")
flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
flags.DEFINE_integer("eval_every", 100, "Steps between evals.", lower_bound=1)
flags.DEFINE_integer("max_examples", None, "Use the first N.", lower_bound=1)
flags.DEFINE_integer("max_steps", None, "At most N (quick run).", lower_bound=1)
flags.DEFINE_string("model_dir", None, "Checkpoints and ledger; reruns resume.")
flags.DEFINE_bool("resume_counting_all_steps", False, "Resume a --model_dir"
                  " whose checkpoint and ledger.json disagree, counting both.")
flags.DEFINE_integer("seed", 0, "Seed of the model's initialization.")
flags.DEFINE_integer("noise_seed", None, "Seed of the noise and sampling, for"
                     " research only (NOT private); default: secret.")
FLAGS = flags.FLAGS


def read_idx(path):
    """A gzipped IDX file (MNIST's format) of bytes as a NumPy array."""
    with gzip.open(path) as f:
        data = f.read()
    return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(
        np.frombuffer(data, ">u4", data[3], offset=4))


def load_dataset(name, data_dir=None):
    """`((x_train, y_train), (x_test, y_test))`: float32 images in [0, 1]."""
    files = [os.path.join(data_dir or FASHION_MNIST_DIR, f"{s}-{k}-ubyte.gz")
             for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]
    if name == "fashion_mnist" and all(map(os.path.exists, files)):
        x, y, x_test, y_test = map(read_idx, files)
        splits = [(x[..., None], y), (x_test[..., None], y_test)]
    elif not command_line.tfds_prepared(name, data_dir) and (
            why := command_line.unreachable(DOWNLOADS[name])):
        raise app.UsageError(  # Now, not after minutes of retries.
            f"--data_dir: no {name} there, and no download ({why}); pass"
            f" --data_dir=DIR holding tensorflow-datasets' prepared {name}"
            + (" or its *-ubyte.gz files" if name == "fashion_mnist" else ""))
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
    max-pools after the first three), a conv to the logits, average pooling."""
    import keras  # pylint: disable=g-import-not-at-top
    conv = functools.partial(keras.layers.Conv2D, kernel_size=3, padding="same")
    layers = [keras.Input(input_shape)]
    for filters in (32, 64, 128):
        layers += [conv(filters, activation="tanh"), keras.layers.MaxPooling2D()]
    layers += [conv(256, activation="tanh"), conv(num_classes),
               keras.layers.GlobalAveragePooling2D()]
    return keras.Sequential(layers, name="paper_cnn")


def make_optimizer(name, *, learning_rate, epsilon, **dp):
    """`name`'s optimizer; `epsilon`: gamma, or gamma' (None: 0.04 Phi)."""
    adam = {} if name == "dpsgd" else dict(epsilon=epsilon)
    return registry.optimizer_class(name)(learning_rate=learning_rate,
                                          **adam, **dp)


def fit_calls(done, steps, every):
    """`(initial_epoch, epochs, steps_per_epoch)` of the `fit` calls taking
    steps `done + 1 ... steps` in epochs of `every`, all whole cycles of b."""
    b, calls = FLAGS.noise_bands, []  # Each call whole cycles of b groups.
    done, every, steps = -(-done // b) * b, -(-every // b) * b, steps // b * b
    while done < steps:
        length = min((done // every + 1) * every, steps) - done  # Epoch's.
        if calls and calls[-1][1:] == (done // every, length):
            calls[-1] = (calls[-1][0], done // every + 1, length)
        else:
            calls.append((done // every, done // every + 1, length))
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
    run_dir = tf_dpadam.run_dir  # TensorFlow loads now, after the data.
    x, y = x[:FLAGS.max_examples], y[:FLAGS.max_examples]
    steps = FLAGS.max_steps or tf_dpadam.calibrate_steps(  # No search if set.
        target_epsilon=FLAGS.target_epsilon, num_examples=len(y),
        delta=FLAGS.delta, accountant="pld", batch_size=dp["batch_size"],
        noise_multiplier=dp["noise_multiplier"], bands=FLAGS.noise_bands)

    def build():
        import keras  # pylint: disable=g-import-not-at-top
        keras.utils.set_random_seed(FLAGS.seed)
        model = tf_dpadam.make_private(
            make_cnn(x.shape[1:], int(y.max()) + 1), seed=FLAGS.noise_seed)
        model.compile(
            optimizer=make_optimizer(
                name, **dp, noise_strategy=FLAGS.noise_bands,
                learning_rate=FLAGS.learning_rate or LEARNING_RATES[name],
                epsilon=(FLAGS.adam_epsilon if FLAGS.adam_epsilon is not None
                         else paper["gamma_prime"] if name == "dpadam_corrected"
                         else 1e-8)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])  # Poisson padding has weight 0.
        return model

    callbacks = [tf_dpadam.PrivacyBudget(
        num_examples=len(y), accountant="pld", delta=FLAGS.delta,
        target_epsilon=FLAGS.target_epsilon),  # Bar: Epoch k/<run's last>.
        run_dir.ProgressBar(fit_calls(0, steps, FLAGS.eval_every)[-1][1])]
    model_dir = FLAGS.model_dir  # A resume takes --learning_rate if given.
    with run_dir.resumed(model_dir, FLAGS.learning_rate) as model:
        model = model or build()
        if model_dir:  # Refuses other privacy settings, before any step.
            ledger = run_dir.begin_ledger(model_dir, run_dir.privacy_settings(
                **dp, num_examples=len(y), optimizer=name,
                physical_batch_size=None, delta=FLAGS.delta,
                accumulation_steps=model.optimizer.dp_accumulation_steps,
                noise_bands=FLAGS.noise_bands),
                model, count_all_steps=FLAGS.resume_counting_all_steps)
            callbacks.append(run_dir.AtomicCheckpoint(model_dir, ledger))
        for initial_epoch, epochs, length in fit_calls(  # > 0 done: resumed.
                model.privacy_ledger.steps, steps, FLAGS.eval_every):
            model.fit(x, y, initial_epoch=initial_epoch, epochs=epochs,
                      steps_per_epoch=length, callbacks=callbacks,
                      validation_data=(x_test, y_test), validation_batch_size=512,
                      verbose=1 if sys.stdout.isatty() else 2)
            if model.stop_training:  # PrivacyBudget: --target_epsilon.
                break
        _, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    print(f"test accuracy {accuracy:.4f} after {model.privacy_ledger.steps}"
          f" steps; spent epsilon {model.spent_epsilon(FLAGS.delta):.3f} at"
          f" delta {FLAGS.delta:g}")


if __name__ == "__main__":
    command_line.run(main)
