"""The phases of one DP step: per-example gradients, clip and sum, noise, scale.

Each phase is a function of its own so that a variant (another way to get
per-example gradients, accumulation over micro-batches, replicas) replaces one
phase and keeps the others:

1. `per_example_gradients`: one gradient per example, vectorized by
   `vectorization.vectorized_map` (no Python loop; XLA-compilable).
2. `clip_and_sum`: clip each example's gradient to global L2 norm C and sum.
3. `add_noise`: add N(0, (sigma C)^2 I) once to the sum.
4. `scale`: divide by the public denominator B.

Under `tf.distribute` every replica clips its own examples; the sums are
added over replicas, the noise is drawn once (on the first replica) and the
denominator is the global B. With gradient accumulation the per-replica sums
of a logical step are all-reduced once, in cross-replica context
(`sum_replica_copies`).

Phases 2 to 4 compute in float32 whatever the model's dtype policy (even
`bfloat16` or `float16` variables): the norms, the clip factors, the clipped
sum, the noise and the division by B. Only the privatized gradient is cast
to each variable's dtype, by the optimizer (post-processing). An example
whose gradient or loss is NaN or infinite contributes nothing (clip factor
0; should its 0 * inf still make a sum NaN, the step computes the sums again
with its rows taken from a finite example marked absent:
`without_non_finite`), so one such example cannot turn the sum into NaN and
reveal itself.
"""

import os
import secrets
import sys
import warnings

import numpy as np
import tensorflow as tf
from keras import ops
from keras import random as keras_random

from tf_dpadam import dp_math
from tf_dpadam import vectorization


# Shown when a user passes an explicit seed for the DP noise or sampling.
REPRODUCIBLE_SEED_WARNING = (
    "{what} uses the explicit seed={seed!r}: anyone who knows it can"
    " regenerate {drawn} and remove {effect}, so {consequence}. Use explicit"
    " seeds for reproducible research only; leave seed=None (the default) to"
    " draw the seed from the operating system's entropy."
)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def secret_seed():
    """A 63-bit seed from the operating system's CSPRNG (`secrets`).

    Independent of `keras.utils.set_random_seed`, `tf.random.set_seed`,
    `random.seed` and `np.random.seed`: a script's seed cannot regenerate it.
    """
    return secrets.randbits(63)


def _user_stacklevel():
    """The `stacklevel` of the first caller outside tf_dpadam and Keras."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_PACKAGE_DIR)
                or f"{os.sep}keras{os.sep}" in path):
            return level
        frame = frame.f_back
        level += 1
    return 1


def resolve_seed(seed, what, drawn, effect,
                 consequence="the result is NOT differentially private"
                 " against them"):
    """`seed` if given (with a warning), else a `secret_seed()`.

    Args:
        seed: None or an int in [0, 2**63).
        what, drawn, effect, consequence: the parts of the warning
            (`REPRODUCIBLE_SEED_WARNING`), which points at the user's line.

    Raises:
        ValueError: if `seed` is neither None nor an int in [0, 2**63).
    """
    if seed is None:
        return secret_seed()
    if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
            or not 0 <= seed < 2**63):
        raise ValueError(
            f"Expected seed={seed!r} to be None or an int in [0, 2**63)."
        )
    seed = int(seed)
    warnings.warn(
        REPRODUCIBLE_SEED_WARNING.format(
            what=what, seed=seed, drawn=drawn, effect=effect,
            consequence=consequence,
        ),
        stacklevel=_user_stacklevel(),
    )
    return seed


def _add_batch_axis(structure):
    return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), structure)


def _drop_batch_axis(structure):
    return tf.nest.map_structure(lambda t: t[0], structure)


def gradients_or_zeros(tape, target, variables, output_gradients=None):
    """`tape.gradient`, with zeros for variables that `target` never reads.

    (`UnconnectedGradients.ZERO` fails on a Keras variable that was never
    read: TensorFlow takes its string dtype for a `tf.DType`.)
    """
    grads = tape.gradient(target, variables, output_gradients=output_gradients)
    return [
        tf.zeros(v.shape, v.dtype) if g is None else g
        for v, g in zip(variables, grads)
    ]


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
        grads = gradients_or_zeros(tape, loss, variables)
        return grads, loss, _drop_batch_axis(aux)

    packed = tuple(examples[i] for i in present)
    return vectorization.vectorized_map(one_example, packed)


def clip_and_sum(per_example_grads, l2_norm_clip, mask=None, finite=None):
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
        l2_norm_clip: C.
        mask: optional `[batch]` tensor of 0/1; rows with 0 (padding, absent
            examples) contribute nothing.
        finite: optional `[batch]` bool tensor; False rows (e.g. a NaN loss)
            contribute nothing.

    Returns:
        `(summed, norms)`: the list of float32 sums of clipped gradients and
        the per-example norms before clipping (NaN or inf for an example
        whose gradient is not finite).
    """
    norms = dp_math.per_example_global_norms(per_example_grads)
    factors = dp_math.clip_factors(norms, l2_norm_clip, finite=finite)
    if mask is not None:
        factors = factors * ops.cast(mask, factors.dtype)
    summed = [
        tf.tensordot(factors, ops.cast(g, "float32"), axes=[[0], [0]])
        for g in per_example_grads
    ]
    return summed, norms


