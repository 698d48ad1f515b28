"""Ghost clipping: the sum of clipped per-example gradients, batched.

`privatizer.per_example_gradients` differentiates every example on its own
(a vectorized map over a one-example backward pass). For the layers below the
per-example gradient of a weight is a known function of two batched tensors,
the layer's input `a` and the gradient `g` of the loss w.r.t. the layer's
output `z` (Goodfellow 2015; Li et al. 2021, "ghost clipping"; Bu et al. 2022,
"book-keeping"). One step then costs

1. one batched forward pass that records, for each supported layer, `a` and
   `z` (the layer's call is intercepted and `z = a W + b` is computed here,
   before the activation);
2. one batched backward pass of `sum_i loss_i` to the recorded `z`: since
   example i's loss depends on the batch through `z_i` only (no layer mixes
   examples), `dL/dz` gives each example's output gradient `g_i`;
3. each example's squared gradient norm per layer from `(a_i, g_i)`, either
   without forming `a_i^T g_i` ("ghost norm", `sum_{t,s} (a_t.a_s)(g_t.g_s)`)
   or by materializing `a_i^T g_i`, whichever is cheaper;
4. the clip factors `c_i = min(1, C / ||g_i||)` (times the mask) and the clipped
   sum `sum_i c_i a_i^T g_i` per layer, again from `(a, g)` ("book-keeping":
   no second backward pass).

The result equals explicit per-example clipping up to float rounding.

Layers:

* ghost: `Dense`, `EinsumDense` (equations whose kernel axes are each either
  contracted or an output axis), `Embedding`, `LayerNormalization`, `Conv1D`
  and `Conv2D` (`groups=1`, through image patches). Exact classes or
  subclasses that do not override `call` and have no trainable weights but
  the rule's own (kernel, bias, ...); not LoRA-enabled nor quantized.
* layers without weights of their own (`MultiHeadAttention`, `Sequential`,
  functional and subclassed models, custom blocks) are looked into: their
  sublayers are handled one by one.
* any other layer with trainable weights (`LSTM`, `GRU`, `Bidirectional`,
  `TimeDistributed`, `Conv3D`, `DepthwiseConv2D`, custom layers, ...) is a
  "fallback unit": its own per-example gradients are computed by a
  vectorized map over that layer alone (its recorded input and output
  gradient), so only that layer pays for per-example backward passes.
* frozen layers (`trainable=False`) cost nothing more than in the forward pass.

Weight regularizers (`kernel_regularizer`, ...) are supported: as in the
vectorized path, every example's loss includes the full regularization term
R, so each example's gradient is `h_i + grad R`; its squared norm is
`||h_i||^2 + 2 h_i.grad R + ||grad R||^2` and the clipped sum
`sum_i c_i h_i + (sum_i c_i) grad R`.

Not supported (`clipped_sum` raises `GhostClippingUnsupportedError`; use the
vectorized path): activity regularizers and `add_loss` in `call`, a fallback
unit containing random layers (its replay would not see the forward's random
draws), layers called inside control flow (`tf.while_loop`, `tf.cond`),
rematerialization, a trainable variable used outside its layer's `call`
(detected: each supported layer computes with `stop_gradient` of its weights,
so any other differentiable use shows up as a gradient), a recorded tensor
whose leading axis is not the batch axis (detected statically, and at run
time by a reshape to the batch size), `LayerNormalization` over the batch
axis, and a root model that owns trainable weights directly.

Requirement shared with the vectorized path and checked by `make_private`
only for BatchNormalization: no layer may mix the examples of a batch in
training. Unlike the vectorized path (which runs every example as a batch of
one), ghost clipping runs the batch through the model, so a custom layer that
mixes examples would break the per-example decomposition.
"""

import contextlib
import math
import string

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam import dp_math
from tf_dpadam import privatizer
from tf_dpadam import vectorization

try:  # Keras internals (stable across Keras 3 releases).
    from keras.src.backend.common.keras_tensor import any_symbolic_tensors
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.common.masking import get_keras_mask
    from keras.src.backend.common.masking import set_keras_mask
except ImportError:  # pragma: no cover
    def any_symbolic_tensors(args=None, kwargs=None):
        leaves = tf.nest.flatten((args, kwargs))
        return any(isinstance(x, keras.KerasTensor) for x in leaves)

    def get_keras_mask(x):
        return getattr(x, "_keras_mask", None)

    def in_stateless_scope():
        return False

    def set_keras_mask(x, mask):
        x._keras_mask = mask


class GhostClippingUnsupportedError(Exception):
    """The model (or this trace of it) cannot use ghost clipping.

    Raised while tracing, before anything is applied; the caller falls back to
    `privatizer.per_example_gradients` + `privatizer.clip_and_sum`. (Derives
    from `Exception` without its own `__init__` so that AutoGraph re-raises
    it with its type instead of wrapping it in a `StagingError`.)
    """


# Per-example squared norms of a kernel used at T positions (T > 1): the
# ghost norm costs about T^2 (d + p) and memory T^2 per example; materializing
# a_i^T g_i costs T d p and memory d p per example (and makes the clipped sum
# a cheap weighted sum). Materialize unless d p exceeds this many times T^2.
MATERIALIZE_MAX_RATIO = 1.0
# When T is not known statically: materialize while d p is at most this.
MATERIALIZE_MAX_UNKNOWN_T = 1 << 16
# Convolutions: the image patches of a layer's input are `T d` floats per
# example. The per-example norms take the batch in chunks of about this many
# patch floats (at least one example), so that the patches of the whole batch
# are never held at once; the clipped sum needs no patches at all. Measured
# on the paper's CNN at B=256 (benchmarks/benchmark.py): 4M floats (16 MiB)
# peaked at ~1.6x the tensor memory of a non-private step, 1M at ~1.2x.
CONV_PATCH_FLOATS_PER_CHUNK = 1 << 20

# Layers that are never looked into (their sublayers run inside control flow
# or on reshaped batches): with trainable weights they are fallback units.
_OPAQUE_LAYERS = (keras.layers.RNN, keras.layers.Wrapper)
_EXAMPLE_MIXING_LAYERS = (keras.layers.BatchNormalization,)


# ----------------------------------------------------------------------------
# Per-example blocks: the per-example gradient of one variable, in a form that
# gives its squared norms, its dot product with a fixed tensor (the gradient of
# the regularization) and its factor-weighted sum over examples.


