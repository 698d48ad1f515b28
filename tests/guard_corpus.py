"""A corpus of models shaped like the ones users bring (issue 50).

Small copies (tiny widths, short sequences, 16x16 or 32x32 images, batches
of `B` = 8) of keras.io's examples, keras-hub task models and `fix()`ed
keras.applications models, each with the head and the loss its tutorial
uses: softmax and sigmoid heads with probability-space losses, logits,
label smoothing, multi-label, focal losses, text, sequences, attention,
masks, two inputs, two outputs with loss weights, sample weights, and every
per-example loss class of `keras.losses` at least once (`EXCLUDED_LOSSES`
lists the others and why). tests/guard_corpus_test.py trains each with the
independence guard on and checks its step against one-example tapes.

`CORPUS` maps a name to a `Case`: `build(dropout=None)` returns a fresh,
seeded, uncompiled model (`dropout=None`: the tutorial's rates for Dropout,
attention dropout and random augmentation; `dropout=0.0`: no random layer
draws anything, for the exactness check, which cannot replay a batch's
random draws one example at a time); `loss` and `loss_weights` are what
`compile` gets; `data()` returns `(x, y, sample_weight)` (a batch of `B`;
`sample_weight` may be None).
"""

import dataclasses
from typing import Any, Callable, Optional

import keras
import numpy as np
from keras import layers
from keras import ops

import tf_dpadam

B = 8
_VOCABULARY = 50


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[..., keras.Model]
    loss: Any
    data: Callable[[], tuple]
    loss_weights: Optional[Any] = None


# keras.losses classes the corpus leaves out, and why. Every other class of
# keras.losses must appear in the corpus as an instance (the test checks).
EXCLUDED_LOSSES = {
    "Loss": "the base class",
    "Circle": "in-batch pairs: mixes the examples, the guard must refuse it",
}


def _rate(dropout, default):
    return default if dropout is None else dropout


def _rng(seed):
    return np.random.default_rng(seed)


def _one_hot(labels, classes):
    return np.eye(classes, dtype="float32")[labels]


def _images(shape, seed=0):
    return _rng(seed).uniform(0.0, 1.0, size=(B, *shape)).astype("float32")


def _tokens(length, seed=0, padded=False):
    rng = _rng(seed)
    tokens = rng.integers(1, _VOCABULARY, size=(B, length))
    if padded:  # 2 to `length` real tokens, then zeros
        real = rng.integers(2, length + 1, size=B)
        tokens = tokens * (np.arange(length) < real[:, None])
    return tokens.astype("int32")


def _labels(classes, seed=1):
    return _rng(seed).integers(0, classes, size=B)


def _weights(seed=2):
    return _rng(seed).uniform(0.2, 2.0, size=B).astype("float32")


def _seeded(fn):
    """`fn(dropout=...)` after `keras.utils.set_random_seed(0)`."""
    def build(dropout=None):
        keras.utils.set_random_seed(0)
        return fn(dropout)
    build.__name__ = fn.__name__
    return build


def _zero_dropout(model):
    """Every Dropout layer of `model` (nested too) with rate 0."""
    stack = list(model.layers)
    while stack:
        layer = stack.pop()
        if isinstance(layer, layers.Dropout):
            layer.rate = 0.0
        stack.extend(getattr(layer, "layers", []) or [])
    return model


# --------------------------------------------------------------------------
# Images (keras.io "Simple MNIST convnet", "Image classification from
# scratch", the Oxford pets U-Net, the denoising autoencoder).


