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
and a regularizer's cross term uses J R' (J is symmetric). All of it is
per-example [p] vectors besides the convolution's own block.
"""

import tensorflow as tf
from keras import ops

from tf_dpadam import layers
from tf_dpadam.ghost_clipping import blocks
from tf_dpadam.ghost_clipping import convolution
from tf_dpadam.ghost_clipping import rule


class StandardizedKernelBlock:
    """The block of W in a convolution with `standardize_kernel(W)`.

    `inner` is the `ConvolutionBlock` of the scaled output gradients;
    `ones_dot` and `k_dot` are `[B, p]` (1 . u~_o and k_o . u~_o per example);
    `kernel` is k as `[n, p]` and `ratio` is r, `[p]`.
    """

    def __init__(self, inner, ones_dot, k_dot, kernel, ratio):
        self.inner = inner
        self.ones_dot, self.k_dot = ones_dot, k_dot
        self.kernel, self.ratio = kernel, ratio
        self.shape = inner.shape
        self.n = float(kernel.shape[0])

    def _jacobian_times(self, w):
        """s J w: `w` (the kernel's shape) with each column made orthogonal
        to the ones and to k (r less of k)."""
        m = tf.reshape(ops.cast(w, "float32"), self.kernel.shape)
        m = m - ops.mean(m, axis=0, keepdims=True)
        m = m - self.kernel * ops.sum(self.kernel * m, axis=0) / self.n
        return tf.reshape(m, self.shape)

    def squared_norms(self, reg_grad=None, scale_sq=None):
        if scale_sq is not None:
            # The removed components are a projection's: with a scale they
            # no longer subtract.
            raise blocks.ScaledNormUnsupportedError(
                "WSConv2D's standardized kernel has no scaled ghost norm")
        reg = None if reg_grad is None else self._jacobian_times(reg_grad)
        sq = self.inner.squared_norms(reg)
        removed = ops.sum(
            ops.square(self.ones_dot)
            + (2.0 - self.ratio) * ops.square(self.k_dot), axis=1) / self.n
        # Float rounding could make a gradient along 1 and k alone negative.
        return ops.maximum(sq - removed, 0.0)

    def weighted_sum(self, factors):
        return self._jacobian_times(self.inner.weighted_sum(factors))

    def grouped(self, size):
        return StandardizedKernelBlock(
            self.inner.grouped(size), blocks.sum_groups(self.ones_dot, size),
            blocks.sum_groups(self.k_dot, size), self.kernel, self.ratio)


class StandardizedConvolutionRule(convolution.ConvolutionRule):
    """`WSConv2D`: the convolution rule with the kernel standardized."""

    shifted_pass = False  # blocks read the kernel (its standardization)
    name = "WSConv"

    def kernel_value(self):
        return layers.standardize_kernel(
            rule.stopped(self.layer.kernel),
            self.layer.standardization_epsilon)

    def kernel_block(self, recording, inputs, grads, convs):
        layer = self.layer
        eps = layer.standardization_epsilon
        w = ops.cast(rule.stopped(layer.kernel), "float32")
        variance = ops.var(w, axis=tuple(range(len(w.shape) - 1)))  # [p]
        scale = ops.sqrt(variance + eps)
        scaled = [g / scale for g in grads]
        inner = convolution.ConvolutionBlock(layer, inputs, scaled, recording)
        ones = tf.ones(inner.kernel_size + [inner.shape[-2], 1], tf.float32)
        ones_dot = tf.add_n([
            ops.sum(tf.nn.convolution(
                x, ones, strides=inner.strides, padding=padding.upper(),
                dilations=inner.rates) * g, axis=(1, 2))
            for (x, padding), g in zip(inputs, scaled)
        ])
        k_dot = tf.add_n([ops.sum(z * g, axis=(1, 2))
                          for z, g in zip(convs, scaled)])
        kernel = tf.reshape(layers.standardize_kernel(w, eps),
                            [inner.d, inner.p])
        return StandardizedKernelBlock(inner, ones_dot, k_dot, kernel,
                                       variance / (variance + eps))
