"""Rules for `Dense` and `EinsumDense`: a kernel used as `z = a W (+ b)`.

Example i's kernel gradient is `sum_t a_{i,t}^T g_{i,t}` over the positions
t at which the kernel is applied (`blocks.LinearBlock`); the bias gradient is
the output gradient summed over the positions it broadcasts to.
`EinsumDense` is reduced to the same form by transposing and reshaping: its
kernel's axes are split into contracted ones (d) and output ones (p).
"""

import math
import string

import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import rule


class DenseRule(rule.Rule):

    name = "Dense"
    shifted_pass = True  # blocks from the records alone
    weight_names = ("kernel", "bias")
    # The layer attribute of the kernel variable.
    kernel_name = "kernel"

    def _product(self, a, kernel):
        """The layer's `a W` (before bias and activation)."""
        return ops.matmul(a, kernel)

    def _kernel_value(self):
        """The kernel the layer's call uses, with its gradient stopped."""
        return rule.stopped(self.layer.kernel)

    def _kernel_shape(self):
        return tuple(getattr(self.layer, self.kernel_name).shape)

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        a = rule.first_input(args, kwargs)
        z = self._product(a, self._kernel_value())
        if layer.bias is not None:
            z = ops.add(z, rule.stopped(layer.bias))
        recording.tape.watch(z)
        # `offsets`: the pass's shifts (DiSK's second pass), for rules whose
        # blocks read weights.
        self.records.append({"a": recording.check_batch(a, layer), "taps": [z],
                             "offsets": recording.offsets})
        return layer.activation(z) if layer.activation is not None else z

    def blocks(self, recording, tap_grads):
        d, p = self._kernel_shape()
        a_list, g_list, bias_grads = [], [], []
        for record, (g,) in zip(self.records, tap_grads):
            a = ops.cast(record["a"], "float32")
            g = ops.cast(g, "float32")
            a_list.append(tf.reshape(a, [recording.batch_size, -1, d]))
            g_list.append(tf.reshape(g, [recording.batch_size, -1, p]))
            bias_grads.append(ops.sum(g_list[-1], axis=1))
        return self.weight_blocks(a_list, g_list, bias_grads,
                                  KernelMatrix.dense(d, p))

    def weight_blocks(self, a_list, g_list, bias_grads, matrix):
        """The blocks of the kernel (per record, `a`: `[B, T, d]` and `g`:
        `[B, T, p]`; `matrix` the kernel's `KernelMatrix`) and of the bias."""
        kernel = self.variable(self.kernel_name)
        bias = self.variable("bias")
        out = {}
        if kernel is not None:
            out[id(kernel)] = [blocks.LinearBlock(
                ops.concatenate(a_list, axis=1),
                ops.concatenate(g_list, axis=1), to_matrix=matrix.to_matrix,
                from_matrix=matrix.from_matrix,
            )]
        if bias is not None:
            out[id(bias)] = [
                blocks.MaterializedBlock(ops.sum(bias_grads, axis=0))
            ]
        return out


class EinsumDenseRule(DenseRule):

    name = "EinsumDense"

    @classmethod
    def refusal(cls, layer):
        try:
            parse_einsum(layer.equation)
        except ValueError as e:
            return f"equation {layer.equation!r}: {e}"
        return None

    def _product(self, a, kernel):
        return ops.einsum(self.layer.equation, a, kernel)

    def _kernel_matrix(self):
        """The kernel's `KernelMatrix`: contracted axes x output axes."""
        layer = self.layer
        inputs, w_spec, output, _ = parse_einsum(layer.equation)
        return KernelMatrix(w_spec, self._kernel_shape(), contracted=inputs,
                            produced=output)

    def blocks(self, recording, tap_grads):
        layer = self.layer
        bias = self.variable("bias")
        inputs, w_spec, output, _ = parse_einsum(layer.equation)
        matrix = self._kernel_matrix()
        contracted, produced = matrix.contracted, matrix.produced
        d, p = matrix.d, matrix.p

        a_list, g_list, bias_grads = [], [], []
        batch = recording.batch_size
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
                bias_grads.append(reduce_to_shape(g, bias.shape))
        return self.weight_blocks(a_list, g_list, bias_grads, matrix)


class KernelMatrix:
    """How a kernel is seen as a `[d, p]` matrix (contracted x output axes).

    Attributes:
        spec: the kernel's einsum letters (e.g. "cde"); "io" for Dense.
        contracted, produced: its contracted and output letters, in `spec`
            order (the matrix's row and column axes, flattened).
        dims: `{letter: size}`.
        d, p: the matrix's shape.
    """

    def __init__(self, spec, shape, contracted, produced):
        """`spec` of `shape`; its letters in `contracted` are contracted
        with the input, those in `produced` are output axes."""
        self.spec = spec
        self.contracted = "".join(c for c in spec if c in contracted)
        self.produced = "".join(c for c in spec if c in produced)
        self.dims = dict(zip(spec, shape))
        self.d = math.prod(self.dims[c] for c in self.contracted)
        self.p = math.prod(self.dims[c] for c in self.produced)

    @classmethod
    def dense(cls, d, p):
        """A `[d, p]` kernel, already a matrix."""
        return cls("io", (d, p), contracted="i", produced="o")

    def to_matrix(self, w):
        """`[d, p]` from a weight of the kernel's shape."""
        w = _transpose_to(ops.cast(w, "float32"), self.spec,
                          self.contracted + self.produced)
        return tf.reshape(w, [self.d, self.p])

    def from_matrix(self, m):
        """The kernel's shape from `[d, p]`."""
        matrix_spec = self.contracted + self.produced
        m = tf.reshape(m, [self.dims[c] for c in matrix_spec])
        return _transpose_to(m, matrix_spec, self.spec)


def parse_einsum(equation):
    """`(input, kernel, output, left_elided)` or raises ValueError.

    Supported: each kernel index is either contracted with the input or an
    output index (not both, not neither), the batch axis leads input and
    output (or is inside a leading `...`).
    """
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


def reduce_to_shape(g, shape):
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
