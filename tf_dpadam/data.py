"""Poisson-sampled batches, the sampling that the privacy accounting assumes.

RDP and PLD accounting for DP-SGD (and so for DP-Adam and DP-AdamBC) assume
Poisson sampling: at every step each of the N examples joins the batch
independently with probability q = B / N, so the batch size is random with
mean B. `poisson_batches` builds such a `tf.data` pipeline:

- each logical step draws a fresh Bernoulli(q) mask over all N examples;
- the sampled examples are padded to a static capacity M (so that XLA compiles
  once), with sample weight 0 on the padding; `make_private` treats examples
  of weight 0 as absent (they contribute nothing, not even a regularization
  gradient);
- M is a multiple of the physical batch size b and is split into k = M / b
  physical batches, to be accumulated by the optimizer
  (`gradient_accumulation_steps=k`) into one DP step;
- M is chosen so that a batch larger than M has probability at most
  `max_overflow_probability` per step (exact binomial tail). Should it happen
  anyway, the pipeline raises an error: no example is dropped silently.

With `pad_to_multiple_of=m` the n sampled examples are instead split into
the same k physical batches, each padded only to the next multiple of m
rows (at least m, at most b): batches of dynamic size that skip most of the
padding's compute (M - B of every M rows with static padding, 30% for
B = 256 of N = 60,000). Each distinct size is a new shape for the kernels
(oneDNN prepares its primitives per shape) and for XLA (one compilation per
shape), so m trades padding against shapes: m = 32 gives at most b / 32
shapes. The privacy accounting is the same either way (it does not treat
the batch size as secret; as with every Poisson implementation with dynamic
batches, the step's timing reveals it).

Use the expected batch size B as the optimizer's `batch_size`, so that the
denominator and Phi are public constants, and compile training metrics as
`weighted_metrics` (Keras weights only those by the sample weights; plain
`metrics` would count the padding rows).

The amplification by subsampling assumes that nobody can tell which examples
a step sampled, so the sampling is keyed by a secret: by default 63 bits from
the operating system's CSPRNG (`privatizer.secret_seed`), which no global seed
(`keras.utils.set_random_seed`, `tf.random.set_seed`, `random.seed`,
`np.random.seed`) fixes. Step t's mask is `stateless_uniform(seed=(key,
nonce_t)) < q`, where the nonces are public 64-bit values, new at every step
and every pass (`_step_nonces`). An explicit `seed=` is that key: the same
seed gives the same batches, pass after pass, whatever the other seeds, and
warns that anyone who knows it can regenerate every batch.
"""

import math
import typing

import numpy as np
import tensorflow as tf

from tf_dpadam import privatizer
from tf_dpadam import validation

# The seeds of the public nonce stream: any pair but (0, 0), which TensorFlow
# replaces with nondeterministic seeds.
_NONCE_SEEDS = (0x5EED_5A3F, 0x0D9A_1516)


class PoissonBatches(typing.NamedTuple):
    """A Poisson-sampled pipeline and what the optimizer needs to know of it.

    Attributes:
        dataset: yields `(x, y, sample_weight)` physical batches of size b.
        sampling_rate: q = B / N.
        expected_batch_size: B, to be the optimizer's `batch_size`.
        capacity: M, the padded size of one logical batch.
        accumulation_steps: k = M / b, the optimizer's
            `gradient_accumulation_steps`.
        steps_per_epoch: logical steps per pass over the dataset.
        overflow_probability: P(Binomial(N, q) > M), for one step.
    """

    dataset: tf.data.Dataset
    sampling_rate: float
    expected_batch_size: int
    capacity: int
    accumulation_steps: int
    steps_per_epoch: int
    overflow_probability: float


def binomial_upper_tail(n, p, m):
    """P(Binomial(n, p) > m), summed exactly in log space."""
    if m >= n:
        return 0.0
    if p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for k in range(m + 1, n + 1):
        term = math.exp(
            math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * log_p + (n - k) * log_q
        )
        total += term
        if term < total * 1e-17 and k > n * p:
            break
    return min(total, 1.0)


def poisson_capacity(num_examples, expected_batch_size, physical_batch_size,
                     max_overflow_probability=1e-10):
    """The smallest multiple M of b with P(Binomial(N, B/N) > M) <= bound.

    Returns:
        `(capacity, overflow_probability)`.
    """
    q = expected_batch_size / num_examples
    capacity = physical_batch_size * math.ceil(
        expected_batch_size / physical_batch_size
    )
    while True:
        overflow = binomial_upper_tail(num_examples, q, capacity)
        if overflow <= max_overflow_probability or capacity >= num_examples:
            return min(capacity, num_examples + physical_batch_size), overflow
        capacity += physical_batch_size


def _step_nonces():
    """Public 64-bit nonces, new at every element and every iteration.

    The op of `tf.data.Dataset.random(rerandomize_each_iteration=True)`
    (`RandomDatasetV2`), called with fixed seeds: `Dataset.random` itself
    mixes TensorFlow's global seed into its seeds and keeps only 31 bits of
    its `seed`. This stream is the same in every process, whatever the global
    seeds; each iteration of the dataset continues it (new values every pass).
    The op's values have 32 bits, so each nonce packs two.
    """
    words = tf.data.experimental.from_variant(
        tf.raw_ops.RandomDatasetV2(
            seed=tf.constant(_NONCE_SEEDS[0], tf.int64),
            seed2=tf.constant(_NONCE_SEEDS[1], tf.int64),
            seed_generator=tf.raw_ops.DummySeedGenerator(),
            output_types=[tf.int64],
            output_shapes=[[]],
            rerandomize_each_iteration=True,
        ),
        tf.TensorSpec([], tf.int64),
    )
    return words.batch(2, drop_remainder=True).map(
        lambda w: tf.bitwise.bitwise_or(tf.bitwise.left_shift(w[0], 32), w[1])
    )