@_seeded
def mnist_convnet(dropout):
    return keras.Sequential([
        keras.Input((16, 16, 1)),
        layers.Conv2D(4, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.Conv2D(8, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dropout(_rate(dropout, 0.5)),
        layers.Dense(10, activation="softmax"),
    ])


def _mnist_data():
    return _images((16, 16, 1)), _one_hot(_labels(10), 10), None


@_seeded
def mnist_mlp(dropout):
    return keras.Sequential([
        keras.Input((16, 16)),
        layers.Flatten(),
        layers.Dense(16, activation="relu"),
        layers.Dropout(_rate(dropout, 0.2)),
        layers.Dense(10, activation="softmax"),
    ])


def _mnist_sparse_data():
    return _images((16, 16)), _labels(10), None


@_seeded
def cifar_augmented(dropout):
    augment = [] if dropout == 0.0 else [
        layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        *augment,
        layers.Rescaling(2.0, offset=-1.0),
        layers.Conv2D(4, 3, activation="relu"),
        layers.MaxPooling2D(2),
        layers.SeparableConv2D(8, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dropout(_rate(dropout, 0.25)),
        layers.Dense(10, activation="softmax"),
    ])


def _cifar_data():
    return _images((16, 16, 3)), _one_hot(_labels(10), 10), None


def _unet(outputs, activation):
    @_seeded
    def unet(dropout):
        del dropout
        inputs = keras.Input((16, 16, 3))
        h = layers.Conv2D(4, 3, strides=2, padding="same",
                          activation="relu")(inputs)
        skip = h
        h = layers.SeparableConv2D(8, 3, padding="same",
                                   activation="relu")(h)
        h = layers.MaxPooling2D(2, padding="same")(h)
        h = layers.Conv2DTranspose(8, 3, padding="same",
                                   activation="relu")(h)
        h = layers.UpSampling2D(2)(h)
        h = layers.add([h, layers.Conv2D(8, 1, padding="same")(skip)])
        h = layers.Conv2DTranspose(4, 3, strides=2, padding="same",
                                   activation="relu")(h)
        out = layers.Conv2D(outputs, 3, padding="same",
                            activation=activation)(h)
        return keras.Model(inputs, out)
    return unet


def _segmentation_classes_data():
    return (_images((16, 16, 3)),
            _rng(3).integers(0, 3, size=(B, 16, 16, 1)), None)


def _segmentation_mask_data():
    masks = (_rng(3).uniform(size=(B, 16, 16, 1)) > 0.6).astype("float32")
    return _images((16, 16, 3)), masks, None


@_seeded
def denoising_autoencoder(dropout):
    del dropout
    return keras.Sequential([
        keras.Input((16, 16, 1)),
        layers.Conv2D(4, 3, activation="relu", padding="same"),
        layers.MaxPooling2D(2, padding="same"),
        layers.Conv2D(4, 3, activation="relu", padding="same"),
        layers.Conv2DTranspose(4, 3, strides=2, activation="relu",
                               padding="same"),
        layers.Conv2D(1, 3, activation="sigmoid", padding="same"),
    ])


def _denoising_data():
    clean = _images((16, 16, 1), seed=4)
    noisy = np.clip(clean + 0.3 * _rng(5).normal(size=clean.shape), 0, 1)
    return noisy.astype("float32"), clean, None


# --------------------------------------------------------------------------
# Text (keras.io "Text classification from scratch", "Bidirectional LSTM on
# IMDB", "Text classification with Transformer", "Multi-label text
# classification", "Named entity recognition").


@_seeded
def imdb_embedding_pooling(dropout):
    del dropout
    return keras.Sequential([
        keras.Input((12,), dtype="int32"),
        layers.Embedding(_VOCABULARY, 8),
        layers.GlobalAveragePooling1D(),
        layers.Dense(8, activation="relu"),
        layers.Dense(1, activation="sigmoid"),
    ])


def _binary_text_data():
    return _tokens(12), _labels(2).astype("float32"), None


@_seeded
def imdb_conv1d(dropout):
    inputs = keras.Input((12,), dtype="int32")
    h = layers.Embedding(_VOCABULARY, 8)(inputs)
    h = layers.Dropout(_rate(dropout, 0.5))(h)
    h = layers.Conv1D(8, 3, padding="valid", activation="relu",
                      strides=2)(h)
    h = layers.Conv1D(8, 3, padding="valid", activation="relu")(h)
    h = layers.GlobalMaxPooling1D()(h)
    h = layers.Dense(8, activation="relu")(h)
    h = layers.Dropout(_rate(dropout, 0.5))(h)
    return keras.Model(
        inputs, layers.Dense(1, activation="sigmoid", name="predictions")(h))


def _weighted_binary_text_data():
    x, y, _ = _binary_text_data()
    return x, y, _weights()


@_seeded
def bidirectional_lstm(dropout):
    del dropout
    return keras.Sequential([
        keras.Input((8,), dtype="int32"),
        layers.Embedding(_VOCABULARY, 8),
        layers.Bidirectional(layers.LSTM(4, return_sequences=True)),
        layers.Bidirectional(layers.LSTM(4)),
        layers.Dense(1, activation="sigmoid"),
    ])


def _short_binary_text_data():
    return _tokens(8), _labels(2).astype("float32"), None


class TokenAndPositionEmbedding(layers.Layer):
    """keras.io's token + position embedding."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(layers.Layer):
    """keras.io's transformer block (post-norm, attention dropout)."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads,
                                             key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


@_seeded
def transformer_text(dropout):
    rate = _rate(dropout, 0.1)
    inputs = keras.Input((10,), dtype="int32")
    h = TokenAndPositionEmbedding(10, _VOCABULARY, 8)(inputs)
    h = TransformerBlock(8, 2, 16, rate)(h)
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dropout(rate)(h)
    h = layers.Dense(8, activation="relu")(h)
    h = layers.Dropout(rate)(h)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(h))


def _two_class_text_data():
    return _tokens(10), _labels(2), None


@_seeded
def multi_label_text(dropout):
    return keras.Sequential([
        keras.Input((20,)),  # TextVectorization(output_mode="multi_hot")
        layers.Dense(16, activation="relu"),
        layers.Dropout(_rate(dropout, 0.5)),
        layers.Dense(8, activation="relu"),
        layers.Dense(5, activation="sigmoid"),
    ])


def _multi_hot_data():
    rng = _rng(6)
    x = (rng.uniform(size=(B, 20)) > 0.7).astype("float32")
    y = (rng.uniform(size=(B, 5)) > 0.6).astype("float32")
    return x, y, None


@_seeded
def token_classification(dropout):
    inputs = keras.Input((10,), dtype="int32")
    h = layers.Embedding(_VOCABULARY, 8, mask_zero=True)(inputs)
    h = layers.Dense(16, activation="relu")(h)
    h = layers.Dropout(_rate(dropout, 0.1))(h)
    return keras.Model(inputs, layers.Dense(5, activation="softmax")(h))


def _tagged_tokens_data():
    x = _tokens(10, padded=True)
    return x, _rng(7).integers(0, 5, size=(B, 10)) * (x > 0), None


@_seeded
def ocr_ctc(dropout):
    inputs = keras.Input((16, 6))
    h = layers.Conv1D(8, 3, padding="same", activation="relu")(inputs)
    h = layers.Dense(8, activation="relu")(h)
    h = layers.Dropout(_rate(dropout, 0.2))(h)
    return keras.Model(inputs, layers.Dense(6)(h))  # 5 characters + blank


def _ctc_data():
    rng = _rng(8)
    labels = rng.integers(1, 6, size=(B, 4))
    lengths = rng.integers(1, 5, size=B)
    labels = labels * (np.arange(4) < lengths[:, None])
    return (rng.normal(size=(B, 16, 6)).astype("float32"),
            labels.astype("int32"), None)


# --------------------------------------------------------------------------
# Time series and structured data.


@_seeded
def timeseries_conv1d(dropout):
    del dropout
    return keras.Sequential([
        keras.Input((16, 1)),
        layers.Conv1D(4, 3, padding="same", activation="relu"),
        layers.LayerNormalization(),
        layers.Conv1D(4, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling1D(),
        layers.Dense(1),
    ])


def _series_data():
    rng = _rng(9)
    x = rng.normal(size=(B, 16, 1)).astype("float32")
    return x, 3.0 * rng.normal(size=(B, 1)).astype("float32"), None


@_seeded
def weather_lstm(dropout):
    del dropout
    return keras.Sequential([
        keras.Input((6, 3)), layers.LSTM(4), layers.Dense(1)])


def _weather_data():
    rng = _rng(10)
    return (rng.normal(size=(B, 6, 3)).astype("float32"),
            rng.normal(size=(B, 1)).astype("float32"), None)


def _tabular(units, activation, dropout_rate=0.0, regularizer=None):
    @_seeded
    def tabular(dropout):
        rate = _rate(dropout, dropout_rate)
        return keras.Sequential([
            keras.Input((6,)),
            layers.Dense(8, activation="relu",
                         kernel_regularizer=regularizer),
            *([layers.Dropout(rate)] if dropout_rate else []),
            layers.Dense(units, activation=activation),
        ])
    return tabular


def _tabular_x(seed=11):
    return _rng(seed).normal(size=(B, 6)).astype("float32")


def _binary_data():
    return _tabular_x(), _labels(2).astype("float32"), None


def _class_data(classes=4, weighted=False, one_hot=False):
    def data():
        y = _labels(classes)
        return (_tabular_x(), _one_hot(y, classes) if one_hot else y,
                _weights() if weighted else None)
    return data


def _soft_targets_data():
    logits = 2.0 * _rng(12).normal(size=(B, 5))
    soft = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return _tabular_x(), soft.astype("float32"), None


def _signed_data():
    return _tabular_x(), (2 * _labels(2) - 1).astype("float32"), None


def _positive_data(low, high, counts=False):
    def data():
        rng = _rng(13)
        if counts:
            y = rng.poisson(2.0, size=(B, 1))
        else:
            y = rng.uniform(low, high, size=(B, 1))
        return _tabular_x(), y.astype("float32"), None
    return data


def _regression_data():
    return (_tabular_x(),
            2.0 * _rng(14).normal(size=(B, 1)).astype("float32"), None)


def _vector_data():
    return (_tabular_x(), _rng(15).normal(size=(B, 4)).astype("float32"),
            None)


# Two inputs (an image and tabular features) and two outputs (keras.io's
# functional API guide: ticket priority and department).


@_seeded
def two_inputs(dropout):
    image = keras.Input((16, 16, 1), name="image")
    features = keras.Input((4,), name="features")
    h = layers.Conv2D(4, 3, activation="relu")(image)
    h = layers.GlobalAveragePooling2D()(h)
    g = layers.Dense(4, activation="relu")(features)
    h = layers.concatenate([h, g])
    h = layers.Dropout(_rate(dropout, 0.3))(h)
    return keras.Model({"image": image, "features": features},
                       layers.Dense(3, activation="softmax")(h))


def _two_inputs_data():
    x = {"image": _images((16, 16, 1)),
         "features": _rng(16).normal(size=(B, 4)).astype("float32")}
    return x, _labels(3), None


@_seeded
def two_outputs(dropout):
    del dropout
    title = keras.Input((6,), dtype="int32", name="title")
    body = keras.Input((10,), dtype="int32", name="body")
    tags = keras.Input((5,), name="tags")
    title_features = layers.GlobalAveragePooling1D()(
        layers.Embedding(_VOCABULARY, 8)(title))
    body_features = layers.GlobalAveragePooling1D()(
        layers.Embedding(_VOCABULARY, 8)(body))
    h = layers.concatenate([title_features, body_features, tags])
    priority = layers.Dense(1, activation="sigmoid", name="priority")(h)
    department = layers.Dense(4, activation="softmax",
                              name="department")(h)
    return keras.Model({"title": title, "body": body, "tags": tags},
                       {"priority": priority, "department": department})


def _two_outputs_data():
    rng = _rng(17)
    x = {"title": _tokens(6, seed=18), "body": _tokens(10, seed=19),
         "tags": (rng.uniform(size=(B, 5)) > 0.5).astype("float32")}
    y = {"priority": rng.uniform(size=(B, 1)).astype("float32"),
         "department": _one_hot(_labels(4), 4)}
    return x, y, None


# --------------------------------------------------------------------------
# keras-hub task models, tiny configurations built from config (no preset
# download), fed token ids directly (preprocessor=None).


def _bert(activation):
    @_seeded
    def bert(dropout):
        import keras_hub  # pylint: disable=import-outside-toplevel
        rate = _rate(dropout, 0.1)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2,
            hidden_dim=16, intermediate_dim=32, max_sequence_length=16,
            dropout=rate)
        return keras_hub.models.BertTextClassifier(
            backbone, num_classes=3, preprocessor=None,
            activation=activation, dropout=rate)
    return bert


def _bert_data():
    tokens = _tokens(12, seed=20, padded=True)
    x = {"token_ids": tokens, "padding_mask": tokens > 0,
         "segment_ids": np.zeros_like(tokens)}
    return x, _labels(3), None


@_seeded
def gpt2_causal_lm(dropout):
    import keras_hub  # pylint: disable=import-outside-toplevel
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=_VOCABULARY, num_layers=1, num_heads=2,
        hidden_dim=16, intermediate_dim=32, max_sequence_length=16,
        dropout=_rate(dropout, 0.1))
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _causal_lm_data():
    """What GPT2CausalLMPreprocessor gives: y the next tokens, the padding
    mask as per-token sample weights."""
    tokens = _tokens(11, seed=21, padded=True)
    mask = tokens > 0
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return x, tokens[:, 1:], mask[:, 1:].astype("float32")