class _MaterializedBlock:
    """Per-example gradients `[B, *var.shape]`, materialized."""

    def __init__(self, per_example):
        self.per_example = per_example

    def _flat(self):
        g = self.per_example
        return ops.reshape(g, (ops.shape(g)[0], -1))

    def squared_norms(self, reg_grad=None):
        flat = self._flat()
        sq = ops.sum(ops.square(flat), axis=1)
        if reg_grad is not None:
            sq = sq + 2.0 * ops.matmul(
                flat, ops.reshape(ops.cast(reg_grad, flat.dtype), (-1,))
            )
        return sq

    def clipped_sum(self, factors):
        return tf.tensordot(factors, self.per_example, axes=[[0], [0]])


class _LinearBlock:
    """A weight used as `z_t = a_t W` at T positions: grad_i = sum_t a_t^T g_t.

    `a` is `[B, T, d]`, `g` is `[B, T, p]`, and `to_matrix` / `from_matrix` map
    the variable's shape to `[d, p]` and back.
    """

    def __init__(self, a, g, to_matrix, from_matrix):
        self.a, self.g = a, g
        self.to_matrix, self.from_matrix = to_matrix, from_matrix
        t = a.shape[1]
        d, p = a.shape[2], g.shape[2]
        if t == 1:
            self.mode = "outer"
        elif t is None:
            self.mode = (
                "materialize" if d * p <= MATERIALIZE_MAX_UNKNOWN_T else "ghost"
            )
        else:
            self.mode = (
                "materialize" if d * p <= MATERIALIZE_MAX_RATIO * t * t
                else "ghost"
            )
        self.per_example = None
        if self.mode == "materialize":
            self.per_example = tf.einsum("btd,btp->bdp", a, g)

    def squared_norms(self, reg_grad=None):
        a, g = self.a, self.g
        reg = None if reg_grad is None else self.to_matrix(reg_grad)
        if self.mode == "materialize":
            sq = ops.sum(ops.square(self.per_example), axis=(1, 2))
            if reg is not None:
                sq = sq + 2.0 * tf.einsum("bdp,dp->b", self.per_example, reg)
            return sq
        if self.mode == "outer":
            sq = ops.sum(ops.square(a), axis=(1, 2)) * ops.sum(
                ops.square(g), axis=(1, 2)
            )
        else:
            aa = tf.matmul(a, a, transpose_b=True)
            gg = tf.matmul(g, g, transpose_b=True)
            sq = ops.sum(aa * gg, axis=(1, 2))
        if reg is not None:
            sq = sq + 2.0 * ops.sum(tf.einsum("btd,dp->btp", a, reg) * g,
                                    axis=(1, 2))
        return sq

    def clipped_sum(self, factors):
        if self.per_example is not None:
            matrix = tf.tensordot(factors, self.per_example, axes=[[0], [0]])
        else:
            a, g = self.a, self.g
            # Scale the smaller of the two.
            if (a.shape[2] or 0) <= (g.shape[2] or 0):
                a = a * factors[:, None, None]
            else:
                g = g * factors[:, None, None]
            matrix = tf.einsum("btd,btp->dp", a, g)
        return self.from_matrix(matrix)


class _EmbeddingBlock:
    """Embedding rows gathered at ids `[B, T]`: grad_i = sum_t e_{id_t} g_t^T.

    Squared norm: sum over distinct ids of ||sum of g_t with that id||^2,
    computed by sorting each example's ids and summing runs (O(B T p)).
    """

    def __init__(self, ids, g, vocabulary_size):
        self.ids, self.g = ids, g
        self.vocabulary_size = vocabulary_size

    def squared_norms(self, reg_grad=None):
        ids, g = self.ids, self.g
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        order = tf.argsort(ids, axis=1, stable=True)
        sorted_ids = tf.gather(ids, order, batch_dims=1)
        sorted_g = tf.gather(g, order, batch_dims=1)
        new_run = tf.concat(
            [tf.ones([batch, 1], tf.int32),
             tf.cast(sorted_ids[:, 1:] != sorted_ids[:, :-1], tf.int32)],
            axis=1,
        )
        runs = tf.cumsum(new_run, axis=1) - 1
        segments = runs + tf.range(batch)[:, None] * length
        sums = tf.math.unsorted_segment_sum(
            tf.reshape(sorted_g, [batch * length, -1]),
            tf.reshape(segments, [-1]),
            batch * length,
        )
        sq = ops.sum(
            tf.reshape(ops.sum(ops.square(sums), axis=1), [batch, length]),
            axis=1,
        )
        if reg_grad is not None:
            rows = tf.gather(ops.cast(reg_grad, g.dtype), ids)
            sq = sq + 2.0 * ops.sum(rows * g, axis=(1, 2))
        return sq

    def clipped_sum(self, factors):
        g = self.g * factors[:, None, None]
        return tf.math.unsorted_segment_sum(
            tf.reshape(g, [-1, tf.shape(g)[2]]),
            tf.reshape(self.ids, [-1]),
            self.vocabulary_size,
        )


# ----------------------------------------------------------------------------
# Handlers: intercept a layer's call during the forward pass, record what the
# per-example gradients need, and turn the records into blocks.


def _watch_float(tape, structure):
    taps = []
    for t in tf.nest.flatten(structure):
        if tf.is_tensor(t) and t.dtype.is_floating:
            tape.watch(t)
            taps.append(t)
        else:
            taps.append(None)
    return taps


class _Handler:
    """Base: owns `variables` (trainable, of this layer or its subtree)."""

    kind = "ghost"

    def __init__(self, layer, variables):
        self.layer = layer
        self.variables = variables
        self.records = []
        self._saved_call = None

    def reset(self):
        self.records = []

    def install(self, session):
        layer = self.layer
        original = type(layer).call.__get__(layer)
        saved = layer.__dict__.get("call")
        if saved is not None:
            original = saved
        self._saved_call = saved

        def call(*args, **kwargs):
            if any_symbolic_tensors(args, kwargs) or not session.recording:
                return original(*args, **kwargs)
            if not session.same_graph():
                session.error(
                    f"layer {layer.name!r} is called inside control flow"
                    " (tf.while_loop, tf.cond, tf.map_fn, ...)"
                )
                return original(*args, **kwargs)
            return self.intercept(session, original, *args, **kwargs)

        object.__setattr__(layer, "call", call)

    def uninstall(self):
        layer = self.layer
        if self._saved_call is not None:
            object.__setattr__(layer, "call", self._saved_call)
        else:
            object.__delattr__(layer, "call")

    def taps(self):
        """The tensors whose gradients `blocks` needs, one list per record."""
        return [record["taps"] for record in self.records]

    def intercept(self, session, original, *args, **kwargs):
        raise NotImplementedError

    def blocks(self, session, tap_grads):
        """`{id(var): [block, ...]}` from the records and their tap grads."""
        raise NotImplementedError

    def _var(self, name):
        v = getattr(self.layer, name, None)
        if v is None or id(v) not in {id(w) for w in self.variables}:
            return None
        return v


