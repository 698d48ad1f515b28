"""What every Poisson-sampled pipeline shares, one logical step at a time.

`data.poisson_batches` (the dataset in memory), `data_source.
poisson_batches_from_source` (random access) and `sharding` (one shard per
worker) differ only in how a step draws its rows. The rest is here: the
capacity M and the layout of a step (`make_layout`: M, the physical batch b,
k = M / b, the overflow bound), the secret key that the sampling is keyed by
(`resolve_key`), the public per-step nonces (`step_nonces`), the padding and
splitting of a step's rows into k physical batches with the overflow check
(`pad_and_split`), the `tf.data` pipeline around a step's sampler
(`pipeline`), and which datasets are such pipelines (`poisson_plan_of`,
through `PoissonBatches.map_examples`). See `data` for what the accounting
assumes of them.
"""

import math
import typing
import weakref

import numpy as np
import tensorflow as tf

from tf_dpadam.common import compat
from tf_dpadam.data import pipeline as pipeline_lib
from tf_dpadam.common import seeds
from tf_dpadam.common import validation
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import plans

# The seeds of the public nonce stream: any pair but (0, 0), which TensorFlow
# replaces with nondeterministic seeds.
_NONCE_SEEDS = (0x5EED_5A3F, 0x0D9A_1516)


class PoissonBatches(typing.NamedTuple):
    """A Poisson-sampled pipeline and what the optimizer needs to know of it.

    Attributes:
        dataset: yields `(x, y, sample_weight)` physical batches of size b.
        sampling_rate: q = B / N (cyclic Poisson over b groups: the
            group's q = min(1, b B / N)).
        expected_batch_size: B, to be the optimizer's `batch_size`.
        capacity: M, the padded size of one logical batch.
        accumulation_steps: k = M / b, the optimizer's
            `gradient_accumulation_steps`.
        steps_per_epoch: logical steps per pass over the dataset.
        overflow_probability: P(Binomial(N, q) > M), for one step
            (cyclic: P(Binomial(ceil(N / b), q) > M), the largest group).
    """

    dataset: tf.data.Dataset
    sampling_rate: float
    expected_batch_size: int
    capacity: int
    accumulation_steps: int
    steps_per_epoch: int
    overflow_probability: float

    def map_examples(self, fn):
        """These batches with `fn(x, y) -> (x, y)` on each example.

        The way to preprocess or augment Poisson batches: `fn` sees one
        example at a time (padding rows too), the weights that mark the
        padding absent pass through (`pipeline.map_each_example`), and
        `fit` still accounts the batches at q = B / N. `fit` refuses a
        `.map` of your own on `dataset`: it sees whole padded batches.

        Raises:
            ValueError: if `fn` does not return `(x, y)`, or `dataset` is
                not a Poisson pipeline.
        """
        plan = poisson_plan_of(self.dataset)
        if plan is None:
            raise ValueError("Expected batches whose dataset is a Poisson"
                             " pipeline, got one of unknown sampling.")
        return self._replace(dataset=register_poisson(
            pipeline_lib.map_each_example(self.dataset, fn), plan))


def binomial_upper_tail(n, p, m):
    """P(Binomial(n, p) > m), summed exactly in log space."""
    if m >= n or p <= 0:
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
                     max_overflow_probability=1e-10, groups=1):
    """The smallest multiple M of b with P(Binomial(N, B/N) > M) <= bound.

    With `groups` = g > 1 (cyclic Poisson sampling, `group_sampling`), a
    step samples one group of at most ceil(N / g) examples at
    q = min(1, g B / N): M bounds Binomial(ceil(N / g), q) instead.

    Returns:
        `(capacity, overflow_probability)`.
    """
    population, q = group_sampling(num_examples, expected_batch_size, groups)
    capacity = physical_batch_size * math.ceil(
        expected_batch_size / physical_batch_size
    )
    while True:
        overflow = binomial_upper_tail(population, q, capacity)
        if overflow <= max_overflow_probability or capacity >= population:
            return min(capacity, population + physical_batch_size), overflow
        capacity += physical_batch_size


