"""Per-example gradient blocks: what a rule hands to the step.

A block stands for the per-example gradients of one variable (or of its use
at one call site) without necessarily forming them. The step asks each block
for two things only:

* `squared_norms(reg_grad=None, scale_sq=None)`: `[B]`, each example's
  squared gradient norm (with `reg_grad`, the gradient R' of the
  regularization loss, the squared norm of `grad_i + R'` minus `||R'||^2`:
  the cross term `2 grad_i . R'` is included, `||R'||^2` is added once by
  the step; with `scale_sq`, S^2 for a coordinate-wise scale S of the
  variable's shape, the squared norm of `S * grad_i`, the step passing
  `S^2 * R'` as `reg_grad`; a block that cannot scale raises
  `ScaledNormUnsupportedError`);
* `weighted_sum(factors)`: `sum_i factors_i grad_i`, the variable's clipped sum
  once `factors` are the clip factors;

and, with augmentation multiplicity (K views of each example, in consecutive
rows), for a third:

* `grouped(size)`: the block of the groups of `size` consecutive rows, whose
  gradient is the sum of its rows' gradients (the cross terms between the
  rows of a group are in its norm).

Rules for particular layers add their own blocks (embedding rows, convolution
patches) with the same methods.
"""

import tensorflow as tf
from keras import ops


class ScaledNormUnsupportedError(Exception):
    """A block has no norm of a coordinate-wise scaled gradient (the step
    turns it into `GhostClippingUnsupportedError`)."""

# Per-example squared norms of a kernel used at T positions (T > 1): the
# ghost norm costs about T^2 (d + p) and memory T^2 per example; materializing
# a_i^T g_i costs T d p and memory d p per example (and makes the clipped sum
# a cheap weighted sum). Materialize unless d p exceeds this many times T^2.
MATERIALIZE_MAX_RATIO = 1.0
# When T is not known statically: materialize while d p is at most this.
MATERIALIZE_MAX_UNKNOWN_T = 1 << 16


def group_rows(t, size):
    """`[N, T, ...]` as `[N / size, size * T, ...]`: the rows of a group side
    by side, as positions of one example (static sizes kept where known)."""
    if size == 1:
        return t
    dims = [d if d is not None else tf.shape(t)[i]
            for i, d in enumerate(t.shape)]
    return tf.reshape(t, [dims[0] // size, size * dims[1], *dims[2:]])


def sum_groups(t, size):
    """`[N, ...]` as `[N / size, ...]`: the sum of each group's rows."""
    return ops.sum(group_rows(t[:, None], size), axis=1)


class MaterializedBlock:
    """Per-example gradients `[B, *var.shape]`, materialized."""

    def __init__(self, per_example):
        self.per_example = per_example

    def _flat(self):
        g = self.per_example
        return ops.reshape(g, (ops.shape(g)[0], -1))

    def squared_norms(self, reg_grad=None, scale_sq=None):
        flat = self._flat()
        if scale_sq is None:
            sq = ops.sum(ops.square(flat), axis=1)
        else:
            sq = ops.matmul(ops.square(flat),
                            ops.reshape(ops.cast(scale_sq, flat.dtype), (-1,)))
        if reg_grad is not None:
            sq = sq + 2.0 * ops.matmul(
                flat, ops.reshape(ops.cast(reg_grad, flat.dtype), (-1,))
            )
        return sq

    def weighted_sum(self, factors):
        return tf.tensordot(factors, self.per_example, axes=[[0], [0]])

    def grouped(self, size):
        return MaterializedBlock(sum_groups(self.per_example, size))


def linear_mode(t, d, p):
    """How a `[d, p]` weight used at `t` positions per example is handled.

    "outer" (one position: the norm is ||a|| ||g||), "materialize" (form
    a_i^T g_i) or "ghost" (the ghost norm from the Gram matrices).
    """
    if t == 1:
        return "outer"
    if t is None:
        return "materialize" if d * p <= MATERIALIZE_MAX_UNKNOWN_T else "ghost"
    return "materialize" if d * p <= MATERIALIZE_MAX_RATIO * t * t else "ghost"


class LinearBlock:
    """A weight used as `z_t = a_t W` at T positions: grad_i = sum_t a_t^T g_t.

    `a` is `[B, T, d]`, `g` is `[B, T, p]`, and `to_matrix` / `from_matrix` map
    the variable's shape to `[d, p]` and back.
    """

    def __init__(self, a, g, to_matrix, from_matrix):
        self.a, self.g = a, g
        self.to_matrix, self.from_matrix = to_matrix, from_matrix
        self.mode = linear_mode(a.shape[1], a.shape[2], g.shape[2])
        self.per_example = None
        if self.mode == "materialize":
            self.per_example = tf.einsum("btd,btp->bdp", a, g)

    def squared_norms(self, reg_grad=None, scale_sq=None):
        a, g = self.a, self.g
        reg = None if reg_grad is None else self.to_matrix(reg_grad)
        if scale_sq is not None or self.mode == "materialize":
            per_example = self.per_example
            if per_example is None and self.mode == "outer":
                # One position: sum_dp S_dp^2 a_d^2 g_p^2, a product of the
                # squares (no d x p per example).
                sq = tf.einsum("bd,dp,bp->b", ops.square(a[:, 0]),
                               self.to_matrix(scale_sq),
                               ops.square(g[:, 0]))
                if reg is not None:
                    sq = sq + 2.0 * ops.sum(
                        tf.einsum("btd,dp->btp", a, reg) * g, axis=(1, 2))
                return sq
            if per_example is None:
                # The ghost norm has no scaled form: form a_i^T g_i.
                per_example = tf.einsum("btd,btp->bdp", a, g)
            squares = ops.square(per_example)
            sq = (ops.sum(squares, axis=(1, 2)) if scale_sq is None else
                  tf.einsum("bdp,dp->b", squares, self.to_matrix(scale_sq)))
            if reg is not None:
                sq = sq + 2.0 * tf.einsum("bdp,dp->b", per_example, reg)
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

    def weighted_sum(self, factors):
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

    def grouped(self, size):
        # A group's gradient is sum over its rows and positions of a^T g:
        # the rows become positions (T = 1, "outer", becomes T = size).
        return LinearBlock(group_rows(self.a, size), group_rows(self.g, size),
                           self.to_matrix, self.from_matrix)


def concatenated(linear_blocks):
    """One `LinearBlock` for the sum of `linear_blocks`' gradients (same
    matrix maps): their positions side by side."""
    if len(linear_blocks) == 1:
        return linear_blocks[0]
    first = linear_blocks[0]
    return LinearBlock(ops.concatenate([b.a for b in linear_blocks], axis=1),
                       ops.concatenate([b.g for b in linear_blocks], axis=1),
                       first.to_matrix, first.from_matrix)