def all_finite(tensors):
    """Whether every entry of every tensor is finite (a scalar bool)."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t))
                          for t in tensors])


def without_non_finite(examples, present, norms, losses, group_size=1):
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


# Secure mode draws each noise value as the sum of this many normals of std
# stddev / sqrt(count) (the same variance; Holohan & Braghin 2021: a sum of
# several floating-point normals is far harder to invert than one).
SECURE_MODE_DRAWS = 4


def gaussian(shape, stddev, dtype, seed, secure_mode=False):
    """N(0, stddev^2) samples from TensorFlow's Philox generator.

    `seed` is a `[2]` integer seed (int32 or int64; all 64 bits of int64
    words are used). The algorithm is named: TensorFlow's default ("auto_select")
    compiles under XLA on CPU to a generator 50x slower than Philox (1.8M
    normals: 620 vs 12 ms; graphs: 18 ms either way), which made the noise
    alone cost a third of an XLA step of the text model. With
    `secure_mode`, each value is the sum of `SECURE_MODE_DRAWS` independent
    normals of std `stddev / sqrt(SECURE_MODE_DRAWS)`.
    """
    seed = tf.convert_to_tensor(seed)
    if not secure_mode:
        return tf.random.stateless_normal(
            shape, seed=seed, stddev=stddev, dtype=dtype, alg="philox"
        )
    draws = tf.random.experimental.stateless_split(
        seed, SECURE_MODE_DRAWS, alg="philox"
    )
    part = stddev / SECURE_MODE_DRAWS ** 0.5
    return tf.add_n([
        tf.random.stateless_normal(
            shape, seed=s, stddev=part, dtype=dtype, alg="philox"
        )
        for s in tf.unstack(draws)
    ])


def add_noise(grads, stddev, seed, share=1.0, secure_mode=False):
    """Adds N(0, stddev^2) noise to every coordinate, once.

    Args:
        grads: list of tensors.
        stddev: sigma * C (a Python number).
        seed: a `[2]` integer seed, split into one independent seed per
            tensor (`NoiseSeeds.next` gives one per step).
        share: multiplies the noise; under `tf.distribute` it is 1 on one
            replica and 0 on the others, so that the noise is added once.
        secure_mode: each value the sum of several normals (`gaussian`).

    Returns:
        The noised tensors, float32 whatever the dtype of `grads` (the noise
        is drawn in float32: a Gaussian drawn in bfloat16 or float16 is
        coarsely quantized). With `stddev == 0` they are returned unchanged,
        cast to float32.
    """
    grads = [ops.cast(g, "float32") for g in grads]
    if stddev == 0:
        return grads
    # Never the same seed twice: equal-shaped tensors would get equal noise.
    seeds = tf.unstack(tf.random.experimental.stateless_split(
        tf.cast(seed, tf.int64), num=len(grads), alg="philox"
    ))
    return [
        g + ops.cast(share, "float32") * gaussian(
            ops.shape(g), stddev, "float32", s, secure_mode=secure_mode
        )
        for g, s in zip(grads, seeds)
    ]


class NoiseSeeds:
    """The seeds of the DP noise: a key and a count of draws, never saved.

    Each draw's seed is a Philox hash of `(key, draws so far)` paired with
    the optimizer's step, so no two draws of one process share a seed (not
    after a recompile that resets the step either), and a run resumed from a
    checkpoint with an explicit key does not replay the noise of the steps
    before the checkpoint. The key is `secret_seed()` unless the user gave a
    seed. The state lives in a variable that the owner keeps out of Keras'
    and TensorFlow's tracking, so it is not in `model.weights`, a `.keras`
    file or a checkpoint.
    """

    def __init__(self, key):
        self._generator = keras_random.SeedGenerator(
            key, name="dp_noise_seed"
        )

    def next(self, step):
        """A fresh `[2]` int64 seed for the noise of optimizer step `step`."""
        state = tf.cast(self._generator.next(), tf.int64)
        mixed = tf.random.stateless_uniform(
            [], seed=state, minval=None, maxval=None, dtype=tf.int64,
            alg="philox",
        )
        return tf.stack([mixed, tf.cast(step, tf.int64)])


def scale(grads, denominator):
    """Divides by the public denominator B, in float32.

    The result stays float32: it is cast to each variable's dtype only when
    the optimizer applies it (`DPOptimizerMixin.apply_private`).
    """
    return [
        ops.cast(g, "float32") / ops.cast(denominator, "float32")
        for g in grads
    ]


def sum_over_replicas(values):
    """Sums a structure of tensors over `tf.distribute` replicas (if any)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return values
    return context.all_reduce(tf.distribute.ReduceOp.SUM, values)


