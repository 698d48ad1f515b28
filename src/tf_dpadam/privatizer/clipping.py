"""Phases 1 and 2 of the DP step: per-example gradients, clipped and summed.

1. `per_example_gradients`: one gradient per example, vectorized by
   `vectorization.vectorized_map` (no Python loop; XLA-compilable).
2. `clip_and_sum`: clip each example's gradient to global L2 norm C and sum.

The norms, the clip factors and the clipped sum are float32 whatever the
model's dtype policy (even `bfloat16` or `float16` variables). An example
whose gradient or loss is NaN or infinite contributes nothing (clip factor
0; should its 0 * inf still make a sum NaN, the step computes the sums again
with its rows taken from a finite example marked absent:
`without_non_finite`), so one such example cannot turn the sum into NaN and
reveal itself.
"""

from typing import Callable, Sequence

import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer import dp_math
from tf_dpadam.privatizer import vectorization

def _add_batch_axis(structure):
    return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), structure)


def _drop_batch_axis(structure):
    return tf.nest.map_structure(lambda t: t[0], structure)


def gradients_or_zeros(tape: tf.GradientTape, target, variables: Sequence,
                       output_gradients=None) -> list:
    """`tape.gradient`, with zeros for variables that `target` never reads.

    (`UnconnectedGradients.ZERO` fails on a Keras variable that was never
    read: TensorFlow takes its string dtype for a `tf.DType`.)
    """
    grads = tape.gradient(target, variables, output_gradients=output_gradients)
    return [
        tf.zeros(v.shape, v.dtype) if g is None else g
        for v, g in zip(variables, grads)
    ]


def per_example_gradients(example_loss_fn: Callable, variables: Sequence,
                          examples: tuple) -> tuple:
    """Gradients of each example's loss, vectorized over the batch.

    Args:
        example_loss_fn: `f(*example) -> (loss, aux)` on one example that has a
            batch axis of size 1; `loss` is a scalar and `aux` a structure of
            tensors with that batch axis (for instance the predictions).
        variables: the variables to differentiate.
        examples: a tuple of structures of tensors with a leading example axis
            (use `None` for absent entries such as sample weights).

    Returns:
        `(grads, losses, aux)`: a list with one `[batch, *var.shape]` tensor
        per variable (zeros where a variable does not affect the loss), the
        per-example losses `[batch]` and the stacked `aux`.
    """
    present = [i for i, e in enumerate(examples) if e is not None]

    def one_example(packed):
        example = [None] * len(examples)
        for i, e in zip(present, packed):
            example[i] = _add_batch_axis(e)
        with tf.GradientTape() as tape:
            loss, aux = example_loss_fn(*example)
        grads = gradients_or_zeros(tape, loss, variables)
        return grads, loss, _drop_batch_axis(aux)

    packed = tuple(examples[i] for i in present)
    return vectorization.vectorized_map(one_example, packed)


def clip_and_sum(per_example_grads: Sequence, l2_norm_clip,
                 mask=None, finite=None) -> tuple[list, tf.Tensor]:
    """Clips each example's gradient to global L2 norm C, then sums, in float32.

    The norms, the clip factors and the sum are float32 whatever the dtype of
    the gradients (e.g. bfloat16 under a `bfloat16` dtype policy): a sum
    rounded to the gradients' dtype would err in proportion to |sum|, not to
    C, and removing one example could move it by more than C.

    An example whose gradient (or, with `finite`, loss) is not finite gets
    the clip factor 0; should its 0 * inf make a sum NaN, the private train
    step recomputes the sums without it (`without_non_finite`).

    Args:
        per_example_grads: list of `[batch, ...]` tensors, one per variable.
        l2_norm_clip: C, or a `dp_math.GroupClip` (per-layer clipping: each
            group of variables clipped to its own C_l).
        mask: optional `[batch]` tensor of 0/1; rows with 0 (padding, absent
            examples) contribute nothing.
        finite: optional `[batch]` bool tensor; False rows (e.g. a NaN loss)
            contribute nothing.

    Returns:
        `(summed, norms)`: the list of float32 sums of clipped gradients and
        the per-example norms before clipping (NaN or inf for an example
        whose gradient is not finite); with a `GroupClip`, the norms are
        per group, `[G, batch]`.
    """
    if isinstance(l2_norm_clip, dp_math.GroupClip):
        groups = l2_norm_clip.groups
        norms = ops.stack([
            dp_math.per_example_global_norms(
                [g for g, group in zip(per_example_grads, groups)
                 if group == index])
            for index in range(l2_norm_clip.num_groups)
        ])
        factors = dp_math.group_clip_factors(
            norms, l2_norm_clip.clip_norms, finite=finite)
    else:
        groups = [0] * len(per_example_grads)
        norms = dp_math.per_example_global_norms(per_example_grads)
        factors = dp_math.clip_factors(norms, l2_norm_clip,
                                       finite=finite)[None]
    if mask is not None:
        factors = factors * ops.cast(mask, factors.dtype)
    summed = [
        tf.tensordot(factors[group], ops.cast(g, "float32"), axes=[[0], [0]])
        for g, group in zip(per_example_grads, groups)
    ]
    return summed, norms


def all_finite(tensors: Sequence) -> tf.Tensor:
    """Whether every entry of every tensor is finite (a scalar bool)."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t))
                          for t in tensors])


def without_non_finite(examples: tuple, present, norms, losses,
                       group_size: int = 1) -> tuple:
    """The rows of a step with its non-finite examples made harmless.

    An example whose gradient norm or loss is NaN or infinite gets the clip
    factor 0, but a sum over examples can still turn its 0 * inf into NaN
    (ghost clipping contracts the recorded inputs and output gradients of
    all examples at once; the vectorized map sums materialized gradients).
    For the recomputation of such a step, each row of such an example is
    replaced by the same row of the first finite example (finite inputs,
    labels and weights) and marked absent, so that it adds exactly 0 and
    no NaN; the other examples are unchanged. Without a finite example,
    every example is absent.

    Args:
        examples: `(x, y, sample_weight)`, structures of tensors with K rows
            per example (`group_size` K, consecutive), None for absent
            entries.
        present: `[B]` 1.0 for the examples of the step, 0.0 for absent ones.
        norms, losses: `[B]` per-example gradient norms and losses.
        group_size: K.

    Returns:
        `(examples, present)`: the rows, and `present` without the
        non-finite examples.
    """
    finite = dp_math.finite_examples(norms, losses)
    kept = tf.logical_and(finite, present > 0)
    present = present * tf.cast(finite, present.dtype)
    rows = tf.shape(tf.nest.flatten(examples[0])[0])[0]
    row = tf.range(rows)
    first = tf.argmax(tf.cast(kept, tf.int32), output_type=tf.int32)
    source = tf.where(tf.gather(finite, row // group_size), row,
                      first * group_size + row % group_size)

    def take(t):
        return None if t is None else tf.gather(t, source)

    return tf.nest.map_structure(take, examples), present