# --------------------------------------------------------------------------
# keras.applications (BatchNormalization replaced by `tf_dpadam.fix`), with
# their default softmax heads.


def _application(name, batch_norm, size, **kwargs):
    @_seeded
    def application(dropout):
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(size, size, 3), classes=10, **kwargs)
        fixed = tf_dpadam.fix(model, batch_norm=batch_norm)
        return _zero_dropout(fixed) if dropout == 0.0 else fixed
    return application


@_seeded
def keras_hub_resnet_classifier(dropout):
    import keras_hub  # pylint: disable=import-outside-toplevel
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 16], stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2], block_type="basic_block",
        use_pre_activation=False, image_shape=(16, 16, 3))
    inputs = keras.Input((16, 16, 3))
    h = layers.GlobalAveragePooling2D()(
        tf_dpadam.fix(backbone, batch_norm="freeze")(inputs))
    h = layers.Dropout(_rate(dropout, 0.2))(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h))


def _application_data(classes_one_hot=False, size=64, scale=(-1.0, 1.0)):
    """Images scaled as the model's `preprocess_input` does (EfficientNet
    rescales 0..255 itself)."""
    def data():
        y = _labels(10)
        low, high = scale
        return (low + (high - low) * _images((size, size, 3)),
                _one_hot(y, 10) if classes_one_hot else y, None)
    return data


