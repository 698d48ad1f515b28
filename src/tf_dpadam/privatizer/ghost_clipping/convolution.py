"""The rule for `Conv1D` and `Conv2D`: a `Dense` on image patches.

Example i's kernel gradient is `sum_t patch_t(x_i)^T g_{i,t}` over the output
positions t, i.e. a `blocks.LinearBlock` whose input rows are the image
patches of the layer's input. The norms take the batch in chunks so that the
patches of the whole batch never exist at once; the weighted sum needs no
patches (one filter-gradient op on the factor-scaled input or output
gradient). `Conv1D` is a `Conv2D` of height 1.

With `groups` G > 1 the layer is G convolutions of C / G input and F / G
output channels: an example's kernel gradient is theirs side by side on the
filter axis (`GroupedBlock`), run on channel slices (TensorFlow 2.21 has no
grouped-convolution gradient without oneDNN, `TF_ENABLE_ONEDNN_OPTS=0`).
"""

import copy
import math

import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import rule

# The image patches of a layer's input are `T d` floats per example. The
# per-example norms take the batch in chunks of about this many patch floats
# (at least one example), so that the patches of the whole batch are never
# held at once; the clipped sum needs no patches at all. Measured on the
# paper's CNN at B=256 (benchmarks/benchmark.py): 4M floats (16 MiB) peaked
# at ~1.6x the tensor memory of a non-private step, 1M at ~1.2x.
PATCH_FLOATS_PER_CHUNK = 1 << 20


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


# Inputs with at most this many channels get their patches from a
# convolution with an identity kernel (below).
IDENTITY_CONV_MAX_CHANNELS = 4


def image_patches(x, sizes, strides, rates, padding):
    """`tf.image.extract_patches` (channels last) of `x` `[B, H, W, C]`.

    Returns `[B, H', W', kh * kw * C]` with the depth ordered (row, column,
    channel), like a `[kh, kw, C, F]` kernel reshaped to `[kh * kw * C, F]`.
    Three ways, by speed on CPU (TF 2.21, measured per call):

    * few channels (C <= `IDENTITY_CONV_MAX_CHANNELS`, no dilation): a
      convolution with the identity as its `[kh, kw, C, kh kw C]` kernel,
      kh kw C multiply-adds per patch float (8x8 stride-2 patches of 2048
      28x28x1 images: 0.044 s, against 0.46 s for slices and 0.13 s for
      ExtractImagePatches);
    * stride 1 with static sizes: slices of the padded input concatenated on
      the channel axis (3x3 patches of 256 14x14x32 maps: 0.018 s, against
      0.026 s and 0.076 s for the identity convolution);
    * otherwise ExtractImagePatches (strided slices are slow: 4x4 stride-2
      patches of 2048 13x13x16 maps: 0.026 s, against 0.21 s for slices).
    """
    padding = padding.upper()
    height, width = x.shape[1], x.shape[2]
    channels = x.shape[3]
    if (channels is not None and channels <= IDENTITY_CONV_MAX_CHANNELS
            and list(rates) == [1, 1]):
        depth = sizes[0] * sizes[1] * channels
        identity = tf.reshape(tf.eye(depth, dtype=x.dtype),
                              [sizes[0], sizes[1], channels, depth])
        return tf.nn.conv2d(x, identity, strides=[1, *strides, 1],
                            padding=padding)
    if height is None or width is None or list(strides) != [1, 1]:
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


