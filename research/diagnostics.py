"""Clean vs private Adam moments of the paper's CNN (NOT private diagnostics).

    python -m research.diagnostics --dataset=fashion_mnist

WARNING: this binary is not differentially private. It trains with
`make_private(model, diagnostics=True)`, which also stores the clipped but
un-noised gradient of every step, and writes tables and histograms computed
from it. Run it on public data to study the optimizer only.

It reproduces the paper's Table 2 and Figure 2 (Tang & Lecuyer): the CNN of
`research.models.make_cnn` trained with DP-AdamBC (or DP-Adam) at the
dataset's defaults of `research.common.PAPER_DEFAULTS` (Fashion-MNIST: C = 1,
sigma = 0.52, expected B = 256 with Poisson sampling, lr = 1e-3,
gamma' = 0.04 Phi) for the steps of --target_epsilon (719 at epsilon = 7),
with `tf_dpadam.MomentDiagnostics` snapshotting the clean and private Adam
moments at --report_steps and at the last step. It writes --output (default
research/results/DIAGNOSTICS_<dataset>.md) and one histogram PNG per
snapshot next to it (`research.diagnostics_report`). It trains with the
binaries' loop (`research.training.train_private`).
"""

import os
import shlex
import sys

from absl import app
from absl import flags

# Before Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order

import keras
import numpy as np

import tf_dpadam
from research import common
from research import datasets
from research import models
from research import training
from research.diagnostics_report import write_report
from tf_dpadam.common import validation

def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("dataset", "fashion_mnist",
                      ["fashion_mnist", "cifar10"],
                      "As for research.train_image.")
    flags.DEFINE_string("data_dir", None,
                        "Folder of the dataset files (default: the loader's).")
    flags.DEFINE_list("report_steps", ["10", "100"],
                      "DP steps to snapshot, besides the last one.")
    flags.DEFINE_string("output", None,
                        "Markdown report (default: research/results/"
                        "DIAGNOSTICS_<dataset>.md); PNGs go next to it.")
    shared_flags.define_training_flags()
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    shared_flags.check_list_flag(
        "report_steps",
        shared_flags.number_in(validation.check_positive_int, kind=int))


FLAGS = flags.FLAGS


def train_with_diagnostics(model_fn, train, test, config, report_steps,
                           max_steps=None, callbacks=()):
    """Trains with diagnostics on; returns the callback and a results dict.

    Args:
        model_fn: builds the (non-private) Keras model.
        train, test: `(x, y)` NumPy arrays.
        config: a `common.TrainConfig` (DP-Adam or DP-AdamBC).
        report_steps: steps to snapshot; the last step is added.
        max_steps: stop after this many steps if the config plans more (a
            smoke test).
        callbacks: more Keras callbacks (e.g. TensorBoard).

    Returns:
        `(callback, results)`: the `MomentDiagnostics` with its snapshots,
        and `training.train_private`'s results with the batches' capacity,
        the accumulation steps and the number of trainable parameters.
    """
    try:
        steps = common.total_steps(config, len(train[1]))
    except ValueError as error:
        raise training.SettingsError(str(error)) from error
    if max_steps is not None:
        steps = common.bands_steps(min(steps, max_steps), config.noise_bands)
    moments = tf_dpadam.MomentDiagnostics(
        steps=[s for s in report_steps if s < steps] + [steps]
    )
    model, batches, results = training.train_private(
        model_fn, train, test, config,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        diagnostics=True,
        callbacks=[moments, training.StopAtStep(steps), *callbacks],
        validate=False, max_steps=steps)
    results.update(
        capacity=batches.capacity,
        accumulation_steps=batches.accumulation_steps,
        num_parameters=int(sum(
            np.prod(v.shape) for v in model.trainable_variables
        )),
    )
    return moments, results


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.model_dir:
        raise app.UsageError("--model_dir is not supported: the clean moments"
                             " must see every step in one run.")
    if FLAGS.optimizer == "dpsgd":
        raise app.UsageError("The diagnostics compare Adam moments: use"
                             " --optimizer=dpadam_corrected or dpadam.")
    if FLAGS.validation_examples:
        raise app.UsageError("--validation_examples is not supported: the"
                             " diagnostics select no setting.")
    report_steps = sorted({int(s) for s in FLAGS.report_steps})
    with shared_flags.usage_errors():
        config = shared_flags.config_from_flags(FLAGS.dataset)
    caps = shared_flags.smoke_test_caps()
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT):
        (x_train, y_train), (x_test, y_test) = datasets.load_image_dataset(
            FLAGS.dataset, FLAGS.data_dir
        )
    max_examples = caps.examples(FLAGS.max_examples)
    if max_examples:
        x_train, y_train = x_train[:max_examples], y_train[:max_examples]
    if caps.max_test_examples:
        x_test = x_test[:caps.max_test_examples]
        y_test = y_test[:caps.max_test_examples]
    num_classes = int(y_train.max()) + 1
    with shared_flags.usage_errors(training.SettingsError):
        moments, results = train_with_diagnostics(
            lambda: models.make_cnn(x_train.shape[1:], num_classes),
            (x_train, y_train), (x_test, y_test), config, report_steps,
            max_steps=caps.max_steps,
            callbacks=shared_flags.tensorboard_callbacks(),
        )
    output = FLAGS.output or os.path.join(
        "research", "results", f"DIAGNOSTICS_{FLAGS.dataset}.md"
    )
    command = "python -m research.diagnostics " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    write_report(output, FLAGS.dataset, config, results,
                 list(moments.snapshots.values()), command.strip())
    print(f"wrote {output}; test accuracy {results['test_accuracy']:.4f}"
          f" after {results['steps']} steps (NOT private diagnostics)")



if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
