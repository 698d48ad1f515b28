"""The rule for weight-standardized convolutions (`tf_dpadam.layers.WSConv2D`).

The layer convolves with K = standardize(W): for each output channel o, with
w its n = kh kw c_in weights, k = (w - mean(w)) / s and s = sqrt(var(w) +
eps). The Jacobian of k with respect to w is J = (P - k k^T / n) / s, where
P removes the mean (P k = k, so J is symmetric). Example i's gradient of
column o of W is therefore J u_o, where u_o is its gradient of column o of
K: the plain convolution's kernel gradient. With u~_o = u_o / s_o (the
output gradients divided by s_o) and r_o = |k_o|^2 / n = var / (var + eps):

    |J u_o|^2 = |u~_o|^2 - (1 . u~_o)^2 / n - (2 - r_o) (k_o . u~_o)^2 / n

* |u~|^2: the convolution's own block (ghost norm or materialized) on the
  scaled output gradients;
* 1 . u~_o = sum_t (sum of patch t) u~_to: the scaled output gradients
  against a convolution of the input with a kernel of ones (one channel);
* k_o . u~_o = sum_t z_to u~_to, z the layer's convolution output (before
  its bias): k_o . patch_t is z_to.

The clipped sum is J applied to the convolution block's clipped sum of u~,
and a regularizer's cross term is sum_t (x_t . s J R')_o u~_to (J is
symmetric). All of it is per-example [p] vectors besides the convolution's
own block.

DiSK's second pass reads the kernel at other weights: each pass P has its
own k_P, s_P and J_P, and example i's gradient is the sum of J_P u_P over
the passes. With v = sum_P u~_P (one convolution block of all the passes'
records) and alpha_P = k_P . u~_P, sum_P J_P u_P = P v - q with
q = sum_P k_P alpha_P / n, and since P k_P = k_P:

    |sum_P J_P u_P|^2 = |v|^2 - (1 . v)^2 / n
                        - 2 sum_P alpha_P (k_P . v) / n + |q|^2

where k_P . v = sum_Q k_P . u~_Q: the pass Q's scaled output gradients
against its input convolved with k_P (alpha_P when Q = P), and
|q|^2 = sum_{P,Q} alpha_P alpha_Q (k_P . k_Q) / n^2 (k_P . k_P = n r_P).
One pass gives the formula above.

With a coordinate-wise scale S (scale-then-privatize) the removed
components no longer subtract, as they are a projection's and S is not:
the block then forms each example's sum_P J_P u_P, [n, p] per example from
its patches, a chunk of examples at a time (as the convolution's own block
does for a kernel used at many positions), and takes |S sum_P J_P u_P|^2.
"""

import tensorflow as tf
from keras import ops

from tf_dpadam import layers
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import convolution
from tf_dpadam.privatizer.ghost_clipping import rule


def _project(kernel, m):
    """s J m: `m` (`[..., n, p]`) with each column made orthogonal to the
    ones and to `kernel`'s column (k, `[n, p]`; r less of k)."""
    n = kernel.shape[0]
    m = m - ops.mean(m, axis=-2, keepdims=True)
    return m - kernel * ops.sum(kernel * m, axis=-2, keepdims=True) / n


class KernelPoint:
    """The standardized kernel where one pass read it: `kernel` is k as
    `[n, p]`, `ratio` is r (`[p]`); `inner` is the `ConvolutionBlock` of
    that pass's records with scaled output gradients u~ (its clipped sum,
    `conv_dot`)."""

    def __init__(self, inner, kernel, ratio):
        self.inner, self.kernel, self.ratio = inner, kernel, ratio

    def conv_dot(self, matrix):
        """`[B, p]`: sum_t (x_t . m_o) u~_to over this pass's records, for
        `m` an `[n, p]` matrix (k of some pass, or s J R')."""
        inner = self.inner
        filters = tf.reshape(matrix, inner.shape)
        rows = inner.group_size
        out = tf.add_n([
            ops.sum(tf.nn.convolution(
                x, filters, strides=inner.strides, padding=padding.upper(),
                dilations=inner.rates) * g, axis=(1, 2))
            for (x, padding), g in zip(inner.inputs, inner.grads)])
        return blocks.sum_groups(out, rows) if rows > 1 else out

    def grouped(self, size):
        return KernelPoint(self.inner.grouped(size), self.kernel, self.ratio)