def _first_input(args, kwargs):
    if args:
        return args[0]
    return kwargs["inputs"]


def _stopped(variable):
    return tf.stop_gradient(ops.convert_to_tensor(variable.value))


class _DenseHandler(_Handler):

    weight_names = ("kernel", "bias")

    def _product(self, a, kernel):
        """The layer's `a W` (before bias and activation)."""
        return ops.matmul(a, kernel)

    def intercept(self, session, original, *args, **kwargs):
        layer = self.layer
        a = _first_input(args, kwargs)
        z = self._product(a, _stopped(layer.kernel))
        if layer.bias is not None:
            z = ops.add(z, _stopped(layer.bias))
        session.tape.watch(z)
        self.records.append({"a": session.check_batch(a, layer), "taps": [z]})
        return layer.activation(z) if layer.activation is not None else z

    def blocks(self, session, tap_grads):
        layer = self.layer
        kernel, bias = self._var("kernel"), self._var("bias")
        d, p = layer.kernel.shape
        out = {}
        a_list, g_list, bias_grads = [], [], []
        for record, (g,) in zip(self.records, tap_grads):
            a = ops.cast(record["a"], "float32")
            g = ops.cast(g, "float32")
            a_list.append(tf.reshape(a, [session.batch_size, -1, d]))
            g_list.append(tf.reshape(g, [session.batch_size, -1, p]))
            bias_grads.append(ops.sum(g_list[-1], axis=1))
        if kernel is not None:
            out[id(kernel)] = [_LinearBlock(
                ops.concatenate(a_list, axis=1), ops.concatenate(g_list, axis=1),
                to_matrix=lambda w: ops.cast(w, "float32"),
                from_matrix=lambda m: m,
            )]
        if bias is not None:
            out[id(bias)] = [_MaterializedBlock(ops.sum(bias_grads, axis=0))]
        return out


def _parse_einsum(equation):
    """`(input, kernel, output, left_elided)` or raises ValueError."""
    equation = equation.replace(" ", "")
    lhs, output = equation.split("->")
    inputs, kernel = lhs.split(",")
    left = inputs.startswith("...")
    if "..." in kernel or ("..." in inputs) != ("..." in output):
        raise ValueError("unsupported ellipsis")
    if "..." in inputs:
        if left != output.startswith("..."):
            raise ValueError("unsupported ellipsis")
        if not left and not (inputs.endswith("...") and output.endswith("...")):
            raise ValueError("unsupported ellipsis")
    letters = [s.replace("...", "") for s in (inputs, kernel, output)]
    for spec in letters:
        if len(set(spec)) != len(spec):
            raise ValueError("repeated index")
    x, w, y = letters
    for c in w:
        if (c in x) == (c in y):
            raise ValueError(
                f"kernel index {c!r} is neither only contracted nor only an"
                " output index"
            )
    for c in x:
        if c not in w and c not in y:
            raise ValueError(f"input index {c!r} is summed without the kernel")
    for c in y:
        if c not in x and c not in w:
            raise ValueError(f"output index {c!r} is unknown")
    if not left:
        if not x or x[0] in w or not y or y[0] != x[0]:
            raise ValueError("the batch axis must lead input and output")
    return inputs, kernel, output, left


def _expand_einsum(inputs, kernel, output, rank):
    """Replaces `...` by fresh letters for an input of the given rank."""
    if "..." not in inputs:
        return inputs, kernel, output
    used = set(inputs + kernel + output)
    fresh = [c for c in string.ascii_letters if c not in used]
    n = rank - (len(inputs) - 3)
    dots = "".join(fresh[:n])
    return (inputs.replace("...", dots), kernel, output.replace("...", dots))


def _transpose_to(tensor, spec, target):
    perm = [spec.index(c) for c in target]
    if perm == list(range(len(perm))):
        return tensor
    return tf.transpose(tensor, perm)


class _EinsumDenseHandler(_DenseHandler):

    def _product(self, a, kernel):
        return ops.einsum(self.layer.equation, a, kernel)

    def blocks(self, session, tap_grads):
        layer = self.layer
        kernel, bias = self._var("kernel"), self._var("bias")
        inputs, w_spec, output, _ = _parse_einsum(layer.equation)
        contracted = "".join(c for c in w_spec if c in inputs)
        produced = "".join(c for c in w_spec if c in output)
        w_dims = dict(zip(w_spec, layer.kernel.shape))
        d = math.prod(w_dims[c] for c in contracted)
        p = math.prod(w_dims[c] for c in produced)
        matrix_spec = contracted + produced

        def to_matrix(w):
            w = _transpose_to(ops.cast(w, "float32"), w_spec, matrix_spec)
            return tf.reshape(w, [d, p])

        def from_matrix(m):
            m = tf.reshape(m, [w_dims[c] for c in matrix_spec])
            return _transpose_to(m, matrix_spec, w_spec)

        a_list, g_list, bias_grads = [], [], []
        batch = session.batch_size
        for record, (g,) in zip(self.records, tap_grads):
            a = ops.cast(record["a"], "float32")
            g = ops.cast(g, "float32")
            x_spec, _, y_spec = _expand_einsum(
                inputs, w_spec, output, len(a.shape)
            )
            positions = "".join(
                c for c in x_spec[1:] if c not in w_spec
            )
            lead = x_spec[0]
            a_t = _transpose_to(a, x_spec, lead + positions + contracted)
            g_t = _transpose_to(g, y_spec, lead + positions + produced)
            a_list.append(tf.reshape(a_t, [batch, -1, d]))
            g_list.append(tf.reshape(g_t, [batch, -1, p]))
            if bias is not None:
                bias_grads.append(_reduce_to_shape(g, bias.shape))
        out = {}
        if kernel is not None:
            out[id(kernel)] = [_LinearBlock(
                ops.concatenate(a_list, axis=1), ops.concatenate(g_list, axis=1),
                to_matrix=to_matrix, from_matrix=from_matrix,
            )]
        if bias is not None:
            out[id(bias)] = [_MaterializedBlock(ops.sum(bias_grads, axis=0))]
        return out


def _reduce_to_shape(g, shape):
    """Per-example gradient `[B, *shape]` of a parameter broadcast onto `g`.

    `g` is `[B, ...]` and the parameter of `shape` is added with numpy
    broadcasting (right-aligned) to the non-batch axes.
    """
    shape = tuple(shape)
    rest = len(g.shape) - 1
    padded = (1,) * (rest - len(shape)) + shape
    axes = [
        i + 1 for i, s in enumerate(padded)
        if s == 1 and (g.shape[i + 1] is None or g.shape[i + 1] != 1)
    ]
    if axes:
        g = ops.sum(g, axis=axes, keepdims=True)
    return tf.reshape(g, [tf.shape(g)[0], *shape])


