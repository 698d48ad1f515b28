"""Poisson-sampled batches read by random access, for data larger than memory.

`poisson_batches_from_source` samples the Poisson batches of
`data.poisson_batches` by random access into any indexable source (an
ArrayRecord or `tfds.data_source` source, a NumPy memmap, ...). Each step
draws the batch size n ~ Binomial(N, q) and then a uniformly random n-subset
of the indices (`poisson_subset`, exactly independent Bernoulli(q) inclusion
of every example), reads those n records and shares the padding, splitting
and overflow check of the in-memory pipeline (`sampling`): its memory is
O(M), whatever N. The secret key and the public nonces are the same too;
step t draws from NumPy's Philox keyed by (key, nonce_t).

Import it from `tf_dpadam.data`, with the other samplers.
"""

import typing

import numpy as np
import tensorflow as tf

from tf_dpadam.data import sampling
from tf_dpadam.common import validation

# Nonces are int64 tensors; NumPy's Philox takes a key in [0, 2**128).
_UINT64 = 2**64 - 1


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
    inclusion of each of the N examples: for any subset s of range(N)::

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


def step_generator(key, nonce):
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
    source: typing.Any,
    *,
    expected_batch_size: int,
    decode: typing.Callable[[typing.Any], tuple] | None = None,
    physical_batch_size: int | None = None,
    steps_per_epoch: int | None = None,
    seed: int | None = None,
    max_overflow_probability: float = 1e-10,
    pad_to_multiple_of: int | None = None,
    num_parallel_reads: int = tf.data.AUTOTUNE,
    first_step: int = 0,
    groups: int = 1,
    group_offset: int = 0,
) -> sampling.PoissonBatches:
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
        physical_batch_size, steps_per_epoch, seed: as for `poisson_batches`.
        max_overflow_probability, pad_to_multiple_of, first_step: as for
            `poisson_batches`.
        num_parallel_reads: steps read concurrently (`tf.data.AUTOTUNE` by
            default); 1 for a source that is not safe to read from several
            threads.
        groups, group_offset: cyclic Poisson sampling over g = `groups`
            groups, as for `poisson_batches` (banded correlated noise):
            record i is in group i mod g and step j of the stream samples
            group (group_offset + j) mod g, each of its records with
            probability q = min(1, g B / N): a `poisson_subset` of the
            group's ceil((N - group) / g) records, read as i = group +
            g * (its index in the group). 1 (default): the batches of
            plain Poisson sampling, unchanged.

    Returns:
        A `PoissonBatches`.

    Raises:
        ValueError: on arguments out of range (including `seed`), or if
            `decode` does not return one row per record.
    """
    sampling.nonce_seed2(first_step)  # Checks it.
    sampling.check_group_offset(group_offset)
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
    layout = sampling.make_layout(
        num_examples, expected_batch_size, physical_batch_size,
        steps_per_epoch, max_overflow_probability, pad_to_multiple_of,
        groups)
    if decode is None:
        decode = stack_records
    # One record, read outside every step, shows the dtypes and shapes.
    probe = _decode_batch(decode, _read(source, np.zeros(1, np.int64)), 1)
    specs = tf.nest.map_structure(
        lambda a: tf.TensorSpec([None, *a.shape[1:]], a.dtype), probe
    )
    flat_specs = tf.nest.flatten(specs)
    key = sampling.resolve_key(seed, "poisson_batches_from_source")
    q = layout.sampling_rate

    offset = int(group_offset) % groups

    def sample(step_and_nonce):
        """The sorted indices step j = `step_and_nonce[0]` (within its
        pass) samples, from its generator (of `step_and_nonce[1]`)."""
        step, nonce = (int(v) for v in step_and_nonce)
        rng = step_generator(key, nonce)
        if groups == 1:
            return poisson_subset(num_examples, q, rng)
        group = (step + offset) % groups
        members = (num_examples - group + groups - 1) // groups
        return group + groups * poisson_subset(members, q, rng)

    def read_step(step_and_nonce):
        indices = sample(step_and_nonce)
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

    def sample_step(step, nonce):
        rows = sampling.numpy_rows(read_step, tf.stack([step, nonce]), specs)
        size = tf.shape(tf.nest.flatten(rows)[0])[0]
        return sampling.pad_and_split(rows, size, layout)

    return sampling.pipeline(sample_step, layout, num_parallel_reads,
                             first_step=first_step, step_index=True,
                             group_offset=offset)