# --------------------------------------------------------------------------
# The corpus.

_L = keras.losses

CORPUS = {
    # Images.
    "mnist_convnet": Case(mnist_convnet, "categorical_crossentropy",
                          _mnist_data),
    "mnist_mlp_sparse": Case(mnist_mlp, "sparse_categorical_crossentropy",
                             _mnist_sparse_data),
    "cifar_augmented_label_smoothing": Case(
        cifar_augmented, _L.CategoricalCrossentropy(label_smoothing=0.1),
        _cifar_data),
    "unet_segmentation": Case(
        _unet(3, "softmax"), _L.SparseCategoricalCrossentropy(),
        _segmentation_classes_data),
    "unet_dice": Case(_unet(1, "sigmoid"), _L.Dice(axis=(1, 2, 3)),
                      _segmentation_mask_data),
    "unet_tversky": Case(_unet(1, "sigmoid"),
                         _L.Tversky(alpha=0.3, beta=0.7, axis=(1, 2, 3)),
                         _segmentation_mask_data),
    "denoising_autoencoder": Case(denoising_autoencoder,
                                  "binary_crossentropy", _denoising_data),
    # Text and sequences.
    "imdb_embedding_pooling": Case(imdb_embedding_pooling,
                                   "binary_crossentropy", _binary_text_data),
    "imdb_conv1d_sample_weights": Case(imdb_conv1d, _L.BinaryCrossentropy(),
                                       _weighted_binary_text_data),
    "bidirectional_lstm": Case(bidirectional_lstm, "binary_crossentropy",
                               _short_binary_text_data),
    "transformer_text": Case(transformer_text,
                             "sparse_categorical_crossentropy",
                             _two_class_text_data),
    "multi_label_text": Case(multi_label_text, _L.BinaryCrossentropy(),
                             _multi_hot_data),
    "token_classification_masked": Case(
        token_classification, _L.SparseCategoricalCrossentropy(),
        _tagged_tokens_data),
    "ocr_ctc": Case(ocr_ctc, _L.CTC(), _ctc_data),
    # Time series and structured data.
    "timeseries_conv1d_huber": Case(timeseries_conv1d, _L.Huber(),
                                    _series_data),
    "weather_lstm_mse": Case(weather_lstm, _L.MeanSquaredError(),
                             _weather_data),
    "binary_focal": Case(
        _tabular(1, "sigmoid"),
        _L.BinaryFocalCrossentropy(apply_class_balancing=True, gamma=2.0),
        _binary_data),
    "binary_focal_logits_label_smoothing": Case(
        _tabular(1, None),
        _L.BinaryFocalCrossentropy(from_logits=True, label_smoothing=0.1),
        _binary_data),
    "categorical_focal": Case(
        _tabular(4, "softmax", 0.2), _L.CategoricalFocalCrossentropy(),
        _class_data(one_hot=True)),
    "softmax_sample_weights": Case(
        _tabular(4, "softmax", 0.2), _L.SparseCategoricalCrossentropy(),
        _class_data(weighted=True)),
    "logits_sparse_cce": Case(
        _tabular(4, None, 0.2),
        _L.SparseCategoricalCrossentropy(from_logits=True), _class_data()),
    "logits_binary_cce": Case(
        _tabular(1, None), _L.BinaryCrossentropy(from_logits=True),
        _binary_data),
    "generalized_cross_entropy": Case(
        _tabular(4, "softmax"),
        _L.CategoricalGeneralizedCrossEntropy(q=0.7), _class_data()),
    "kl_divergence_distillation": Case(
        _tabular(5, "softmax"), _L.KLDivergence(), _soft_targets_data),
    "poisson_counts": Case(_tabular(1, "softplus"), _L.Poisson(),
                           _positive_data(0, 0, counts=True)),
    "cosine_similarity": Case(_tabular(4, None),
                              _L.CosineSimilarity(axis=-1), _vector_data),
    "hinge": Case(_tabular(1, "tanh"), _L.Hinge(), _signed_data),
    "squared_hinge": Case(_tabular(1, "tanh"), _L.SquaredHinge(),
                          _binary_data),
    "categorical_hinge": Case(_tabular(4, None), _L.CategoricalHinge(),
                              _class_data(one_hot=True)),
    "mape": Case(_tabular(1, "softplus"), _L.MeanAbsolutePercentageError(),
                 _positive_data(1.0, 3.0)),
    "msle": Case(_tabular(1, "softplus"), _L.MeanSquaredLogarithmicError(),
                 _positive_data(0.5, 4.0)),
    "log_cosh_l2_regularized": Case(
        _tabular(1, None, regularizer=keras.regularizers.L2(1e-2)),
        _L.LogCosh(), _regression_data),
    "mae": Case(_tabular(1, None), _L.MeanAbsoluteError(), _regression_data),
    "two_inputs": Case(two_inputs, "sparse_categorical_crossentropy",
                       _two_inputs_data),
    "two_outputs_loss_weights": Case(
        two_outputs,
        {"priority": _L.BinaryCrossentropy(),
         "department": "categorical_crossentropy"},
        _two_outputs_data,
        loss_weights={"priority": 1.0, "department": 0.2}),
    # keras-hub tasks.
    "bert_classifier_logits": Case(
        _bert(None), _L.SparseCategoricalCrossentropy(from_logits=True),
        _bert_data),
    "bert_classifier_softmax": Case(
        _bert("softmax"), "sparse_categorical_crossentropy", _bert_data),
    "gpt2_causal_lm": Case(
        gpt2_causal_lm, _L.SparseCategoricalCrossentropy(from_logits=True),
        _causal_lm_data),
    "keras_hub_resnet_fixed": Case(
        keras_hub_resnet_classifier, "sparse_categorical_crossentropy",
        _application_data(size=16)),
    # keras.applications, fixed.
    "mobilenet_v2_fixed": Case(
        _application("MobileNetV2", "group", 64, alpha=0.35),
        _L.SparseCategoricalCrossentropy(), _application_data()),
    "efficientnet_b0_fixed": Case(
        _application("EfficientNetB0", "group", 64),
        "categorical_crossentropy",
        _application_data(True, scale=(0.0, 255.0))),
}
