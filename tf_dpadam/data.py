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
warns that anyone who knows it can regenerate every batch. A run resumed in a
new process passes `first_step=` (the steps taken) so that it does not replay
the batches of its first steps.

Datasets larger than memory: `poisson_batches_from_source` samples the same
Poisson batches by random access into any indexable source (an ArrayRecord or
`tfds.data_source` source, a NumPy memmap, ...). Each step draws the batch
size n ~ Binomial(N, q) and then a uniformly random n-subset of the indices
(`poisson_subset`, exactly independent Bernoulli(q) inclusion of every
example), reads those n records and shares the padding, splitting and
overflow check above: its memory is O(M), whatever N. The secret key and the
public nonces are the same as above; step t draws from NumPy's Philox keyed by
(key, nonce_t).
"""

import math
import typing

import numpy as np
import tensorflow as tf

from tf_dpadam import privatizer
from tf_dpadam import validation

# Nonces are int64 tensors; NumPy's Philox takes a key in [0, 2**128).
_UINT64 = 2**64 - 1

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


def _step_nonces(first_step=0):
    """Public 64-bit nonces, new at every element and every iteration.

    `first_step` selects the stream (0: the original one): a run resumed at
    step t > 0 in a new process passes t, so that its steps do not replay
    the nonces, hence with an explicit key the very batches, of the steps
    before the interruption.

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
            seed2=tf.constant(_nonce_seed2(first_step), tf.int64),
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


def _nonce_seed2(first_step):
    """The second seed of the nonce stream of a run that starts at
    `first_step` (a distinct stream for every start)."""
    validation.check(validation.is_int(first_step) and first_step >= 0,
                     "first_step", first_step, "to be an integer >= 0")
    if first_step == 0:
        return _NONCE_SEEDS[1]
    return (_NONCE_SEEDS[1] + 0x9E37_79B9 * int(first_step)) % (1 << 63)


class _Layout(typing.NamedTuple):
    """The static layout of one logical step, shared by both pipelines."""

    num_examples: int
    sampling_rate: float
    expected_batch_size: int
    physical_batch_size: int
    capacity: int
    accumulation_steps: int
    steps_per_epoch: int
    overflow_probability: float
    pad_to_multiple_of: typing.Optional[int]


def _layout(num_examples, expected_batch_size, physical_batch_size,
            steps_per_epoch, max_overflow_probability, pad_to_multiple_of):
    """Validates the arguments common to both pipelines; sizes M, b and k."""
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
    return _Layout(
        num_examples=num_examples,
        sampling_rate=expected_batch_size / num_examples,
        expected_batch_size=expected_batch_size,
        physical_batch_size=physical_batch_size,
        capacity=capacity,
        accumulation_steps=capacity // physical_batch_size,
        steps_per_epoch=steps_per_epoch,
        overflow_probability=overflow,
        pad_to_multiple_of=pad_to_multiple_of,
    )


def _resolve_key(seed, what):
    return privatizer.resolve_seed(
        seed, what=what, drawn="every batch",
        effect="the privacy amplification by subsampling that the accounting"
        " assumes",
        consequence="the run does NOT have the reported (epsilon, delta)"
        " guarantee against them",
    )


