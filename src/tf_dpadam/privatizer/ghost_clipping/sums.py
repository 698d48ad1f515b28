"""Ghost clipping's per-example norms and clipped sums, from the blocks.

`norms` adds up each example's squared norm over the blocks of a set of
variables (the regularization term's cross term and its square included;
with `scales`, of the scaled gradients S * grad_i); `weighted_sums` is each
variable's `sum_i factors_i grad_i`.
"""

import tensorflow as tf
from keras import ops


def norms(variables, blocks, reg_grads, batch_size, scales=None):
    """Each example's gradient norm `[B]` over all variables; of the scaled
    gradients S * grad_i for the variables in `scales` (id -> S)."""
    squared = tf.zeros([batch_size], "float32")
    for v in variables:
        reg = reg_grads.get(id(v))
        scale = (scales or {}).get(id(v))
        if reg is not None:
            reg = ops.cast(reg, "float32")
        # ||S (g_i + R')||^2 - ||S R'||^2 = ||S g_i||^2 + 2 g_i . S^2 R'.
        scaled_reg = cross_reg = reg
        if reg is not None and scale is not None:
            scaled_reg = scale * reg
            cross_reg = scale * scaled_reg
        scale_sq = None if scale is None else ops.square(scale)
        for block in blocks.get(id(v), []):
            # A block without a scaled norm raises
            # `blocks.ScaledNormUnsupportedError`.
            squared = squared + block.squared_norms(cross_reg, scale_sq)
        if reg is not None:
            squared = squared + ops.sum(ops.square(scaled_reg))
    return ops.sqrt(ops.maximum(squared, 0.0))


def weighted_sums(variables, blocks, reg_grads, factors_per_variable):
    """`sum_i factors_i grad_i` per variable (zeros without gradient), in
    float32 (the blocks compute in float32: their rules cast the recorded
    tensors), whatever the variable's dtype; each variable with its own
    `[B]` factors (those of its clipping group)."""
    summed = []
    for v, factors in zip(variables, factors_per_variable):
        parts = [block.weighted_sum(factors) for block in blocks.get(id(v), [])]
        reg = reg_grads.get(id(v))
        if reg is not None:
            parts.append(ops.sum(factors) * ops.cast(reg, "float32"))
        if parts:
            s = parts[0]
            for part in parts[1:]:
                s = s + part
            s = tf.reshape(ops.cast(s, "float32"), v.shape)
        else:
            s = tf.zeros(v.shape, "float32")
        summed.append(s)
    return summed
