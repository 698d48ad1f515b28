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
denominator and Phi are public constants (a private model's `fit` refuses
anything else on these batches, and an optimizer whose
`gradient_accumulation_steps` is not the pipeline's k). The padding rows
count in neither the loss nor the training metrics, `metrics` and
`weighted_metrics` alike. A private model's `fit` on in-memory data builds
this pipeline itself (`tf_dpadam.training.private_fit`).

To preprocess or augment the batches, `batches.map_examples(fn)` runs
`fn(x, y) -> (x, y)` on one example at a time and carries the weights
through: still Poisson. `fit` refuses a `map` of your own on
`batches.dataset`, which sees whole padded batches: dropping or replacing
the weights makes the padding count, and batch statistics mix the
examples; either moves a step's clipped sum by more than C.

The amplification by subsampling assumes that nobody can tell which examples
a step sampled, so the sampling is keyed by a secret: by default 63 bits from
the operating system's CSPRNG (`step.seeds.secret_seed`), which no global seed
(`keras.utils.set_random_seed`, `tf.random.set_seed`, `random.seed`,
`np.random.seed`) fixes. Step t's mask is `stateless_uniform(seed=(key,
nonce_t)) < q`, where the nonces are public 64-bit values, new at every step
and every pass (`sampling.step_nonces`). An explicit `seed=` is that key:
the same seed gives the same batches, pass after pass, whatever the other
seeds, and warns that anyone who knows it can regenerate every batch. A run
resumed in a new process passes `first_step=` (the steps taken) so that it
does not replay the batches of its first steps.

Cyclic Poisson sampling (`groups=b`), for banded correlated noise
(Choquette-Choo, McMahan, Rush & Thakurta 2023, arXiv 2306.08153,
"Amplified banded matrix factorization"): example i belongs to group
i mod b, a public partition fixed by the examples' order alone (not by
their values, nor by the key), and step j samples only the examples of
group (group_offset + j) mod b, each with probability q = min(1, b B / N),
so that a batch still holds about B examples. An example joins at most one
of any b consecutive steps; with a noise strategy of at most b bands the
accounting is that of ceil(T / b) Poisson steps at q (the ledger's
`Mechanism.poisson(..., bands=b)`).

Datasets larger than memory: `poisson_batches_from_source` (module
`data_source`, also importable from here) samples the same Poisson batches
by random access. What the two pipelines and the sharded one (`sharding`)
share, the step layout, key, nonces, padding and splitting, is in
`sampling`.
"""

import numpy as np
import tensorflow as tf

from tf_dpadam.data import sampling
# `tf_dpadam.data` is where users import every sampler from.
from tf_dpadam.data.source import poisson_batches_from_source
from tf_dpadam.data.source import poisson_subset
from tf_dpadam.data.source import stack_records
from tf_dpadam.data.source import uniform_subset
from tf_dpadam.data.sampling import PoissonBatches
from tf_dpadam.data.sampling import binomial_upper_tail
from tf_dpadam.data.sampling import poisson_capacity

__all__ = [
    "PoissonBatches",
    "binomial_upper_tail",
    "poisson_batches",
    "poisson_batches_from_source",
    "poisson_capacity",
    "poisson_subset",
    "stack_records",
    "uniform_subset",
]


def poisson_batches(
    data: tuple | list,
    *,
    expected_batch_size: int,
    physical_batch_size: int | None = None,
    steps_per_epoch: int | None = None,
    seed: int | None = None,
    max_overflow_probability: float = 1e-10,
    pad_to_multiple_of: int | None = None,
    first_step: int = 0,
    groups: int = 1,
    group_offset: int = 0,
) -> PoissonBatches:
    """A `tf.data` pipeline of Poisson-sampled, padded, split batches.

    The whole dataset is in memory and each step draws a Bernoulli(q) mask
    over its N examples; for datasets larger than memory see
    `poisson_batches_from_source`. The pipeline reads each step's rows from
    the caller's arrays (`sampling.gather_rows`) and makes no copy of them,
    so they must not change while it is used.

    Args:
        data: `(x, y)` or `(x, y, sample_weight)` with NumPy arrays (or nested
            structures of them) sharing the first dimension N.
        expected_batch_size: B; the sampling rate is q = B / N (with
            `groups` = g > 1: q = min(1, g B / N) within a step's group).
        physical_batch_size: b, the batch that fits in memory; defaults to
            the capacity M (k = 1), then a multiple of 8.
        steps_per_epoch: logical steps per pass; defaults to ceil(N / B).
            With `groups` = g > 1 it is rounded up to a multiple of g: each
            pass counts its steps from 0 again, so every pass starts at the
            same group and the groups cycle one per step across passes.
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
        first_step: the logical steps already taken, when a run resumes in
            a new process (e.g. `model.optimizer.iterations`). With an
            explicit `seed`, 0 would replay the batches of the run's first
            steps, which the accounting counts as independent samples; each
            start gets its own stream (reproducible for the same seed and
            start).
        groups: g in [1, 64] (`sampling.MAX_GROUPS`), with g B <= N.
            1 (default): plain Poisson sampling, every step over all N
            examples (the same batches as without it). g > 1: cyclic Poisson
            sampling (see the module): example i is in group i mod g (a
            public, data-independent partition: the examples' order), and
            step j of the stream (0, 1, ..., counted on across passes)
            samples only group (group_offset + j) mod g, each of its
            examples with probability q = min(1, g B / N). The capacity M
            bounds one group's Binomial(ceil(N / g), q); the registered
            plan has `groups=g`.
        group_offset: an int >= 0, the group of step 0 (modulo `groups`);
            a run resumed at `first_step` t that continues the cycle of a
            run started at offset o passes o + t. Any offset is accounted
            the same.

    Returns:
        A `PoissonBatches`.

    Raises:
        ValueError: on arguments out of range (including `seed`).
    """
    sampling.nonce_seed2(first_step)  # Checks it.
    sampling.check_group_offset(group_offset)
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
    layout = sampling.make_layout(
        num_examples, expected_batch_size, physical_batch_size,
        steps_per_epoch, max_overflow_probability, pad_to_multiple_of,
        groups)
    key = sampling.resolve_key(seed, "poisson_batches")

    x, y = data[0], data[1]
    weight = data[2] if len(data) == 3 else np.ones(num_examples, "float32")
    q = layout.sampling_rate

    def sample_step(nonce):
        seed_pair = tf.stack([tf.constant(key, tf.int64), nonce])
        included = tf.random.stateless_uniform([num_examples],
                                               seed=seed_pair) < q
        indices = tf.cast(tf.where(included)[:, 0], tf.int32)
        rows = sampling.gather_rows((x, y, weight), indices)
        return sampling.pad_and_split(rows, tf.size(indices), layout)

    if groups == 1:
        return sampling.pipeline(sample_step, layout, first_step=first_step)

    # Cyclic Poisson sampling: example i is in group i mod g (public, fixed
    # by the order alone); step j samples group (offset + j) mod g.
    offset = int(group_offset) % groups

    def sample_group_step(step, nonce):
        seed_pair = tf.stack([tf.constant(key, tf.int64), nonce])
        coins = tf.random.stateless_uniform([num_examples],
                                            seed=seed_pair) < q
        group_of = tf.math.floormod(
            tf.range(num_examples, dtype=tf.int64), groups)
        group = tf.math.floormod(step + offset, groups)
        included = tf.logical_and(coins, tf.equal(group_of, group))
        indices = tf.cast(tf.where(included)[:, 0], tf.int32)
        rows = sampling.gather_rows((x, y, weight), indices)
        return sampling.pad_and_split(rows, tf.size(indices), layout)

    return sampling.pipeline(sample_group_step, layout,
                             first_step=first_step, step_index=True,
                             group_offset=offset)