# The most cyclic Poisson groups `poisson_batches` takes.
MAX_GROUPS = 64


def group_sampling(num_examples, expected_batch_size, groups=1):
    """(n, q) of one step: the examples it may sample and their rate.

    Plain Poisson sampling (`groups` = 1): (N, B / N). Cyclic Poisson
    sampling over g groups: (ceil(N / g), min(1, g B / N)), the largest
    group and its rate.
    """
    return (-(-num_examples // groups),
            accounting_epsilon.cyclic_sampling_probability(
                expected_batch_size, num_examples, groups))


def step_nonces(first_step=0):
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
            seed2=tf.constant(nonce_seed2(first_step), tf.int64),
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


def nonce_seed2(first_step):
    """The second seed of the nonce stream of a run that starts at
    `first_step` (a distinct stream for every start)."""
    validation.check(validation.is_int(first_step) and first_step >= 0,
                     "first_step", first_step, "to be an integer >= 0")
    if first_step == 0:
        return _NONCE_SEEDS[1]
    return (_NONCE_SEEDS[1] + 0x9E37_79B9 * int(first_step)) % (1 << 63)


class Layout(typing.NamedTuple):
    """The static layout of one logical step, shared by the pipelines."""

    num_examples: int
    sampling_rate: float
    expected_batch_size: int
    physical_batch_size: int
    capacity: int
    accumulation_steps: int
    steps_per_epoch: int
    overflow_probability: float
    pad_to_multiple_of: typing.Optional[int]
    groups: int = 1


def check_groups(groups, num_examples, expected_batch_size):
    """Cyclic Poisson groups g: an int in [1, `MAX_GROUPS`] with
    g B <= N (so that a group's rate g B / N is at most 1)."""
    validation.check(
        validation.is_int(groups) and 1 <= groups <= MAX_GROUPS, "groups",
        groups, f"to be an int in [1, {MAX_GROUPS}]")
    validation.check(
        groups * expected_batch_size <= num_examples, "groups", groups,
        f"to satisfy groups * expected_batch_size <= the number of"
        f" examples {num_examples} (each group's sampling rate"
        f" groups * {expected_batch_size} / {num_examples} at most 1)")


def check_group_offset(group_offset):
    """The group of a cyclic Poisson stream's step 0: an int >= 0."""
    validation.check(
        validation.is_int(group_offset) and group_offset >= 0,
        "group_offset", group_offset, "to be an int >= 0")


def make_layout(num_examples, expected_batch_size, physical_batch_size,
            steps_per_epoch, max_overflow_probability, pad_to_multiple_of,
            groups=1):
    """Validates the arguments common to the pipelines; sizes M, b and k.

    With `groups` = g > 1 (cyclic Poisson sampling) M is sized for one
    group's Binomial(ceil(N / g), min(1, g B / N)) and `steps_per_epoch`
    (given or ceil(N / B)) is rounded up to a multiple of g, so that every
    pass, whose steps count from 0 again, starts at the same group phase
    and the groups keep cycling one per step across passes.
    """
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
    check_groups(groups, num_examples, expected_batch_size)
    if physical_batch_size is None:
        # A multiple of 8, so that the batch splits evenly over up to 8
        # tf.distribute replicas (a TPU's cores).
        capacity, overflow = poisson_capacity(
            num_examples, expected_batch_size, 8, max_overflow_probability,
            groups,
        )
        physical_batch_size = capacity
    else:
        validation.check_count("physical_batch_size", physical_batch_size)
        capacity, overflow = poisson_capacity(
            num_examples, expected_batch_size, physical_batch_size,
            max_overflow_probability, groups,
        )
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(num_examples / expected_batch_size)
    validation.check_count("steps_per_epoch", steps_per_epoch)
    if groups > 1:
        # Whole cycles: every pass starts at the same group.
        steps_per_epoch = groups * -(-int(steps_per_epoch) // groups)
    return Layout(
        num_examples=num_examples,
        sampling_rate=group_sampling(num_examples, expected_batch_size,
                                     groups)[1],
        expected_batch_size=expected_batch_size,
        physical_batch_size=physical_batch_size,
        capacity=capacity,
        accumulation_steps=capacity // physical_batch_size,
        steps_per_epoch=steps_per_epoch,
        overflow_probability=overflow,
        pad_to_multiple_of=pad_to_multiple_of,
        groups=int(groups),
    )


def resolve_key(seed, what):
    return seeds.resolve_seed(
        seed, what=what, drawn="every batch",
        effect="the privacy amplification by subsampling that the accounting"
        " assumes",
        consequence="the run does NOT have the reported (epsilon, delta)"
        " guarantee against them",
    )


def _utf8(text):
    """NumPy str (or objects) as UTF-8 bytes, as `tf.constant` encodes them
    (`tf.numpy_function` would encode str as ASCII and fail on the rest)."""
    if text.dtype.kind == "U":
        return np.char.encode(text, "utf-8")
    flat = [t.encode("utf-8") if isinstance(t, str) else t
            for t in text.ravel()]
    return np.array(flat, object).reshape(text.shape)


def gather_rows(arrays, indices):
    """The rows `indices` of a structure of NumPy arrays, taken by NumPy.

    The arrays stay where the caller keeps them and the pipeline holds no
    copy: each step's rows are taken by one `tf.numpy_function`. A copy in
    TensorFlow's memory (a constant held 2.2x the array, a variable 1.0x)
    also went through oneDNN's CPU allocator, which keeps the regions it
    frees: a process training one run after another on the same 1 GB array
    rose from 2.8 to 3.7 GB at its second run and stayed there
    (`benchmarks/run_memory.py`), and the SST-2 studies from 9 to 13 GB.
    Text (NumPy str or bytes) comes out as `tf.string`. Being a Python
    call, the pipeline runs in this process (as under `fit`,
    `MirroredStrategy`, `MultiWorkerMirroredStrategy` or on a TPU VM), not
    on a remote tf.data worker (the tf.data service, legacy TPU nodes).
    """
    flat = [np.asarray(a) for a in tf.nest.flatten(arrays)]
    specs = tf.nest.pack_sequence_as(arrays, [tf.TensorSpec(
        [None, *a.shape[1:]],
        tf.string if a.dtype.kind in "OSU" else tf.as_dtype(a.dtype))
        for a in flat])

    def take(rows):
        return [_utf8(a[rows]) if a.dtype.kind in "OU" else a[rows]
                for a in flat]

    return numpy_rows(take, indices, specs, stateful=False)


def numpy_rows(read, argument, specs, stateful=True):
    """`read(argument)` run by `tf.numpy_function`: a flat list of NumPy
    arrays, one per `tf.TensorSpec` of the structure `specs`, returned as
    that structure of tensors with the specs' shapes."""
    flat_specs = tf.nest.flatten(specs)
    flat = tf.numpy_function(read, [argument],
                             [s.dtype for s in flat_specs], stateful=stateful)
    for tensor, spec in zip(flat, flat_specs):
        tensor.set_shape(spec.shape)
    return tf.nest.pack_sequence_as(specs, flat)


def pad_and_split(rows, size, layout):
    """One logical step's sampled rows as k padded physical batches.

    Args:
        rows: `(x, y, sample_weight)`, nested structures of tensors whose
            first dimension is the number of sampled examples `size`.
        size: that number, a scalar int32 tensor.
        layout: the `Layout`.

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
        zeros = tf.zeros(tf.concat([[padding], tf.shape(rows)[1:]], 0),
                         rows.dtype)
        return tf.concat([rows, zeros], 0)

    bx, by, bw = tf.nest.map_structure(pad, rows)
    bw = tf.cast(bw, tf.float32)
    return tf.nest.map_structure(lambda t: tf.reshape(
        t, tf.concat([[k, rows_per_batch], tf.shape(t)[1:]], 0)), (bx, by, bw))


# The datasets (and `dataset_fn`s) of the Poisson pipelines, with their
# `plans.PoissonPlan`: how `fit` and `PrivacyBudget` know that a dataset's
# batches are the Poisson samples the accounting assumes.
_POISSON_PLANS = weakref.WeakKeyDictionary()

# tf.data transformations that keep each batch's rows as they are (a
# Poisson pipeline stays one through them). Anything else (`unbatch`,
# `shuffle`, a user's `map`: `fit` refuses those) is not known to be Poisson.
_ROW_PRESERVING = frozenset((
    "_PrefetchDataset", "_RepeatDataset", "_OptionsDataset",
    "_AssertCardinalityDataset",
))
# Transformations that keep or drop whole batches (`take`, `skip`): every
# batch kept is still a Poisson sample of its own step, but with k > 1
# physical batches a step they cut could join the rows of two steps, so
# they keep a pipeline Poisson only when each step is one batch.
_WHOLE_BATCHES = frozenset(("_TakeDataset", "_SkipDataset"))


def register_poisson(dataset, plan):
    """Records that `dataset` (or a `dataset_fn`) yields Poisson batches."""
    _POISSON_PLANS[dataset] = plan
    return dataset


def poisson_plan_of(data):
    """The `PoissonPlan` of a Poisson pipeline's dataset, else None.

    Follows row-preserving transformations (`_ROW_PRESERVING`, and
    `_WHOLE_BATCHES` when a step is one batch) back to the pipeline (or its
    `PoissonBatches.map_examples`); a `distribute_datasets_from_function(
    batches.dataset_fn)` dataset is known by its `dataset_fn` (tf.data's
    `_inputs()` and tf.distribute's `_dataset_fn`, through `compat`).
    """
    dataset_fn = compat.distributed_dataset_fn(data)
    if dataset_fn is not None:
        try:
            return _POISSON_PLANS.get(dataset_fn)
        except TypeError:
            return None
    cut = False  # Through a `take` or `skip`.
    while isinstance(data, tf.data.Dataset):
        plan = _POISSON_PLANS.get(data)
        if plan is not None:
            return None if cut and plan.accumulation_steps > 1 else plan
        inputs = compat.dataset_inputs(data)
        name = type(data).__name__
        if (name not in _ROW_PRESERVING | _WHOLE_BATCHES
                or len(inputs) != 1):
            return None
        cut = cut or name in _WHOLE_BATCHES
        data = inputs[0]
    return None


def layout_plan(layout, group_offset=0):
    """The `plans.PoissonPlan` of a step layout (cyclic groups: the group of
    step 0 is `group_offset`)."""
    return plans.PoissonPlan(layout.num_examples, layout.expected_batch_size,
                             layout.accumulation_steps, groups=layout.groups,
                             group_offset=group_offset % layout.groups)


def pipeline(sample_step, layout, num_parallel_calls=tf.data.AUTOTUNE,
              first_step=0, step_index=False, group_offset=0):
    """The `PoissonBatches` of `sample_step(nonce)`, one call per step.

    With `step_index`, `sample_step(j, nonce)` also gets the step's index j
    (int64) within the pass: 0, 1, ..., `layout.steps_per_epoch` - 1 in
    every pass (each iteration of the dataset counts from 0 again). The
    nonces are the same either way.
    """
    nonces = step_nonces(first_step).take(layout.steps_per_epoch)
    if step_index:
        nonces = nonces.enumerate()
    dataset = (
        nonces
        .map(sample_step, num_parallel_calls=num_parallel_calls)
        .unbatch()
        .prefetch(tf.data.AUTOTUNE)
    )
    register_poisson(dataset, layout_plan(layout, group_offset))
    return PoissonBatches(
        dataset=dataset,
        sampling_rate=layout.sampling_rate,
        expected_batch_size=layout.expected_batch_size,
        capacity=layout.capacity,
        accumulation_steps=layout.accumulation_steps,
        steps_per_epoch=layout.steps_per_epoch,
        overflow_probability=layout.overflow_probability,
    )