def _pad_and_split(rows, size, layout):
    """One logical step's sampled rows as k padded physical batches.

    Args:
        rows: `(x, y, sample_weight)`, nested structures of tensors whose
            first dimension is the number of sampled examples `size`.
        size: that number, a scalar int32 tensor.
        layout: the `_Layout`.

    Returns:
        `(x, y, sample_weight)` with a leading [k, rows_per_batch]: the
        sampled rows first, then zero rows of weight 0 (the padding).

    Raises (when run):
        tf.errors.InvalidArgumentError: if `size` exceeds the capacity M.
    """
    k, b = layout.accumulation_steps, layout.physical_batch_size
    check = tf.debugging.assert_less_equal(
        size, layout.capacity,
        message=(
            f"A Poisson batch exceeded the capacity {layout.capacity} (chance"
            f" {layout.overflow_probability:.2e} per step); no example is"
            " dropped silently: lower max_overflow_probability and retry."
        ),
    )
    with tf.control_dependencies([check]):
        if layout.pad_to_multiple_of is None:
            rows_per_batch = b  # static
        else:
            m = layout.pad_to_multiple_of
            needed = tf.maximum(1, (size + k - 1) // k)
            rows_per_batch = tf.minimum(b, (needed + m - 1) // m * m)
        padding = k * rows_per_batch - size

    def pad(rows):
        zeros = tf.zeros(
            tf.concat([[padding], tf.shape(rows)[1:]], 0), rows.dtype
        )
        return tf.concat([rows, zeros], 0)

    bx, by, bw = tf.nest.map_structure(pad, rows)
    bw = tf.cast(bw, tf.float32)
    return tf.nest.map_structure(
        lambda t: tf.reshape(
            t, tf.concat([[k, rows_per_batch], tf.shape(t)[1:]], 0)
        ),
        (bx, by, bw),
    )


def _pipeline(sample_step, layout, num_parallel_calls=tf.data.AUTOTUNE,
              first_step=0):
    """The `PoissonBatches` of `sample_step(nonce)`, one call per step."""
    dataset = (
        _step_nonces(first_step)
        .take(layout.steps_per_epoch)
        .map(sample_step, num_parallel_calls=num_parallel_calls)
        .unbatch()
        .prefetch(tf.data.AUTOTUNE)
    )
    return PoissonBatches(
        dataset=dataset,
        sampling_rate=layout.sampling_rate,
        expected_batch_size=layout.expected_batch_size,
        capacity=layout.capacity,
        accumulation_steps=layout.accumulation_steps,
        steps_per_epoch=layout.steps_per_epoch,
        overflow_probability=layout.overflow_probability,
    )


# Arrays larger than this are copied into their variable in row blocks of
# about this size.
_BLOCK_BYTES = 64 * 2**20


def _held_on_host(array):
    """`array` as a tensor the pipeline gathers from, in one copy.

    A variable on the host. The pipeline holding `tf.constant(array)` kept
    2.2x the array in resident memory (tests/data_test.py, 400 MB), which
    with the caller's array took a run on SST-2's cached features (3.3 GB)
    to 14 GB. `tf.Variable(array)` keeps 1.0x but peaks at 2.0x while it is
    made (a transient tensor of the whole array), and two SST-2 processes
    starting runs at once were OOM-killed; a large array is therefore copied
    into a zero variable in row blocks (peak 1.1x). Inside a
    `tf.distribute` scope a variable would be mirrored onto every device,
    so there the array stays a constant.
    """
    if tf.distribute.has_strategy():
        return tf.constant(array)
    with tf.init_scope(), tf.device("/CPU:0"):
        if array.ndim == 0 or array.nbytes <= _BLOCK_BYTES:
            return tf.Variable(array, trainable=False)
        dtype = tf.as_dtype(array.dtype)
        held = tf.Variable(lambda: tf.zeros(array.shape, dtype),
                           trainable=False)
        rows = max(1, _BLOCK_BYTES * len(array) // array.nbytes)
        for start in range(0, len(array), rows):
            end = min(start + rows, len(array))
            held.scatter_update(tf.IndexedSlices(
                tf.constant(array[start:end], dtype), tf.range(start, end)))
        return held


def poisson_batches(data, *, expected_batch_size, physical_batch_size=None,
                    steps_per_epoch=None, seed=None,
                    max_overflow_probability=1e-10, pad_to_multiple_of=None,
                    first_step=0):
    """A `tf.data` pipeline of Poisson-sampled, padded, split batches.

    The whole dataset is held in memory and each step draws a Bernoulli(q)
    mask over its N examples; for datasets larger than memory see
    `poisson_batches_from_source`.

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
        first_step: the logical steps already taken, when a run resumes in
            a new process (e.g. `model.optimizer.iterations`). With an
            explicit `seed`, 0 would replay the batches of the run's first
            steps, which the accounting counts as independent samples; each
            start gets its own stream (reproducible for the same seed and
            start).

    Returns:
        A `PoissonBatches`.

    Raises:
        ValueError: on arguments out of range (including `seed`).
    """
    _nonce_seed2(first_step)  # Checks it.
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
    layout = _layout(num_examples, expected_batch_size, physical_batch_size,
                     steps_per_epoch, max_overflow_probability,
                     pad_to_multiple_of)
    key = _resolve_key(seed, "poisson_batches")

    x, y = data[0], data[1]
    weight = data[2] if len(data) == 3 else np.ones(num_examples, "float32")
    held = tf.nest.map_structure(_held_on_host, (x, y, weight))
    q = layout.sampling_rate

    def sample_step(nonce):
        seed_pair = tf.stack([tf.constant(key, tf.int64), nonce])
        included = tf.random.stateless_uniform([num_examples], seed=seed_pair) < q
        indices = tf.cast(tf.where(included)[:, 0], tf.int32)
        rows = tf.nest.map_structure(lambda a: tf.gather(a, indices), held)
        return _pad_and_split(rows, tf.size(indices), layout)

    return _pipeline(sample_step, layout, first_step=first_step)


# --------------------------------------------------------------------------
# Poisson sampling by random access, for datasets larger than memory.


def uniform_subset(population, size, rng):
    """A uniformly random `size`-subset of range(population), sorted.

    Floyd's algorithm (J. Bentley, "A sample of brilliance", CACM 30(9),
    1987): for j = N - n, ..., N - 1 (N = population, n = size), draw t
    uniformly from {0, ..., j}, then add t to the sample, or j if t is in it
    already. Time and memory are O(n), whatever N.

    Uniformity, by induction on j. Before the step of j, let S be a uniform
    m-subset of {0, ..., j - 1}, each with probability 1 / C(j, m) (at the
    start, j = N - n and S is the empty 0-subset). After it, an
    (m + 1)-subset s of {0, ..., j}
      * containing j comes from S = s - {j}, when t is in S or t = j (m + 1
        of the j + 1 values);
      * not containing j comes from S = s - {i} and t = i, for each of the
        m + 1 elements i of s;
    either way with probability (m + 1) / ((j + 1) C(j, m)) = 1 / C(j + 1,
    m + 1): S is then a uniform (m + 1)-subset of {0, ..., j}.

    Args:
        population: N >= 0.
        size: n in [0, N].
        rng: a `np.random.Generator`.

    Returns:
        The n chosen indices, sorted, as an int64 array.
    """
    if not 0 <= size <= population:
        raise ValueError(f"Expected size={size!r} in [0, {population}].")
    ends = np.arange(population - size, population, dtype=np.int64)
    draws = rng.integers(0, ends, endpoint=True).tolist() if size else []
    chosen = set()
    for j, t in zip(ends.tolist(), draws):
        chosen.add(j if t in chosen else t)
    return np.array(sorted(chosen), dtype=np.int64)


def poisson_subset(num_examples, sampling_rate, rng):
    """Poisson sampling in O(n) memory: each example in with probability q.

    Draws the batch size n ~ Binomial(N, q), then a uniformly random n-subset
    of range(N) (`uniform_subset`). This is exactly independent Bernoulli(q)
    inclusion of each of the N examples: for any subset s of range(N),

        P(S = s) = P(n = |s|) P(S = s | n = |s|)
                 = C(N, |s|) q^|s| (1 - q)^(N - |s|) * 1 / C(N, |s|)
                 = q^|s| (1 - q)^(N - |s|),

    which is the probability that independent Bernoulli(q) draws include
    exactly the examples of s. The sample never costs an N-long mask.

    Args:
        num_examples: N.
        sampling_rate: q in [0, 1].
        rng: a `np.random.Generator`.

    Returns:
        The sampled indices, sorted, as an int64 array.
    """
    size = int(rng.binomial(num_examples, sampling_rate))
    return uniform_subset(num_examples, size, rng)


def _step_generator(key, nonce):
    """Step `nonce`'s generator: Philox keyed by (secret key, public nonce)."""
    return np.random.Generator(
        np.random.Philox(key=(int(key) << 64) | (int(nonce) & _UINT64))
    )


def stack_records(records):
    """The default `decode`: stacks records `(x, y)` or `(x, y, weight)`.

    Args:
        records: a sequence of per-example tuples of arrays (or nested
            structures of arrays, the same structure for each record).

    Returns:
        The same structure with each leaf stacked along a new first axis.
    """
    return tf.nest.map_structure(lambda *leaves: np.stack(leaves), *records)


def _read(source, indices):
    """The records of `source` at the sorted int64 `indices`.

    NumPy arrays (memmaps included) by fancy indexing; sources with
    `__getitems__` (ArrayRecord and `tfds.data_source`, PyTorch and Grain
    sources) in one batched read; any other by `source[i]` per index.
    """
    if isinstance(source, np.ndarray):
        return source[indices]
    keys = indices.tolist()
    if hasattr(source, "__getitems__"):
        return source.__getitems__(keys)
    return [source[i] for i in keys]


def _decode_batch(decode, records, count):
    """`decode(records)` as `(x, y, weight)`: NumPy arrays of `count` rows."""
    batch = decode(records)
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            "Expected decode to return (x, y) or (x, y, sample_weight), got"
            f" a {type(batch).__name__}."
        )
    batch = tuple(tf.nest.map_structure(np.asarray, item) for item in batch)
    if len(batch) == 2:
        batch += (np.ones(count, "float32"),)
    for array in tf.nest.flatten(batch):
        if array.ndim == 0 or len(array) != count:
            raise ValueError(
                f"Expected decode to return arrays of {count} rows (one per"
                f" record), got one of shape {array.shape}."
            )
    return batch


def poisson_batches_from_source(
        source, *, expected_batch_size, decode=None, physical_batch_size=None,
        steps_per_epoch=None, seed=None, max_overflow_probability=1e-10,
        pad_to_multiple_of=None, num_parallel_reads=tf.data.AUTOTUNE,
        first_step=0):
    """Poisson-sampled batches read by random access, for data on disk.

    The pipeline of `poisson_batches`, same batches in law, same padding,
    physical batches, accumulation and overflow check, for a dataset that
    need not fit in memory: each step draws the batch size n ~ Binomial(N, q)
    and a uniformly random n-subset of range(N) in O(n) time and memory
    (`poisson_subset`, which proves that this is exactly independent
    Bernoulli(q) inclusion of each example), then reads those n records from
    `source`. Memory stays O(M) whatever N; no N-long mask or array is made.

    Step t's sample is drawn by a NumPy Philox generator keyed by the secret
    key and step t's public nonce; the records are read in sorted index order
    by a `tf.numpy_function` (so the reads hold the GIL only as long as the
    source does). The accounting is that of any Poisson-sampled run: q = B / N
    with the global N = len(source) and the expected batch size B. Unlike the
    in-memory pipeline, which touches every example at every step, the reads
    show which records a step sampled to whoever can watch the storage (a
    shared file server, the page cache): the amplification by subsampling
    assumes that nobody can.

    Memory: the pipeline holds a few steps of M rows. The source may hold
    more: an ArrayRecord reader keeps its index in memory (~45 bytes a
    record for `group_size:1`) unless opened with
    `index_storage_option:offloaded`. On glibc, the reads of ArrayRecord's
    thread pool from tf.data's threads leave freed memory cached in
    per-thread arenas: 1,000,000 records of 256 bytes read 5,000 a step raise
    the resident memory by ~600 MB with the defaults and by ~150 MB with
    `MALLOC_ARENA_MAX=2` in the environment (or a tcmalloc / jemalloc
    preload).

    Args:
        source: an indexable dataset of N = len(source) records: `len` and
            `source[i]` for an int i. Sources with `__getitems__(list)`
            (`array_record.python.array_record_data_source`,
            `tfds.data_source(name, split=...)`, Grain and PyTorch
            map-style datasets) are read with one batched call per step,
            NumPy arrays and memmaps by fancy indexing, others one
            `source[i]` at a time.
        expected_batch_size: B; the sampling rate is q = B / N.
        decode: maps what one step reads (the list of records, or the array
            of rows of a NumPy source) to `(x, y)` or `(x, y, sample_weight)`
            of NumPy arrays (or nested structures of them) with one row per
            record, in the order read; e.g. for `tfds.data_source` records
            `lambda rs: (np.stack([r["image"] for r in rs]),
            np.array([r["label"] for r in rs]))`. Defaults to
            `stack_records` (records that are `(x, y)` tuples). Called once
            on record 0 when the pipeline is built, to learn the dtypes and
            shapes, which every step must then repeat.
        physical_batch_size, steps_per_epoch, seed, max_overflow_probability,
        pad_to_multiple_of, first_step: as for `poisson_batches`.
        num_parallel_reads: steps read concurrently (`tf.data.AUTOTUNE` by
            default); 1 for a source that is not safe to read from several
            threads.

    Returns:
        A `PoissonBatches`.

    Raises:
        ValueError: on arguments out of range (including `seed`), or if
            `decode` does not return one row per record.
    """
    _nonce_seed2(first_step)  # Checks it.
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise ValueError(
            f"Expected source={source!r} to have __len__ and __getitem__."
        )
    validation.check(
        num_parallel_reads == tf.data.AUTOTUNE
        or (validation.is_int(num_parallel_reads) and num_parallel_reads > 0),
        "num_parallel_reads", num_parallel_reads,
        "to be tf.data.AUTOTUNE or an int > 0",
    )
    num_examples = len(source)
    layout = _layout(num_examples, expected_batch_size, physical_batch_size,
                     steps_per_epoch, max_overflow_probability,
                     pad_to_multiple_of)
    if decode is None:
        decode = stack_records
    # One record, read outside every step, shows the dtypes and shapes.
    probe = _decode_batch(decode, _read(source, np.zeros(1, np.int64)), 1)
    specs = tf.nest.map_structure(
        lambda a: tf.TensorSpec([None, *a.shape[1:]], a.dtype), probe
    )
    flat_specs = tf.nest.flatten(specs)
    key = _resolve_key(seed, "poisson_batches_from_source")
    q = layout.sampling_rate

    def read_step(nonce):
        indices = poisson_subset(num_examples, q, _step_generator(key, nonce))
        if len(indices) == 0:
            return [np.zeros([0, *s.shape[1:]], s.dtype.as_numpy_dtype)
                    for s in flat_specs]
        batch = _decode_batch(decode, _read(source, indices), len(indices))
        flat = tf.nest.flatten(batch)
        for array, spec in zip(flat, flat_specs):
            if (array.dtype != spec.dtype.as_numpy_dtype
                    or array.shape[1:] != tuple(spec.shape[1:])):
                raise ValueError(
                    f"Expected decode to return {spec.dtype.name} rows of"
                    f" shape {tuple(spec.shape[1:])} as for record 0, got"
                    f" {array.dtype} rows of shape {array.shape[1:]}."
                )
        return flat

    def sample_step(nonce):
        flat = tf.numpy_function(read_step, [nonce],
                                 [s.dtype for s in flat_specs])
        for tensor, spec in zip(flat, flat_specs):
            tensor.set_shape(spec.shape)
        rows = tf.nest.pack_sequence_as(specs, flat)
        return _pad_and_split(rows, tf.shape(flat[0])[0], layout)

    return _pipeline(sample_step, layout, num_parallel_reads,
                     first_step=first_step)
