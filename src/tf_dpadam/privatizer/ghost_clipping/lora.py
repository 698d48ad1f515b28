"""Rules for `Dense` and `EinsumDense` with LoRA enabled.

Keras' LoRA layers compute `z = a (W + s A B) (+ b)` with the frozen kernel
W, the trainable factors A (`lora_kernel_a`) and B (`lora_kernel_b`) and
`s = lora_alpha / lora_rank`. With `g = dL/dz` at the positions t of an
example (`dense.DenseRule` reduces EinsumDense to `[B, T, d]` inputs and
`[B, T, p]` output gradients):

    dL/dB = s sum_t (a_t A)^T g_t        (rank-r input, p outputs)
    dL/dA = s sum_t a_t^T (g_t B^T)      (d inputs, rank-r output gradient)

two `blocks.LinearBlock`s of `d x r` and `r x p` products per example,
never `d x p` (`lora_blocks`). W, not trainable, gets no block (if it is made
trainable again it gets the plain kernel block); the bias is as without LoRA.
Each factor's block reads the other factor, so a record of DiSK's second
pass (at shifted weights) reads it shifted, and a factor's block is the
records' positions side by side (`blocks.concatenated`).

EinsumDense: Keras multiplies A (the kernel's shape with its last axis
replaced by the rank) and B (`[r, k]`, k the kernel's last axis) on that
last axis. Seen as the `[d, p]` matrix of the kernel:

* last axis an output axis (e.g. "abc,cde->abde", A `[c, d, r]`, B
  `[r, e]`): `W = s A (I ⊗ B)`, A the `[d, (p/k) r]` matrix; the other
  output axes (the heads) become positions of B;
* last axis contracted (e.g. "abc,dc->abd", A `[d, r]`, B `[r, c]`):
  `W = s (I ⊗ B^T) A`, A the `[(d/k) r, p]` matrix; B acts on the input
  first and its gradient is `[k, r]`, transposed.
"""

import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import dense
from tf_dpadam.privatizer.ghost_clipping import rule

# The letter standing for the rank in the factors' einsum specs.
_RANK = "0"


def _matmul_last(x, m):
    """`x @ m` over the last axis of `x`, as one 2-D product.

    (TensorFlow 2.21's oneDNN batch matmul is wrong for some broadcasts of a
    matrix against a batch; see `src/tf_dpadam/privatizer/vectorization.py`.)
    """
    shape = tf.shape(x)
    y = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), m)
    return tf.reshape(y, tf.concat([shape[:-1], [m.shape[-1]]], axis=0))


def _identity(w):
    return ops.cast(w, "float32")


def _transpose(w):
    return tf.transpose(ops.cast(w, "float32"))


def lora_blocks(a, g, a_matrix, b, scale, output_side, a_to_matrix,
                a_from_matrix):
    """The blocks of the LoRA factors A and B of one kernel.

    Args:
        a: `[B, T, d]`, the layer's input at its T positions.
        g: `[B, T, p]`, the gradient of the loss w.r.t. the output.
        a_matrix: the factor A as a matrix: `[d, (p/k) r]` if `output_side`,
            else `[(d/k) r, p]` (k: B's second dimension).
        b: the factor B, `[r, k]`.
        scale: s, the layer's `lora_alpha / lora_rank`.
        output_side: whether B's k axis is (the last of) the output axes,
            else (the last of) the contracted ones.
        a_to_matrix, a_from_matrix: A's shape to `a_matrix`'s and back.

    Returns:
        `(block of A, block of B)`.
    """
    r, k = b.shape
    batch = tf.shape(a)[0]
    b_t = tf.transpose(b)
    if output_side:
        # z = a A (I ⊗ B): positions t and the other output axes j index
        # u = a A, [B, T, (p/k), r], against g, [B, T, (p/k), k].
        u = _matmul_last(a, a_matrix)
        b_block = blocks.LinearBlock(
            scale * tf.reshape(u, [batch, -1, r]), tf.reshape(g, [batch, -1, k]),
            to_matrix=_identity, from_matrix=lambda m: m,
        )
        g_u = _matmul_last(tf.reshape(g, [batch, -1, k]), b_t)
        g_u = scale * tf.reshape(g_u, [batch, -1, a_matrix.shape[1]])
        a_block = blocks.LinearBlock(a, g_u, a_to_matrix, a_from_matrix)
    else:
        # z = (a (I ⊗ B^T)) A: B maps the input's last contracted axis to r.
        v = _matmul_last(tf.reshape(a, [batch, -1, k]), b_t)
        v = tf.reshape(v, [batch, -1, a_matrix.shape[0]])
        a_block = blocks.LinearBlock(v, scale * g, a_to_matrix, a_from_matrix)
        g_v = scale * _matmul_last(g, tf.transpose(a_matrix))
        b_block = blocks.LinearBlock(
            tf.reshape(a, [batch, -1, k]), tf.reshape(g_v, [batch, -1, r]),
            to_matrix=_transpose, from_matrix=tf.transpose,
        )
    return a_block, b_block


class _LoraMixin:
    """What LoRA changes in a `DenseRule`: the kernel and its blocks."""

    # Each record's blocks read the other factor at that record's point.
    shifted_pass = True
    weight_names = ("_kernel", "bias", "lora_kernel_a", "lora_kernel_b")
    kernel_name = "_kernel"
    # The rule recomputes the merged kernel (Keras' `kernel` property).
    overridable = ("call", "kernel")

    def _scale(self):
        return self.layer.lora_alpha / self.layer.lora_rank

    def _kernel_value(self):
        """`W + s A B` in the compute dtype, as Keras' `kernel` property."""
        layer = self.layer
        merged = ops.add(
            rule.stopped(compat.lora_frozen_kernel(layer)),
            self._scale() * ops.matmul(rule.stopped(layer.lora_kernel_a),
                                       rule.stopped(layer.lora_kernel_b)),
        )
        return ops.cast(merged, layer.compute_dtype)

    def weight_blocks(self, a_list, g_list, bias_grads, matrix):
        out = super().weight_blocks(a_list, g_list, bias_grads, matrix)
        layer = self.layer
        factors = (self.variable("lora_kernel_a"),
                   self.variable("lora_kernel_b"))
        if all(f is None for f in factors):
            return out
        last = matrix.spec[-1]
        output_side = last in matrix.produced
        # A's einsum spec: the kernel's with the rank for its last axis.
        a_matrix = dense.KernelMatrix(
            matrix.spec[:-1] + _RANK, tuple(layer.lora_kernel_a.shape),
            contracted=matrix.contracted + ("" if output_side else _RANK),
            produced=matrix.produced + (_RANK if output_side else ""),
        )
        # Per record, since a record of a pass at shifted weights reads the
        # shifted factors; each factor's gradient is the sum over records,
        # i.e. one block with the records' positions side by side.
        per_record = [
            lora_blocks(
                a, g,
                a_matrix.to_matrix(self.value_at("lora_kernel_a",
                                                 record["offsets"])),
                ops.cast(self.value_at("lora_kernel_b", record["offsets"]),
                         "float32"),
                self._scale(), output_side,
                a_matrix.to_matrix, a_matrix.from_matrix,
            )
            for record, a, g in zip(self.records, a_list, g_list)
        ]
        for i, variable in enumerate(factors):
            if variable is not None:
                out[id(variable)] = [blocks.concatenated(
                    [pair[i] for pair in per_record])]
        return out


class LoraDenseRule(_LoraMixin, dense.DenseRule):

    name = "Dense with LoRA"


class LoraEinsumDenseRule(_LoraMixin, dense.EinsumDenseRule):

    name = "EinsumDense with LoRA"