class ConvolutionRule(rule.Rule):
    """`Conv1D` / `Conv2D`: a Dense on image patches."""

    name = "Conv"
    shifted_pass = True  # blocks from the records alone
    overridable = ("call", "convolution_op")

    @classmethod
    def refusal(cls, layer):
        # A kernel block of its own (WSConv2D's) sees the whole kernel.
        if (getattr(layer, "groups", 1) != 1
                and cls.kernel_block is not ConvolutionRule.kernel_block):
            return "groups > 1"
        return None

    weight_names = ("kernel", "bias")

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        x = rule.first_input(args, kwargs)
        padding = layer.padding
        if padding == "causal":
            x = ops.pad(x, compat.causal_padding(layer))
            padding = "valid"
        z = conv = self.convolve(x, padding)
        if layer.use_bias:
            if layer.data_format == "channels_last":
                shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                shape = (1, layer.filters) + (1,) * layer.rank
            z = ops.add(z, ops.reshape(rule.stopped(layer.bias), shape))
        recording.tape.watch(z)
        self.records.append({
            "a": recording.check_batch(x, layer), "padding": padding,
            "conv": conv, "taps": [z], "offsets": recording.offsets,
        })
        return layer.activation(z) if layer.activation is not None else z

    def convolve(self, x, padding):
        """The layer's convolution of `x`: with groups, one convolution per
        group on its channel slices (differentiable without oneDNN)."""
        layer, groups = self.layer, getattr(self.layer, "groups", 1)
        axis = -1 if layer.data_format == "channels_last" else 1
        outs = [ops.conv(a, k, strides=list(layer.strides), padding=padding,
                         dilation_rate=layer.dilation_rate,
                         data_format=layer.data_format)
                for a, k in zip(_split(x, groups, axis),
                                _split(self.kernel_value(), groups, -1))]
        return outs[0] if groups == 1 else ops.concatenate(outs, axis=axis)

    def kernel_value(self):
        """The kernel the layer convolves with, its gradient stopped."""
        return rule.stopped(self.layer.kernel)

    def channels_last(self, tap_grads):
        """Per record: `(input, padding)`, the output gradient and the
        convolution's output before the bias, in float32, channels last and
        2-D (a Conv1D's positions as one row)."""
        layer = self.layer
        inputs, grads, convs = [], [], []
        for record, (g,) in zip(self.records, tap_grads):
            x, g, conv = (ops.cast(t, "float32")
                          for t in (record["a"], g, record["conv"]))
            if layer.data_format == "channels_first":
                x, g, conv = (tf.transpose(t, [0, *range(2, layer.rank + 2), 1])
                              for t in (x, g, conv))
            if layer.rank == 1:
                x, g, conv = x[:, None], g[:, None], conv[:, None]
            inputs.append((x, record["padding"]))
            grads.append(g)
            convs.append(conv)
        return inputs, grads, convs

    def kernel_block(self, recording, inputs, grads, convs):
        """The kernel's block (with groups, one per group)."""
        del convs
        layer, groups = self.layer, getattr(self.layer, "groups", 1)
        if groups == 1:
            return ConvolutionBlock(layer, inputs, grads, recording)
        shape = (*layer.kernel.shape[:-1], layer.kernel.shape[-1] // groups)
        xs = [_split(x, groups, -1) for x, _ in inputs]
        gs = [_split(g, groups, -1) for g in grads]
        return GroupedBlock([ConvolutionBlock(
            layer, [(x[j], pad) for x, (_, pad) in zip(xs, inputs)],
            [g[j] for g in gs], recording, shape) for j in range(groups)])

    def blocks(self, recording, tap_grads):
        kernel, bias = self.variable("kernel"), self.variable("bias")
        inputs, grads, convs = self.channels_last(tap_grads)
        out = {}
        if kernel is not None:
            out[id(kernel)] = [
                self.kernel_block(recording, inputs, grads, convs)]
        if bias is not None:
            out[id(bias)] = [blocks.MaterializedBlock(tf.add_n([
                ops.sum(g, axis=(1, 2)) for g in grads
            ]))]
        return out


class ConvolutionBlock:
    """A convolution kernel used on one or more inputs (channels last, 2-D).

    Example i's kernel gradient is `sum_t patch_t(x_i)^T g_{i,t}`, a
    `blocks.LinearBlock` on image patches. The squared norms are computed from the
    patches of a chunk of examples at a time (`PATCH_FLOATS_PER_CHUNK`),
    one chunk after the other; the clipped sum `sum_i c_i grad_i` is the
    kernel gradient of the batched convolution of the inputs `c_i x_i` with
    output gradients `g_i` (or of `x_i` with `c_i g_i`, whichever copy is
    smaller): one filter-gradient op, no patches.
    """

    def __init__(self, layer, inputs, grads, recording, shape=None):
        self.inputs, self.grads = inputs, grads
        # Examples are groups of this many consecutive rows (`grouped`).
        self.group_size = 1
        self.batch_size = recording.batch_size  # examples
        self.shape = tuple(shape or layer.kernel.shape)  # one group's
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
                1, PATCH_FLOATS_PER_CHUNK // (sum(positions) * self.d)
            )

    def grouped(self, size):
        block = copy.copy(self)
        block.group_size = self.group_size * size
        block.batch_size = self.batch_size // size
        block.chunk = max(1, self.chunk // size)
        return block

    def _to_matrix(self, w):
        return tf.reshape(ops.cast(w, "float32"), [self.d, self.p])

    def record_patches(self, inputs, grads, start=0, size=None):
        """Each record's patches `[b, T, d]` and output gradients `[b, T, p]`
        (rows grouped) for examples `start` to `start + size` (all)."""
        rows = self.group_size
        a_list, g_list = [], []
        for (x, padding), g in zip(inputs, grads):
            if size is not None:
                x = _batch_slice(x, start * rows, size * rows)
                g = _batch_slice(g, start * rows, size * rows)
            patches = image_patches(x, self.kernel_size, self.strides,
                                     self.rates, padding)
            t = patches.shape[1] * patches.shape[2] if None not in (
                patches.shape[1], patches.shape[2]) else -1
            a = tf.reshape(patches, [tf.shape(x)[0], t, self.d])
            g = tf.reshape(g, [tf.shape(x)[0], t, self.p])
            a_list.append(blocks.group_rows(a, rows))
            g_list.append(blocks.group_rows(g, rows))
        return a_list, g_list

    def _linear_block(self, inputs, grads, start=0, size=None):
        """The `LinearBlock` of examples `start` to `start + size` (all)."""
        a_list, g_list = self.record_patches(inputs, grads, start, size)
        a = ops.concatenate(a_list, axis=1) if len(a_list) > 1 else a_list[0]
        g = ops.concatenate(g_list, axis=1) if len(g_list) > 1 else g_list[0]
        return blocks.LinearBlock(a, g, self._to_matrix, None)

    def squared_norms(self, reg_grad=None, scale_sq=None):
        return self.map_chunks(
            lambda inputs, grads, start, size: self._linear_block(
                inputs, grads, start, size).squared_norms(reg_grad, scale_sq))

    def map_chunks(self, norms_of):
        """`[B]`: `norms_of(inputs, grads, start, size)` (`[size]`, examples
        `start` to `start + size` of these inputs and output gradients;
        `size` None: all of them) over chunks of `self.chunk` examples."""
        rows = self.group_size
        static = self.grads[0].shape[0]
        if static is not None:
            static //= rows  # examples
        chunk = self.chunk
        if static is not None and static <= chunk:
            return norms_of(self.inputs, self.grads, 0, None)

        def chunk_norms(starts, inputs, grads):
            # One chunk at a time: parallel iterations would hold their
            # patches together again.
            return tf.map_fn(
                lambda start: norms_of(inputs, grads, start, chunk), starts,
                fn_output_signature=tf.TensorSpec([chunk], tf.float32),
                parallel_iterations=1,
            )

        if static is not None:
            # Chunks of a static size; the last one ends at the batch's end,
            # overlapping its predecessor (the overlap's norms are computed
            # twice and dropped). No padded copy of the batch is made.
            count = -(-static // chunk)
            starts = tf.minimum(tf.range(count) * chunk, static - chunk)
            norms = chunk_norms(starts, self.inputs, self.grads)
            return tf.concat([tf.reshape(norms[:-1], [-1]),
                              norms[-1, count * chunk - static:]], axis=0)
        # A batch size known only at run time: zero examples fill the last
        # chunk (their norms are 0, cut below).
        count = (self.batch_size + chunk - 1) // chunk
        extra = [[0, (count * chunk - self.batch_size) * rows], [0, 0], [0, 0],
                 [0, 0]]
        inputs = [(tf.pad(x, extra), padding) for x, padding in self.inputs]
        grads = [tf.pad(g, extra) for g in self.grads]
        norms = chunk_norms(tf.range(count) * chunk, inputs, grads)
        return tf.reshape(norms, [-1])[:self.batch_size]

    def weighted_sum(self, factors):
        kernel = tf.zeros(
            self.kernel_size + [self.shape[-2], self.p], tf.float32
        )
        # sum_i c_i grad_i is bilinear in (input_i, output gradient_i):
        # scale the smaller of the two (for most convolutions the input), so
        # that the weighted copy is small.
        if self.group_size > 1:
            factors = tf.repeat(factors, self.group_size)  # one per row
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


class GroupedBlock:
    """A grouped convolution's kernel: its groups' blocks (`parts`)."""

    def __init__(self, parts):
        self.parts = parts

    def squared_norms(self, reg_grad=None, scale_sq=None):
        count = len(self.parts)
        regs, scales = ([None] * count if t is None else _split(t, count, -1)
                        for t in (reg_grad, scale_sq))
        return tf.add_n([part.squared_norms(reg, scale) for part, reg, scale
                         in zip(self.parts, regs, scales)])

    def weighted_sum(self, factors):
        return tf.concat([part.weighted_sum(factors) for part in self.parts],
                         axis=-1)

    def grouped(self, size):
        return GroupedBlock([part.grouped(size) for part in self.parts])


def _split(t, groups, axis):
    """`t` as `groups` equal slices on `axis` (`[t]` for one group)."""
    return [t] if groups == 1 else ops.split(t, groups, axis=axis)


def _example_size(t):
    """Floats per example of `t` (a large number when not static)."""
    dims = t.shape[1:]
    return math.prod(dims) if None not in dims else math.inf
