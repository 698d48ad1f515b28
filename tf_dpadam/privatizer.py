"""The phases of one DP step: per-example gradients, clip and sum, noise, scale.

Each phase is a function of its own so that a variant (another way to get
per-example gradients, accumulation over micro-batches, replicas) replaces one
phase and keeps the others:

1. `per_example_gradients`: one gradient per example, vectorized with
   `tf.vectorized_map` (no Python loop over examples; XLA-compilable).
2. `clip_and_sum`: clip each example's gradient to global L2 norm C and sum.
3. `add_noise`: add N(0, (sigma C)^2 I) once to the sum.
4. `scale`: divide by the public denominator B.

Under `tf.distribute` every replica clips its own examples; the sums are
added over replicas, the noise is drawn once (on the first replica) and the
denominator is the global B.
"""

import tensorflow as tf
from keras import ops
from keras import random as keras_random

from tf_dpadam import dp_math


def _add_batch_axis(structure):
    return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), structure)


def _drop_batch_axis(structure):
    return tf.nest.map_structure(lambda t: t[0], structure)


def per_example_gradients(example_loss_fn, variables, examples):
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
        grads = tape.gradient(
            loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        return grads, loss, _drop_batch_axis(aux)

    packed = tuple(examples[i] for i in present)
    return tf.vectorized_map(one_example, packed, fallback_to_while_loop=True)


def clip_and_sum(per_example_grads, l2_norm_clip, mask=None):
    """Clips each example's gradient to global L2 norm C, then sums.

    Args:
        per_example_grads: list of `[batch, ...]` tensors, one per variable.
        l2_norm_clip: C.
        mask: optional `[batch]` tensor of 0/1; rows with 0 (padding, absent
            examples) contribute nothing.

    Returns:
        `(summed, norms)`: the list of sums of clipped gradients and the
        per-example norms before clipping.
    """
    norms = dp_math.per_example_global_norms(per_example_grads)
    factors = dp_math.clip_factors(norms, l2_norm_clip)
    if mask is not None:
        factors = factors * ops.cast(mask, factors.dtype)
    summed = [
        tf.tensordot(ops.cast(factors, g.dtype), g, axes=[[0], [0]])
        for g in per_example_grads
    ]
    return summed, norms


def gaussian(shape, stddev, dtype, seed):
    """N(0, stddev^2) samples from TensorFlow's Philox generator.

    `seed` is a `keras.random.SeedGenerator` (advanced by one draw) or a
    `[2]` integer seed. The algorithm is named: TensorFlow's default
    ("auto_select") compiles under XLA on CPU to a generator 50x slower
    than Philox (1.8M normals: 620 vs 12 ms; graphs: 18 ms either way, and
    graphs draw the same values as before), which made the noise alone
    cost a third of an XLA step of the text model.
    """
    if isinstance(seed, keras_random.SeedGenerator):
        seed = seed.next()
    seed = tf.convert_to_tensor(seed)
    if seed.dtype != tf.int32:
        # As Keras does: stateless ops take int32 seeds under XLA.
        seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    return tf.random.stateless_normal(
        shape, seed=seed, stddev=stddev, dtype=dtype, alg="philox"
    )


def add_noise(grads, stddev, seed, share=1.0):
    """Adds N(0, stddev^2) noise to every coordinate, once.

    Args:
        grads: list of tensors.
        stddev: sigma * C (a Python number).
        seed: a `keras.random.SeedGenerator` (one draw per tensor), or a
            `[2]` integer seed (split into one independent seed per tensor).
        share: multiplies the noise; under `tf.distribute` it is 1 on one
            replica and 0 on the others, so that the noise is added once.

    Returns:
        The noised tensors. With `stddev == 0` they are returned unchanged.
    """
    if stddev == 0:
        return list(grads)
    grads = list(grads)
    if isinstance(seed, keras_random.SeedGenerator):
        seeds = [seed] * len(grads)
    else:
        # Never the same seed twice: equal-shaped tensors would get equal
        # noise.
        seeds = tf.unstack(tf.random.experimental.stateless_split(
            tf.cast(seed, tf.int64), num=len(grads)
        ))
    return [
        g + ops.cast(share, g.dtype) * gaussian(
            ops.shape(g), stddev, g.dtype, s
        )
        for g, s in zip(grads, seeds)
    ]


def scale(grads, denominator):
    """Divides by the public denominator B."""
    return [g / ops.cast(denominator, g.dtype) for g in grads]


def sum_over_replicas(values):
    """Sums a structure of tensors over `tf.distribute` replicas (if any)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return values
    return context.all_reduce(tf.distribute.ReduceOp.SUM, values)


def num_replicas():
    """The number of replicas of the current `tf.distribute` strategy."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def first_replica_share():
    """1.0 on the first replica, 0.0 on the others (1.0 without replicas)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return 1.0
    return tf.cast(
        tf.equal(context.replica_id_in_sync_group, 0), tf.float32
    )
