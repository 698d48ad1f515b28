"""Trains the paper's 5-layer CNN with DP-SGD, DP-Adam or DP-AdamBC.

    python -m research.train_image --dataset=fashion_mnist --optimizer=dpadam_corrected

Unset hyperparameters take the paper's values for the dataset (see
`research.common.PAPER_DEFAULTS`). Training runs for the most steps whose
epsilon stays within --target_epsilon, with Poisson-sampled batches, and
prints the test accuracy and the epsilon spent.
"""

import dataclasses

from absl import app
from absl import flags

# Before Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order

import keras

from research import common
from research import datasets
from research import imbalance
from research import models
from research import record_sources
from research import training
from tf_dpadam.common import validation

def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("dataset", "fashion_mnist",
                      ["fashion_mnist", "cifar10"],
                      "cifar10 comes through tensorflow-datasets; "
                      "fashion_mnist from Debian's dataset-fashion-mnist "
                      "files, else tfds.")
    flags.DEFINE_string("data_dir", None,
                        "Folder of the dataset files (default: the loader's).")
    flags.DEFINE_string("data_source", None,
                        "Train by random access on a tensorflow-datasets"
                        " image dataset prepared in the ArrayRecord format:"
                        " its name (in --data_dir) or its folder. Only the"
                        " sampled records are read (data larger than memory);"
                        " replaces --dataset.")
    flags.DEFINE_enum("normalization", "none", list(models.NORMALIZATIONS),
                      "none: the paper's CNN; group: weight-standardized"
                      " convs with GroupNormalization (per example, exact"
                      " per-example clipping; De et al. 2022).")
    flags.DEFINE_enum("cnn", "paper", list(models.CNNS),
                      "paper: the paper's 5-layer tanh CNN (411k weights);"
                      " small: TF-Privacy's tutorial CNN (26k weights), the"
                      " end-to-end DP CNN of Tramer & Boneh 2021.")
    flags.DEFINE_integer("augmult", 0,
                         "Augmentation multiplicity K (De et al. 2022): each"
                         " example's gradient is the mean over K randomly"
                         " flipped and shifted (up to 4 pixels) views,"
                         " clipped once, so epsilon is unchanged and a step"
                         " costs about K times more; 0: no augmentation.")
    flags.DEFINE_float("imbalance_ratio", 1.0,
                       "Heavy-tailed class imbalance: class c keeps this^(c"
                       " / (K - 1)) of its training images (the last class"
                       " this fraction; 1: all); the run then also reports"
                       " each class's test accuracy, their mean and the"
                       " worst.")
    shared_flags.define_training_flags()
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    shared_flags.check_flag("augmult", validation.check_non_negative)
    shared_flags.check_flag("imbalance_ratio", imbalance.check_ratio_flag)


FLAGS = flags.FLAGS


def run(dataset, data_dir, config, max_examples=None, *,
        max_test_examples=None, data_source=None, **kwargs):
    """Loads `dataset` and trains the CNN; returns `training.fit_private`'s
    results. The first `max_examples` / `max_test_examples` are used (None:
    all); with `data_source` (`record_sources.image_data_source`) the
    training set is read by random access instead (all of it);
    `config.normalization` and `config.cnn` are `models.make_cnn`'s;
    `config.augmult` > 0 trains on that many augmented views of each
    example (`models.image_augmentation`), so that the run's record
    (metrics.json) says how it was trained; `config.validation_examples`
    = V > 0 holds V of the training images out (`datasets.split_validation`,
    the same V for every seed), after the `max_examples` cap and the
    imbalance subset: the run trains on the others and also reports the
    validation accuracy; `kwargs` go to `fit_private` (`callbacks`,
    `max_steps`, `measure`)."""
    validation = None
    if data_source:
        if config.validation_examples:
            raise training.SettingsError(
                "--validation_examples needs in-memory data, not"
                " --data_source.")
        train, (x_test, y_test), num_classes = (
            record_sources.image_data_source(data_source, data_dir))
        input_shape = train.decode([train.source[0]])[0].shape[1:]
    else:
        (x_train, y_train), (x_test, y_test) = datasets.load_image_dataset(
            dataset, data_dir)
        if max_examples:
            x_train, y_train = x_train[:max_examples], y_train[:max_examples]
        num_classes = int(y_train.max()) + 1
        if config.imbalance_ratio < 1:
            # One subset for every run and seed (seed 0).
            x_train, y_train = imbalance.imbalanced_subset(
                x_train, y_train, config.imbalance_ratio)
        # Carved from the images the run would otherwise train on.
        train, validation = training.split_validation(x_train, y_train,
                                                      config)
        input_shape = x_train.shape[1:]
    if max_test_examples:
        x_test, y_test = x_test[:max_test_examples], y_test[:max_test_examples]
    if config.imbalance_ratio < 1:
        if data_source:
            raise ValueError("--imbalance_ratio needs in-memory data, not"
                             " --data_source.")
        kwargs["measure"] = imbalance.combine_measures(
            kwargs.get("measure"), imbalance.per_class_measure(x_test, y_test))
    return training.fit_private(
        lambda: models.make_cnn(input_shape, num_classes,
                                config.normalization, cnn=config.cnn),
        train,
        (x_test, y_test),
        config,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        augment=(models.image_augmentation(input_shape, seed=config.seed)
                 if config.augmult else None),
        validation=validation,
        **kwargs,
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    with shared_flags.usage_errors():
        config = dataclasses.replace(
            shared_flags.config_from_flags(FLAGS.dataset),
            normalization=FLAGS.normalization, augmult=FLAGS.augmult,
            cnn=FLAGS.cnn, imbalance_ratio=FLAGS.imbalance_ratio)
    caps = shared_flags.smoke_test_caps()
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=shared_flags.OFFLINE_IMAGES_HINT), \
            shared_flags.usage_errors(training.SettingsError):
        results = run(FLAGS.dataset, FLAGS.data_dir, config,
                      caps.examples(FLAGS.max_examples),
                      max_test_examples=caps.max_test_examples,
                      data_source=FLAGS.data_source,
                      max_steps=caps.max_steps,
                      count_all_steps=FLAGS.resume_counting_all_steps,
                      learning_rate=FLAGS.learning_rate,  # On a resume.
                      callbacks=shared_flags.tensorboard_callbacks())
    common.print_results(results)


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