class StandardizedKernelBlock:
    """The block of W in a convolution with `standardize_kernel(W)`.

    `inner` is the `ConvolutionBlock` of all the scaled output gradients
    (v); `points` are the passes' `KernelPoint`s; `ones_dot` is `[B, p]`
    (1 . v per example) and `dots[P][Q]` is `[B, p]` (k_P . u~_Q; alpha_P
    on the diagonal).
    """

    def __init__(self, inner, points, ones_dot, dots):
        self.inner, self.points = inner, points
        self.ones_dot, self.dots = ones_dot, dots
        self.shape = inner.shape
        self.n = float(points[0].kernel.shape[0])

    def _jacobian_times(self, point, w):
        """s J w at `point`: `w` (the kernel's shape) with each column made
        orthogonal to the ones and to k (r less of k)."""
        m = tf.reshape(ops.cast(w, "float32"), point.kernel.shape)
        return tf.reshape(_project(point.kernel, m), self.shape)

    def squared_norms(self, reg_grad=None, scale_sq=None):
        if scale_sq is not None:
            return self._scaled_norms(reg_grad, scale_sq)
        n, points, dots = self.n, self.points, self.dots
        sq = self.inner.squared_norms()
        alphas = [dots[i][i] for i in range(len(points))]
        k_dot_v = [tf.add_n(row) for row in dots]
        removed = ops.square(self.ones_dot) / n + 2.0 * tf.add_n(
            [a * kv for a, kv in zip(alphas, k_dot_v)]) / n
        for i, p in enumerate(points):
            for j, q in enumerate(points):
                gram = (n * p.ratio if i == j
                        else ops.sum(p.kernel * q.kernel, axis=0))
                removed -= alphas[i] * alphas[j] * gram / (n * n)
        sq = sq - ops.sum(removed, axis=1)
        if reg_grad is not None:
            sq = sq + 2.0 * ops.sum(tf.add_n([
                p.conv_dot(tf.reshape(self._jacobian_times(p, reg_grad),
                                      p.kernel.shape))
                for p in points]), axis=1)
        # Float rounding could make a gradient along 1 and k alone negative.
        return ops.maximum(sq, 0.0)

    def _scaled_norms(self, reg_grad, scale_sq):
        """|S (sum_P J_P u_P)|^2 (+ 2 (sum_P J_P u_P) . reg_grad), from each
        example's materialized sum_P J_P u_P: with a scale the removed
        components no longer subtract (they are a projection's). A chunk of
        examples at a time, as the convolution's own block."""
        d, p = self.inner.d, self.inner.p
        scale_sq = tf.reshape(ops.cast(scale_sq, "float32"), [d, p])
        reg = (None if reg_grad is None else
               tf.reshape(ops.cast(reg_grad, "float32"), [d, p]))
        counts = [len(point.inner.inputs) for point in self.points]

        def norms_of(inputs, grads, start, size):
            a_list, g_list = self.inner.record_patches(inputs, grads, start,
                                                       size)
            grad, first = 0.0, 0
            for point, count in zip(self.points, counts):
                # u~_P: the pass's records' kernel gradients, [b, d, p].
                u = tf.add_n([tf.einsum("btd,btp->bdp", a, g) for a, g in
                              zip(a_list[first:first + count],
                                  g_list[first:first + count])])
                first += count
                grad += _project(point.kernel, u)
            sq = tf.einsum("bdp,dp->b", ops.square(grad), scale_sq)
            if reg is not None:
                sq = sq + 2.0 * tf.einsum("bdp,dp->b", grad, reg)
            return sq

        return self.inner.map_chunks(norms_of)

    def weighted_sum(self, factors):
        return tf.add_n([self._jacobian_times(p, p.inner.weighted_sum(factors))
                         for p in self.points])

    def grouped(self, size):
        return StandardizedKernelBlock(
            self.inner.grouped(size), [p.grouped(size) for p in self.points],
            blocks.sum_groups(self.ones_dot, size),
            [[blocks.sum_groups(d, size) for d in row] for row in self.dots])


class StandardizedConvolutionRule(convolution.ConvolutionRule):
    """`WSConv2D`: the convolution rule with the kernel standardized."""

    # Each pass's records read the kernel where that pass read it.
    shifted_pass = True
    name = "WSConv"

    def kernel_value(self):
        return layers.standardize_kernel(
            rule.stopped(self.layer.kernel),
            self.layer.standardization_epsilon)

    def kernel_block(self, recording, inputs, grads, convs):
        layer = self.layer
        eps = layer.standardization_epsilon
        # The records by pass (in the order of the passes).
        passes = {}
        for index, record in enumerate(self.records):
            offsets = record.get("offsets")
            key = None if offsets is None else id(offsets)
            passes.setdefault(key, (offsets, []))[1].append(index)
        points, all_inputs, all_scaled, alphas = [], [], [], []
        for offsets, indices in passes.values():
            w = ops.cast(self.value_at("kernel", offsets), "float32")
            variance = ops.var(w, axis=tuple(range(len(w.shape) - 1)))  # [p]
            scale = ops.sqrt(variance + eps)
            these = [inputs[i] for i in indices]
            scaled = [grads[i] / scale for i in indices]
            inner = convolution.ConvolutionBlock(layer, these, scaled,
                                                 recording)
            kernel = tf.reshape(layers.standardize_kernel(w, eps),
                                [inner.d, inner.p])
            points.append(KernelPoint(inner, kernel,
                                      variance / (variance + eps)))
            # k_P . u~_P is sum_t z_to u~_to (z: the convolution's output).
            alphas.append(tf.add_n([ops.sum(convs[i] * g, axis=(1, 2))
                                    for i, g in zip(indices, scaled)]))
            all_inputs += these
            all_scaled += scaled
        inner = convolution.ConvolutionBlock(layer, all_inputs, all_scaled,
                                             recording)
        ones = tf.ones(inner.kernel_size + [inner.shape[-2], 1], tf.float32)
        ones_dot = tf.add_n([
            ops.sum(tf.nn.convolution(
                x, ones, strides=inner.strides, padding=padding.upper(),
                dilations=inner.rates) * g, axis=(1, 2))
            for (x, padding), g in zip(all_inputs, all_scaled)
        ])
        dots = [[alphas[i] if i == j else q.conv_dot(p.kernel)
                 for j, q in enumerate(points)]
                for i, p in enumerate(points)]
        return StandardizedKernelBlock(inner, points, ones_dot, dots)