def poisson_batches(data, *, expected_batch_size, physical_batch_size=None,
                    steps_per_epoch=None, seed=None,
                    max_overflow_probability=1e-10, pad_to_multiple_of=None):
    """A `tf.data` pipeline of Poisson-sampled, padded, split batches.

    Args:
        data: `(x, y)` or `(x, y, sample_weight)` with NumPy arrays (or nested
            structures of them) sharing the first dimension N.
        expected_batch_size: B; the sampling rate is q = B / N.
        physical_batch_size: b, the batch that fits in memory; defaults to
            the capacity M (k = 1), then a multiple of 8.
        steps_per_epoch: logical steps per pass; defaults to ceil(N / B).
        seed: None (default): the sampling is keyed by 63 secret bits from
            the operating system's entropy, new at every call and not fixed
            by any global seed. An int in [0, 2**63): the key itself, for
            reproducible research only (with a warning): the same seed gives
            the same batches whatever the global seeds, and anyone who knows
            it can regenerate every batch, which voids the amplification by
            subsampling that the accounting assumes. Every pass over the
            dataset draws new batches either way.
        max_overflow_probability: bound on P(batch size > M) per step.
        pad_to_multiple_of: None (default): physical batches of the static
            size b (XLA compiles once). An int m: each physical batch is
            padded to the next multiple of m only (dynamic sizes <= b).

    Returns:
        A `PoissonBatches`.

    Raises:
        ValueError: on arguments out of range (including `seed`).
    """
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError("Expected data=(x, y) or (x, y, sample_weight).")
    data = tuple(tf.nest.map_structure(np.asarray, item) for item in data)
    num_examples = len(tf.nest.flatten(data[0])[0])
    for item in data:
        for array in tf.nest.flatten(item):
            if len(array) != num_examples:
                raise ValueError(
                    "Expected every array in data to have the same first"
                    f" dimension, got {len(array)} and {num_examples}."
                )
    validation.check_count("expected_batch_size", expected_batch_size)
    if expected_batch_size > num_examples:
        raise ValueError(
            f"Expected expected_batch_size={expected_batch_size} <= the number"
            f" of examples {num_examples}."
        )
    validation.check(0 < max_overflow_probability < 1,
                     "max_overflow_probability", max_overflow_probability,
                     "in (0, 1)")
    if pad_to_multiple_of is not None:
        validation.check_count("pad_to_multiple_of", pad_to_multiple_of)
    q = expected_batch_size / num_examples
    if physical_batch_size is None:
        # A multiple of 8, so that the batch splits evenly over up to 8
        # tf.distribute replicas (a TPU's cores).
        capacity, overflow = poisson_capacity(
            num_examples, expected_batch_size, 8, max_overflow_probability
        )
        physical_batch_size = capacity
    else:
        validation.check_count("physical_batch_size", physical_batch_size)
        capacity, overflow = poisson_capacity(
            num_examples, expected_batch_size, physical_batch_size,
            max_overflow_probability,
        )
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(num_examples / expected_batch_size)
    validation.check_count("steps_per_epoch", steps_per_epoch)
    k = capacity // physical_batch_size
    key = privatizer.resolve_seed(
        seed, what="poisson_batches", drawn="every batch",
        effect="the privacy amplification by subsampling that the accounting"
        " assumes",
        consequence="the run does NOT have the reported (epsilon, delta)"
        " guarantee against them",
    )

    x, y = data[0], data[1]
    weight = data[2] if len(data) == 3 else np.ones(num_examples, "float32")
    constants = tf.nest.map_structure(tf.constant, (x, y, weight))

    def sample_step(nonce):
        seed_pair = tf.stack([tf.constant(key, tf.int64), nonce])
        included = tf.random.stateless_uniform([num_examples], seed=seed_pair) < q
        indices = tf.cast(tf.where(included)[:, 0], tf.int32)
        size = tf.size(indices)
        check = tf.debugging.assert_less_equal(
            size, capacity,
            message=(
                f"A Poisson batch exceeded the capacity {capacity} (chance"
                f" {overflow:.2e} per step); no example is dropped silently:"
                " lower max_overflow_probability and retry."
            ),
        )
        with tf.control_dependencies([check]):
            if pad_to_multiple_of is None:
                rows_per_batch = physical_batch_size  # static
            else:
                m = pad_to_multiple_of
                rows = tf.maximum(1, (size + k - 1) // k)
                rows_per_batch = tf.minimum(
                    physical_batch_size, (rows + m - 1) // m * m
                )
            padding = k * rows_per_batch - size

        def gather_and_pad(array):
            rows = tf.gather(array, indices)
            pad = tf.zeros(
                tf.concat([[padding], tf.shape(array)[1:]], 0), array.dtype
            )
            return tf.concat([rows, pad], 0)

        bx, by, bw = tf.nest.map_structure(gather_and_pad, constants)
        bw = tf.cast(bw, tf.float32)
        return tf.nest.map_structure(
            lambda t: tf.reshape(
                t, tf.concat([[k, rows_per_batch], tf.shape(t)[1:]], 0)
            ),
            (bx, by, bw),
        )

    dataset = (
        _step_nonces()
        .take(steps_per_epoch)
        .map(sample_step, num_parallel_calls=tf.data.AUTOTUNE)
        .unbatch()
        .prefetch(tf.data.AUTOTUNE)
    )
    return PoissonBatches(
        dataset=dataset,
        sampling_rate=q,
        expected_batch_size=expected_batch_size,
        capacity=capacity,
        accumulation_steps=k,
        steps_per_epoch=steps_per_epoch,
        overflow_probability=overflow,
    )