def replica_share(summed):
    """This replica's share of sums that every replica holds whole.

    Keras adds the gradients that the `tf.distribute` replicas hand to the
    optimizer, so each replica hands in 1/R of the whole clipped sum (and
    only the first one the noise: `first_replica_share`).
    """
    replicas = num_replicas()
    if replicas == 1:
        return summed
    return [g / replicas for g in summed]


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


def sum_replica_copies(strategy, variables, first_replica=None):
    """The sum over all replicas of per-replica variables: one all-reduce.

    For cross-replica context (a `merge_call`), with variables that keep one
    copy per replica (`synchronization="on_read"`, as the accumulators of
    `accumulation.py`). All values go through one `batch_reduce_to`, over all
    replicas of all workers.

    Args:
        strategy: the `tf.distribute` strategy.
        variables: a list of Keras variables.
        first_replica: optional `f(list of tensors) -> list of tensors`,
            applied to the copies of the replica with global id 0 only,
            before the sum: the noise is drawn there, once in total, and
            reaches every worker through the all-reduce (so workers need not
            share a noise key).

    Returns:
        The list of sums, as tensors on this worker's first device (the same
        values on every worker).
    """
    copies = [strategy.experimental_local_results(v.value) for v in variables]
    devices = strategy.extended.worker_devices

    def replica_values(context):
        replica = context.replica_id_in_sync_group  # a Python int
        local = replica % len(devices)
        with tf.device(devices[local]):
            values = [tf.identity(c[local]) for c in copies]
            if first_replica is not None and replica == 0:
                values = list(first_replica(values))
        return values

    per_replica = strategy.experimental_distribute_values_from_function(
        replica_values
    )
    reduced = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM,
        [(value, v.value) for value, v in zip(per_replica, variables)],
    )
    return [strategy.experimental_local_results(r)[0] for r in reduced]