def _same_padding(size, kernel, stride, rate):
    """TensorFlow's "SAME" padding `(before, after, output size)`."""
    effective = (kernel - 1) * rate + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2, out


def _batch_slice(t, start, size):
    """`t[start:start + size]` for a dynamic `start` and a static `size`.

    Every size is given explicitly (static where known): with a dynamic start
    and size -1 ("to the end"), XLA pads the operand to twice its size in
    every dimension before slicing (16x the output gradient of a 2-D
    convolution, 512 MiB for the paper's first layer at B = 256).
    """
    rest = [d if d is not None else tf.shape(t)[i + 1]
            for i, d in enumerate(t.shape[1:])]
    return tf.slice(t, [start] + [0] * len(rest), [size] + rest)


def _image_patches(x, sizes, strides, rates, padding):
    """`tf.image.extract_patches` (channels last) of `x` `[B, H, W, C]`.

    Returns `[B, H', W', kh * kw * C]` with the depth ordered (row, column,
    channel), like a `[kh, kw, C, F]` kernel reshaped to `[kh * kw * C, F]`.
    With static spatial sizes the patches are strided slices of the padded
    input concatenated on the channel axis, which is several times faster
    on CPU than the ExtractImagePatches kernel.
    """
    padding = padding.upper()
    height, width = x.shape[1], x.shape[2]
    if height is None or width is None:
        return tf.image.extract_patches(
            x, sizes=[1, *sizes, 1], strides=[1, *strides, 1],
            rates=[1, *rates, 1], padding=padding,
        )
    pads, outs = [], []
    for size, kernel, stride, rate in zip((height, width), sizes, strides,
                                          rates):
        if padding == "SAME":
            before, after, out = _same_padding(size, kernel, stride, rate)
        else:
            before, after = 0, 0
            out = -(-(size - (kernel - 1) * rate) // stride)
        pads.append((before, after))
        outs.append(out)
    if any(p != (0, 0) for p in pads):
        x = tf.pad(x, [(0, 0), *pads, (0, 0)])
    pieces = []
    for i in range(sizes[0]):
        for j in range(sizes[1]):
            top, left = i * rates[0], j * rates[1]
            pieces.append(x[
                :,
                top:top + (outs[0] - 1) * strides[0] + 1:strides[0],
                left:left + (outs[1] - 1) * strides[1] + 1:strides[1],
                :,
            ])
    if len(pieces) == 1:
        return pieces[0]
    return tf.concat(pieces, axis=-1)


class _ConvHandler(_Handler):
    """`Conv1D` / `Conv2D`: a Dense on image patches."""

    weight_names = ("kernel", "bias")

    def intercept(self, session, original, *args, **kwargs):
        layer = self.layer
        x = _first_input(args, kwargs)
        padding = layer.padding
        if padding == "causal":
            x = ops.pad(x, layer._compute_causal_padding())
            padding = "valid"
        z = ops.conv(
            x, _stopped(layer.kernel), strides=list(layer.strides),
            padding=padding, dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        if layer.use_bias:
            if layer.data_format == "channels_last":
                shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                shape = (1, layer.filters) + (1,) * layer.rank
            z = ops.add(z, ops.reshape(_stopped(layer.bias), shape))
        session.tape.watch(z)
        self.records.append({
            "a": session.check_batch(x, layer), "padding": padding, "taps": [z]
        })
        return layer.activation(z) if layer.activation is not None else z

    def blocks(self, session, tap_grads):
        layer = self.layer
        kernel, bias = self._var("kernel"), self._var("bias")
        inputs, grads = [], []
        for record, (g,) in zip(self.records, tap_grads):
            x = ops.cast(record["a"], "float32")
            g = ops.cast(g, "float32")
            if layer.data_format == "channels_first":
                x = tf.transpose(x, [0, *range(2, layer.rank + 2), 1])
                g = tf.transpose(g, [0, *range(2, layer.rank + 2), 1])
            if layer.rank == 1:
                x, g = x[:, None], g[:, None]
            inputs.append((x, record["padding"]))
            grads.append(g)
        out = {}
        if kernel is not None:
            out[id(kernel)] = [_ConvBlock(self, inputs, grads, session)]
        if bias is not None:
            out[id(bias)] = [_MaterializedBlock(tf.add_n([
                ops.sum(g, axis=(1, 2)) for g in grads
            ]))]
        return out


class _ConvBlock:
    """A convolution kernel used on one or more inputs (channels last, 2-D).

    Example i's kernel gradient is `sum_t patch_t(x_i)^T g_{i,t}`, a
    `_LinearBlock` on image patches. The squared norms are computed from the
    patches of a chunk of examples at a time (`CONV_PATCH_FLOATS_PER_CHUNK`),
    one chunk after the other; the clipped sum `sum_i c_i grad_i` is the
    kernel gradient of the batched convolution of the inputs `c_i x_i` with
    output gradients `g_i` (or of `x_i` with `c_i g_i`, whichever copy is
    smaller): one filter-gradient op, no patches.
    """

    def __init__(self, handler, inputs, grads, session):
        layer = handler.layer
        self.layer = layer
        self.inputs, self.grads = inputs, grads
        self.batch_size = session.batch_size
        self.shape = tuple(layer.kernel.shape)
        self.kernel_size = list(layer.kernel_size)
        self.strides = list(layer.strides)
        self.rates = list(layer.dilation_rate)
        if layer.rank == 1:
            self.kernel_size = [1] + self.kernel_size
            self.strides = [1] + self.strides
            self.rates = [1] + self.rates
        self.d = math.prod(self.shape[:-1])
        self.p = self.shape[-1]
        positions = [
            math.prod(g.shape[1:3]) if None not in g.shape[1:3] else None
            for g in grads
        ]
        if None in positions:
            self.chunk = 32
        else:
            self.chunk = max(
                1, CONV_PATCH_FLOATS_PER_CHUNK // (sum(positions) * self.d)
            )

    def _to_matrix(self, w):
        return tf.reshape(ops.cast(w, "float32"), [self.d, self.p])

    def _linear_block(self, inputs, grads, start=0, size=None):
        """The `_LinearBlock` of examples `start` to `start + size` (all)."""
        a_list, g_list = [], []
        for (x, padding), g in zip(inputs, grads):
            if size is not None:
                x = _batch_slice(x, start, size)
                g = _batch_slice(g, start, size)
            patches = _image_patches(x, self.kernel_size, self.strides,
                                     self.rates, padding)
            t = patches.shape[1] * patches.shape[2] if None not in (
                patches.shape[1], patches.shape[2]) else -1
            a_list.append(tf.reshape(patches, [tf.shape(x)[0], t, self.d]))
            g_list.append(tf.reshape(g, [tf.shape(x)[0], t, self.p]))
        a = ops.concatenate(a_list, axis=1) if len(a_list) > 1 else a_list[0]
        g = ops.concatenate(g_list, axis=1) if len(g_list) > 1 else g_list[0]
        return _LinearBlock(a, g, self._to_matrix, None)

    def squared_norms(self, reg_grad=None):
        static = self.grads[0].shape[0]
        chunk = self.chunk
        if static is not None and static <= chunk:
            block = self._linear_block(self.inputs, self.grads)
            return block.squared_norms(reg_grad)

        def one_chunk(start):
            block = self._linear_block(inputs, grads, start, chunk)
            return block.squared_norms(reg_grad)

        def chunk_norms(starts):
            # One chunk at a time: parallel iterations would hold their
            # patches together again.
            return tf.map_fn(
                one_chunk, starts,
                fn_output_signature=tf.TensorSpec([chunk], tf.float32),
                parallel_iterations=1,
            )

        if static is not None:
            # Chunks of a static size; the last one ends at the batch's end,
            # overlapping its predecessor (the overlap's norms are computed
            # twice and dropped). No padded copy of the batch is made.
            inputs, grads = self.inputs, self.grads
            count = -(-static // chunk)
            starts = tf.minimum(tf.range(count) * chunk, static - chunk)
            norms = chunk_norms(starts)
            return tf.concat([tf.reshape(norms[:-1], [-1]),
                              norms[-1, count * chunk - static:]], axis=0)
        # A batch size known only at run time: zero examples fill the last
        # chunk (their norms are 0, cut below).
        count = (self.batch_size + chunk - 1) // chunk
        extra = [[0, count * chunk - self.batch_size], [0, 0], [0, 0], [0, 0]]
        inputs = [(tf.pad(x, extra), padding) for x, padding in self.inputs]
        grads = [tf.pad(g, extra) for g in self.grads]
        norms = chunk_norms(tf.range(count) * chunk)
        return tf.reshape(norms, [-1])[:self.batch_size]

    def clipped_sum(self, factors):
        kernel = tf.zeros(
            self.kernel_size + [self.shape[-2], self.p], tf.float32
        )
        # sum_i c_i grad_i is bilinear in (input_i, output gradient_i):
        # scale the smaller of the two (for most convolutions the input), so
        # that the weighted copy is small.
        inputs, grads = [], []
        for (x, padding), g in zip(self.inputs, self.grads):
            if _example_size(x) <= _example_size(g):
                x = x * factors[:, None, None, None]
            else:
                g = g * factors[:, None, None, None]
            inputs.append((x, padding))
            grads.append(g)
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            # Only the filter gradient is used: in a graph the forward
            # convolutions themselves are pruned.
            outputs = [
                tf.nn.convolution(x, kernel, strides=self.strides,
                                  padding=padding.upper(),
                                  dilations=self.rates)
                for x, padding in inputs
            ]
        matrix = tape.gradient(outputs, kernel, output_gradients=grads)
        return tf.reshape(matrix, self.shape)


def _example_size(t):
    """Floats per example of `t` (a large number when not static)."""
    dims = t.shape[1:]
    return math.prod(dims) if None not in dims else math.inf


class _EmbeddingHandler(_Handler):

    weight_names = ("embeddings",)

    def intercept(self, session, original, *args, **kwargs):
        layer = self.layer
        ids = _first_input(args, kwargs)
        if ids.dtype != "int32" and ids.dtype != "int64":
            ids = ops.cast(ids, "int32")
        z = ops.take(_stopped(layer.embeddings), ids, axis=0)
        z = ops.cast(z, layer.compute_dtype)
        session.tape.watch(z)
        self.records.append({"ids": session.check_batch(ids, layer),
                             "taps": [z]})
        return z

    def blocks(self, session, tap_grads):
        layer = self.layer
        embeddings = self._var("embeddings")
        if embeddings is None:
            return {}
        vocabulary, p = layer.embeddings.shape
        batch = session.batch_size
        ids = ops.concatenate([
            tf.reshape(ops.cast(r["ids"], "int32"), [batch, -1])
            for r in self.records
        ], axis=1)
        g = ops.concatenate([
            tf.reshape(ops.cast(g, "float32"), [batch, -1, p])
            for (g,) in tap_grads
        ], axis=1)
        return {id(embeddings): [_EmbeddingBlock(ids, g, vocabulary)]}


class _LayerNormalizationHandler(_Handler):

    weight_names = ("gamma", "beta")

    def intercept(self, session, original, *args, **kwargs):
        layer = self.layer
        x = _first_input(args, kwargs)
        rank = len(x.shape)
        axes = sorted(a % rank for a in layer.axis)
        if 0 in axes:
            session.error(
                f"LayerNormalization {layer.name!r} normalizes over the batch"
                " axis (it mixes examples)"
            )
            return original(*args, **kwargs)
        normalized = ops.layer_normalization(
            x, None, None, axis=axes, epsilon=layer.epsilon,
            rms_scaling=layer.rms_scaling,
        )
        broadcast = [1] * rank
        for a in axes:
            broadcast[a] = x.shape[a]
        z = normalized
        if layer.gamma is not None:
            z = z * ops.reshape(ops.cast(_stopped(layer.gamma), z.dtype),
                                broadcast)
        if layer.beta is not None:
            z = z + ops.reshape(ops.cast(_stopped(layer.beta), z.dtype),
                                broadcast)
        session.tape.watch(z)
        self.records.append({
            "normalized": session.check_batch(normalized, layer),
            "axes": axes, "taps": [z],
        })
        return ops.cast(z, layer.compute_dtype)

    def blocks(self, session, tap_grads):
        gamma, beta = self._var("gamma"), self._var("beta")
        gamma_grads, beta_grads = [], []
        for record, (g,) in zip(self.records, tap_grads):
            g = ops.cast(g, "float32")
            normalized = ops.cast(record["normalized"], "float32")
            rank = len(g.shape)
            other = [i for i in range(1, rank) if i not in record["axes"]]
            gamma_grads.append(ops.sum(normalized * g, axis=other))
            beta_grads.append(ops.sum(g, axis=other))
        out = {}
        if gamma is not None:
            out[id(gamma)] = [_MaterializedBlock(ops.sum(gamma_grads, axis=0))]
        if beta is not None:
            out[id(beta)] = [_MaterializedBlock(ops.sum(beta_grads, axis=0))]
        return out


class _FallbackUnit(_Handler):
    """Any layer: per-example gradients by a vectorized map over the layer.

    Records the layer's call arguments and output; the output gradients `g`
    come from the batched backward pass, and each example's weight gradient is
    the vector-Jacobian product of the layer alone on that example.
    """

    kind = "fallback"

    def intercept(self, session, original, *args, **kwargs):
        layer = self.layer
        args_kwargs = tf.nest.map_structure(
            lambda t: session.check_batch(t, layer) if tf.is_tensor(t) else t,
            (args, kwargs),
        )
        # The per-example replay could not reproduce the forward's random
        # draws (e.g. dropout): refuse if the layer draws any.
        generators = [
            generator
            for sub in layer._flatten_layers(include_self=True)
            for generator in sub._seed_generators
        ]
        drawn = []
        for generator in generators:
            def next_seed(*a, _original=generator.next, _g=generator, **k):
                drawn.append(_g)
                return _original(*a, **k)
            generator.next = next_seed
        try:
            outputs = original(*args, **kwargs)
        finally:
            for generator in generators:
                del generator.next
        if drawn:
            session.error(
                f"layer {layer.name!r} has no ghost rule and draws random"
                " numbers in training (e.g. dropout)"
            )
        taps = _watch_float(session.tape, outputs)
        self.records.append({"inputs": args_kwargs, "taps": taps})
        return outputs

    def taps(self):
        return [[t for t in r["taps"] if t is not None] for r in self.records]

    def blocks(self, session, tap_grads):
        layer, variables = self.layer, self.variables
        total = None
        for record, grads in zip(self.records, tap_grads):
            leaves = tf.nest.flatten(record["inputs"])
            tensor_index = [i for i, t in enumerate(leaves) if tf.is_tensor(t)]
            out_index = [i for i, t in enumerate(record["taps"]) if t is not None]
            used = [(j, g) for j, g in zip(out_index, grads) if g is not None]
            if not used:
                continue

            def one_example(packed, leaves=leaves, record=record,
                            tensor_index=tensor_index, used=used):
                tensors, cotangents = packed
                example = list(leaves)
                for i, t in zip(tensor_index, tensors):
                    example[i] = t[None]
                args, kwargs = tf.nest.pack_sequence_as(
                    record["inputs"], example
                )
                with tf.GradientTape() as tape:
                    outputs = layer(*args, **kwargs)
                flat = tf.nest.flatten(outputs)
                return privatizer.gradients_or_zeros(
                    tape, [flat[j] for j, _ in used], variables,
                    output_gradients=[c[None] for c in cotangents],
                )

            per_example = vectorization.vectorized_map(
                one_example,
                ([leaves[i] for i in tensor_index], [g for _, g in used]),
                what=f"the per-example gradients of layer {layer.name!r}",
            )
            per_example = [ops.cast(g, "float32") for g in per_example]
            total = per_example if total is None else [
                t + g for t, g in zip(total, per_example)
            ]
        if total is None:
            return {}
        return {id(v): [_MaterializedBlock(g)] for v, g in zip(variables, total)}


# ----------------------------------------------------------------------------
# Planning: which handler owns which trainable variable.


def _own_variables(layer):
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def _overrides(layer, base, *names):
    return any(getattr(type(layer), n) is not getattr(base, n) for n in names)


def _ghost_handler_class(layer):
    """The ghost handler for `layer`, or `(None, reason)`."""
    if "call" in layer.__dict__:
        return None, "call is replaced on the instance"
    if getattr(layer, "lora_enabled", False):
        return None, "LoRA is enabled"
    if getattr(layer, "quantization_mode", None) is not None:
        return None, "the layer is quantized"
    if isinstance(layer, keras.layers.EinsumDense):
        if _overrides(layer, keras.layers.EinsumDense, "call"):
            return None, "call is overridden"
        try:
            _parse_einsum(layer.equation)
        except ValueError as e:
            return None, f"equation {layer.equation!r}: {e}"
        return _EinsumDenseHandler, None
    if isinstance(layer, keras.layers.Dense):
        if _overrides(layer, keras.layers.Dense, "call"):
            return None, "call is overridden"
        return _DenseHandler, None
    if isinstance(layer, keras.layers.Embedding):
        if _overrides(layer, keras.layers.Embedding, "call"):
            return None, "call is overridden"
        return _EmbeddingHandler, None
    if isinstance(layer, keras.layers.LayerNormalization):
        if _overrides(layer, keras.layers.LayerNormalization, "call"):
            return None, "call is overridden"
        return _LayerNormalizationHandler, None
    for cls in (keras.layers.Conv1D, keras.layers.Conv2D):
        if isinstance(layer, cls):
            if _overrides(layer, cls, "call", "convolution_op"):
                return None, "call is overridden"
            if getattr(layer, "groups", 1) != 1:
                return None, "groups > 1"
            return _ConvHandler, None
    return None, f"no ghost rule for {type(layer).__name__}"


class _Plan:

    def __init__(self, model):
        self.handlers = []
        self.problems = []  # (layer name, reason): the model is unsupported
        self.fallback_reasons = {}  # layer name -> why it is a fallback unit
        trainable = {id(v): v for v in model.trainable_variables}
        self.trainable = trainable
        owner = {}
        all_layers = model._flatten_layers(include_self=True, recursive=True)
        for layer in all_layers:
            if getattr(layer, "activity_regularizer", None) is not None:
                self.problems.append((layer.name, "activity regularizer"))
            if isinstance(layer, _EXAMPLE_MIXING_LAYERS) and layer.trainable:
                self.problems.append((layer.name, "mixes examples in training"))
            if getattr(layer, "_remat_mode", None) is not None:
                self.problems.append((layer.name, "rematerialization"))
        visited = set()

        def subtree_trainable(layer):
            return [
                v for v in layer.variables if id(v) in trainable
            ]

        def claim(handler, variables):
            for v in variables:
                if id(v) in owner and owner[id(v)] is not handler:
                    self.problems.append(
                        (handler.layer.name,
                         f"variable {v.path!r} is shared with layer"
                         f" {owner[id(v)].layer.name!r}")
                    )
                owner[id(v)] = handler

        def visit(layer, is_root):
            if id(layer) in visited:
                return
            visited.add(id(layer))
            variables = subtree_trainable(layer)
            if not variables:
                return
            own = [v for v in _own_variables(layer) if id(v) in trainable]
            cls, reason = _ghost_handler_class(layer)
            if cls is not None:
                sub = [v for v in variables if id(v) not in {id(w) for w in own}]
                known = {id(getattr(layer, n, None)) for n in cls.weight_names}
                if sub:
                    reason = "sublayers with trainable weights"
                elif any(id(v) not in known for v in own):
                    # E.g. a subclass with weights of its own, or a kernel
                    # computed from other weights: the fallback is exact.
                    reason = "weights that its ghost rule does not know"
                else:
                    handler = cls(layer, own)
                    self.handlers.append(handler)
                    claim(handler, own)
                    return
            if not own and not isinstance(layer, _OPAQUE_LAYERS):
                for sublayer in layer._layers:
                    visit(sublayer, False)
                return
            if is_root:
                self.problems.append(
                    (layer.name, "the model itself owns trainable weights")
                )
                return
            handler = _FallbackUnit(layer, variables)
            self.fallback_reasons[layer.name] = reason
            self.handlers.append(handler)
            claim(handler, variables)

        visit(model, True)
        for v in model.trainable_variables:
            if id(v) not in owner:
                self.problems.append(
                    (v.path, "trainable variable not owned by a supported layer")
                )
        self.owner = owner


def unsupported_layers(model):
    """`[(name, reason), ...]` that prevent ghost clipping (empty if none)."""
    return list(_Plan(model).problems)


def supports(model):
    """Whether `clipped_sum` can handle `model` (static check).

    A few problems only show while tracing (a layer called inside control
    flow, `add_loss` in `call`, a variable used outside its layer); then
    `clipped_sum` raises `GhostClippingUnsupportedError`.
    """
    return not unsupported_layers(model)


def describe(model):
    """`{layer name: "ghost" | "fallback: <reason>"}` for layers with weights."""
    plan = _Plan(model)
    out = {}
    for handler in plan.handlers:
        name = handler.layer.name
        if handler.kind == "ghost":
            out[name] = f"ghost ({type(handler).__name__[1:-7]})"
        else:
            out[name] = f"fallback: {plan.fallback_reasons.get(name)}"
    return out


# ----------------------------------------------------------------------------
# The step.


class _Session:

    def __init__(self, tape, batch_size, static_batch_size):
        self.tape = tape
        self.batch_size = batch_size
        self.static_batch_size = static_batch_size
        self.graph = tf.compat.v1.get_default_graph()
        self.errors = []
        self.recording = False

    def same_graph(self):
        return tf.compat.v1.get_default_graph() is self.graph

    def error(self, message):
        self.errors.append(message)

    def check_batch(self, t, layer):
        """`t` with its leading axis checked to be the batch axis."""
        if not tf.is_tensor(t):
            return t
        t = tf.convert_to_tensor(t)
        if t.shape.rank == 0:
            self.error(f"layer {layer.name!r} receives a scalar tensor")
            return t
        static = t.shape[0]
        # A statically known leading size must be the batch size (an unknown
        # one is checked at run time below).
        if static is not None and static != self.static_batch_size:
            self.error(
                f"layer {layer.name!r} receives a tensor of shape {t.shape}"
                " whose leading axis is not the batch axis (batch size"
                f" {self.static_batch_size})"
            )
            return t
        # Fails at run time if the leading axis is not the batch size.
        return tf.reshape(
            t, tf.concat([[self.batch_size], tf.shape(t)[1:]], axis=0)
        )


@contextlib.contextmanager
def _installed(handlers, session):
    installed = []
    try:
        for handler in handlers:
            handler.reset()
            handler.install(session)
            installed.append(handler)
        session.recording = True
        yield
    finally:
        session.recording = False
        for handler in reversed(installed):
            handler.uninstall()


def _regularization(model):
    """`(R, {id(var): grad R})` over trainable weights with a regularizer."""
    regularized = [
        v for v in model.trainable_weights
        if getattr(v, "regularizer", None) is not None
    ]
    if not regularized:
        return None, {}
    with tf.GradientTape() as tape:
        terms = []
        for v in regularized:
            loss = v.regularizer(v)
            if not loss.dtype.is_floating:
                loss = ops.cast(loss, keras.config.floatx())
            terms.append(ops.sum(loss))
        total = ops.sum(ops.stack(terms))
    grads = tape.gradient(total, regularized)
    return total, {
        id(v): g for v, g in zip(regularized, grads) if g is not None
    }


@tf.autograph.experimental.do_not_convert
def clipped_sum(model, per_example_loss_fn, x, y, sample_weight, l2_norm_clip,
                mask=None, training=True):
    """The sum of per-example gradients clipped to norm C, by ghost clipping.

    Args:
        model: a built Keras model.
        per_example_loss_fn: `f(y, y_pred, sample_weight) -> [B]` losses,
            WITHOUT regularization losses (they are added here, as every
            example's loss in the vectorized path includes them);
            `compiled_loss_fn(model)` builds it from the compiled loss.
        x, y, sample_weight: the batch (`sample_weight` may be `None`).
        l2_norm_clip: C.
        mask: optional `[B]` of 0/1; examples with 0 contribute nothing.
        training: passed to the model call.

    Returns:
        `(summed, norms, losses, y_pred)`: one tensor per
        `model.trainable_variables` (the sum over examples of
        `min(1, C / norm_i) * mask_i * grad_i`), the per-example gradient
        norms `[B]` before clipping, the per-example losses `[B]` (with the
        regularization term) and the batched predictions.

    Raises:
        GhostClippingUnsupportedError: at trace time, if the model cannot use
            ghost clipping; nothing has been applied.
    """
    if in_stateless_scope():
        raise GhostClippingUnsupportedError(
            "ghost clipping does not run inside a keras.StatelessScope"
        )
    plan = _Plan(model)
    if plan.problems:
        raise GhostClippingUnsupportedError(_format_problems(plan.problems))
    variables = model.trainable_variables
    first = tf.convert_to_tensor(tf.nest.flatten(x)[0])
    batch_size = tf.shape(first)[0]
    ghost_variables = [
        v for v in variables if plan.owner[id(v)].kind == "ghost"
    ]

    with tf.GradientTape() as tape:
        session = _Session(tape, batch_size, first.shape[0])
        with _installed(plan.handlers, session):
            y_pred = model(x, training=training)
        losses = per_example_loss_fn(y, y_pred, sample_weight)
        losses = ops.cast(losses, "float32")
        total = ops.sum(losses)
    if session.errors:
        raise GhostClippingUnsupportedError("; ".join(session.errors))
    call_losses = [
        loss for layer in model._flatten_layers(include_self=True)
        for loss in layer._get_own_losses()
    ]
    if call_losses:
        raise GhostClippingUnsupportedError(
            "the model adds losses in call (add_loss or activity"
            " regularization); they are per-example terms this module does"
            " not decompose"
        )
    if len(losses.shape) != 1:
        raise ValueError(
            f"per_example_loss_fn must return a [batch] vector, got shape"
            f" {losses.shape}"
        )

    taps = [handler.taps() for handler in plan.handlers]
    tap_grads, unexpected = tape.gradient(
        total, (taps, ghost_variables),
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    )
    leaked = [v.path for v, g in zip(ghost_variables, unexpected)
              if g is not None]
    if leaked:
        raise GhostClippingUnsupportedError(
            f"variables {leaked} are used outside their layer's call (e.g."
            " tied weights, or a per_example_loss_fn that includes"
            " regularization losses); their gradients would be incomplete"
        )

    blocks = {}
    for handler, handler_taps, grads in zip(plan.handlers, taps, tap_grads):
        grads = [
            [g if g is not None or t is None else tf.zeros_like(t)
             for t, g in zip(record_taps, record_grads)]
            for record_taps, record_grads in zip(handler_taps, grads)
        ]
        if not handler.records:
            continue
        produced = handler.blocks(session, grads)
        missing = [v.path for v in handler.variables
                   if id(v) not in produced]
        if handler.kind == "ghost" and missing:
            # E.g. a subclass whose kernel is computed from other weights:
            # the rule would drop their gradients, not compute them.
            raise GhostClippingUnsupportedError(
                f"layer {handler.layer.name!r} has trainable weights"
                f" {missing} that its ghost rule does not know"
            )
        for key, value in produced.items():
            blocks.setdefault(key, []).extend(value)

    regularization, reg_grads = _regularization(model)
    squared = tf.zeros([batch_size], "float32")
    for v in variables:
        reg = reg_grads.get(id(v))
        for block in blocks.get(id(v), []):
            squared = squared + block.squared_norms(reg)
        if reg is not None:
            squared = squared + ops.sum(ops.square(ops.cast(reg, "float32")))
    norms = ops.sqrt(ops.maximum(squared, 0.0))
    factors = dp_math.clip_factors(norms, l2_norm_clip)
    if mask is not None:
        factors = factors * ops.cast(mask, factors.dtype)

    summed = []
    for v in variables:
        parts = [block.clipped_sum(factors) for block in blocks.get(id(v), [])]
        reg = reg_grads.get(id(v))
        if reg is not None:
            parts.append(ops.sum(factors) * ops.cast(reg, "float32"))
        if parts:
            s = parts[0]
            for part in parts[1:]:
                s = s + part
            s = tf.reshape(ops.cast(s, v.dtype), v.shape)
        else:
            s = tf.zeros(v.shape, v.dtype)
        summed.append(s)

    if regularization is not None:
        losses = losses + ops.cast(regularization, losses.dtype)
    for handler in plan.handlers:
        handler.reset()
    return summed, norms, losses, y_pred


def _format_problems(problems):
    return "ghost clipping does not support: " + "; ".join(
        f"{name}: {reason}" for name, reason in problems
    )


def compiled_loss_fn(model):
    """`f(y, y_pred, sample_weight) -> [B]` from `model`'s compiled loss.

    Example i's loss is the compiled loss on the batch of one example i, as in
    the vectorized path (same reduction, sample weights, loss weights,
    masks); regularization losses are not included. Per-output loss metrics
    are not updated.
    """

    @tf.autograph.experimental.do_not_convert
    def per_example_loss(y, y_pred, sample_weight):
        compile_loss = model._compile_loss
        if compile_loss is None:
            raise ValueError("The model was not compiled with a loss.")
        direct = _direct_per_example_loss(compile_loss, y, y_pred,
                                          sample_weight)
        if direct is not None:
            return direct
        flat_pred = tf.nest.flatten(y_pred)
        masks = [get_keras_mask(t) for t in flat_pred]
        mask_index = [i for i, m in enumerate(masks) if m is not None]
        examples = (y, y_pred, sample_weight,
                    [masks[i] for i in mask_index] or None)
        present = [i for i, e in enumerate(examples) if e is not None]

        def one(packed):
            example = [None] * len(examples)
            for i, e in zip(present, packed):
                example[i] = tf.nest.map_structure(lambda t: t[None], e)
            y1, pred1, weight1, masks1 = example
            if mask_index:
                flat = list(tf.nest.flatten(pred1))
                for i, m in zip(mask_index, masks1):
                    flat[i] = tf.identity(flat[i])
                    set_keras_mask(flat[i], m)
                pred1 = tf.nest.pack_sequence_as(pred1, flat)
            return ops.cast(compile_loss(y1, pred1, weight1), "float32")

        saved = None
        if getattr(compile_loss, "_metrics", None):
            saved = compile_loss._metrics
            compile_loss._metrics = [None] * len(saved)
        try:
            return vectorization.vectorized_map(
                one, tuple(examples[i] for i in present),
                what="the per-example compiled loss",
            )
        finally:
            if saved is not None:
                compile_loss._metrics = saved

    return per_example_loss


def _direct_per_example_loss(compile_loss, y, y_pred, sample_weight):
    """`[B]` per-example losses without a vectorized map, or None.

    The common case: one output, one `keras.losses.Loss` with the default
    "sum_over_batch_size" reduction, no output mask, and no sample weight
    or one weight per example. Then example i's compiled loss (on a batch
    of one) is `loss_weight * w_i * mean(loss.call(y_i, y_pred_i))`: the
    unreduced values averaged over their non-batch axes (divided by the
    replicas under tf.distribute, as Keras does). This avoids
    `tf.vectorized_map`, whose graph XLA compiles very slowly. Anything else
    returns None (the caller maps the compiled loss over the examples).
    """
    if tf.nest.is_nested(y) or tf.nest.is_nested(y_pred):
        return None
    if get_keras_mask(y_pred) is not None:
        return None
    if sample_weight is not None and (
        tf.nest.is_nested(sample_weight) or sample_weight.shape.rank != 1
    ):
        return None
    if not compile_loss.built:
        compile_loss.build(y, y_pred)
    flat = compile_loss._flat_losses
    if len(flat) != 1:
        return None
    path, loss, loss_weight, _ = flat[0]
    if path or not isinstance(loss, keras.losses.Loss):
        return None
    if loss.reduction != "sum_over_batch_size":
        return None
    y_pred = ops.convert_to_tensor(y_pred, dtype=loss.dtype)
    y = ops.convert_to_tensor(y, dtype=y_pred.dtype)
    values = ops.cast(loss.call(y, y_pred), "float32")
    if values.shape.rank is None or values.shape.rank < 1:
        return None
    if values.shape.rank > 1:
        values = ops.mean(values, axis=tuple(range(1, values.shape.rank)))
    if sample_weight is not None:
        values = values * ops.cast(sample_weight, "float32")
    if loss_weight is not None:
        values = values * ops.cast(loss_weight, "float32")
    # As `Loss.__call__` does (and callers undo): under tf.distribute, Keras
    # scales a reduced loss by 1 / replicas.
    replicas = privatizer.num_replicas()
    if replicas > 1:
        values = values / replicas
    return values
