"""Poisson sampling over several workers: each samples its own shard.

Under `tf.distribute` with W workers (input pipelines) the N examples are
split into W disjoint shards, worker w owning the indices i with
i mod W = w. At every logical step each worker includes each example of its
shard independently with the same probability q = B / N (a Bernoulli mask
keyed by its own key and the public step nonce of `tf_dpadam.data`), pads
its sample to a static capacity and splits it into k physical batches for
each of its L local replicas. Since the shards are disjoint and cover all N
examples, the union of the workers' samples includes every example
independently with probability q: exactly the Poisson(q) sample over all N
that the accounting assumes, with expected size B = q N. So the accounting
(`tf_dpadam.PrivacyBudget(num_examples=N)`, `tf_dpadam.accounting`) uses the
global N and the expected global B, which is also the optimizer's
`batch_size`; the optimizer counts each logical step once, whatever W.

The sampling does not go through Keras' automatic sharding: give
`ShardedPoissonBatches.dataset_fn` to `strategy.distribute_datasets_from_function`,
which calls it once per worker with that worker's `tf.distribute.InputContext`
and hands each local replica its own physical batches (in turn: the k L
batches of a worker's step are consumed by its L replicas in k
micro-batches). A dataset given to `fit` directly would be re-sharded (each
worker would keep every W-th physical batch of a sample over all N) and the
steps would no longer be Poisson(q).

The keys: with `seed=None` every worker process draws its own 63 secret
bits (`step.seeds.secret_seed`); with an explicit seed each worker's key is a
Philox hash of (seed, w), so the workers' masks are independent either way.
"""

import math
import typing

import numpy as np
import tensorflow as tf

from tf_dpadam.data import sampling
from tf_dpadam.common import validation
from tf_dpadam.accounting import plans


class ShardedPoissonBatches(typing.NamedTuple):
    """Per-worker Poisson pipelines and what the optimizer needs to know.

    Attributes:
        dataset_fn: `f(tf.distribute.InputContext) -> tf.data.Dataset`, for
            `strategy.distribute_datasets_from_function`: the worker's
            physical batches `(x, y, sample_weight)` of b rows each, k L per
            logical step, without end (pass `micro_steps_per_epoch` to
            `fit`).
        num_examples: N, over all workers (for the accounting).
        sampling_rate: q = B / N, on every shard.
        expected_batch_size: B = q N, over all workers: the optimizer's
            `batch_size` and the accounting's.
        physical_batch_size: b, per replica and micro-batch.
        accumulation_steps: k, the optimizer's `gradient_accumulation_steps`.
        steps_per_epoch: logical steps per pass, ceil(N / B) by default.
        micro_steps_per_epoch: k times that: `fit`'s `steps_per_epoch`.
        num_workers: W, the number of shards.
        replicas_per_worker: L.
        capacity: M = k L b, the padded size of one worker's sample.
        overflow_probability: P(some worker's sample exceeds M) per step
            (union bound over the workers).
    """

    dataset_fn: typing.Callable
    num_examples: int
    sampling_rate: float
    expected_batch_size: int
    physical_batch_size: int
    accumulation_steps: int
    steps_per_epoch: int
    micro_steps_per_epoch: int
    num_workers: int
    replicas_per_worker: int
    capacity: int
    overflow_probability: float


def workers_and_local_replicas(
    strategy: tf.distribute.Strategy,
) -> tuple[int, int]:
    """(W, L) of `strategy`: its workers (input pipelines), replicas of each.

    (1, 1) for the default strategy.
    """
    try:
        local = len(strategy.extended.worker_devices)
    except RuntimeError:  # The default strategy has no worker devices.
        return 1, 1
    return strategy.num_replicas_in_sync // local, local


def shard_indices(num_examples, num_workers, worker):
    """The indices of worker `worker`'s shard: i with i mod W = worker."""
    return np.arange(worker, num_examples, num_workers)


def worker_key(key, worker):
    """Worker `worker`'s sampling key: a Philox hash of (key, worker)."""
    return tf.random.stateless_uniform(
        [], seed=tf.constant([key, worker], tf.int64), minval=None,
        maxval=None, dtype=tf.int64, alg="philox",
    )


def sharded_poisson_batches(
    data: tuple | list,
    *,
    expected_batch_size: int,
    physical_batch_size: int,
    num_workers: int = 1,
    replicas_per_worker: int = 1,
    steps_per_epoch: int | None = None,
    seed: int | None = None,
    max_overflow_probability: float = 1e-10,
    first_step: int = 0,
) -> ShardedPoissonBatches:
    """Poisson(q) batches over all N examples, each worker sampling its shard.

    Args:
        data: `(x, y)` or `(x, y, sample_weight)` with NumPy arrays (or
            nested structures of them) sharing the first dimension N, the
            whole dataset (every worker keeps only its shard).
        expected_batch_size: B over all workers; q = B / N.
        physical_batch_size: b, rows per replica and micro-batch.
        num_workers, replicas_per_worker: W and L of the strategy
            (`workers_and_local_replicas(strategy)`).
        steps_per_epoch: logical steps per pass; defaults to ceil(N / B).
        seed: None (default) for secret keys drawn by every worker, or an
            int, the reproducible (and NOT private) key of `poisson_batches`.
        max_overflow_probability: bound on P(a worker's sample > M) per
            step, for each worker.
        first_step: the steps already taken, on a resume in new processes
            (as for `poisson_batches`: no replay of earlier batches).

    Returns:
        A `ShardedPoissonBatches`.

    Raises:
        ValueError: on arguments out of range.
    """
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError("Expected data=(x, y) or (x, y, sample_weight).")
    data = tuple(tf.nest.map_structure(np.asarray, item) for item in data)
    num_examples = len(tf.nest.flatten(data[0])[0])
    for array in tf.nest.flatten(data):
        if len(array) != num_examples:
            raise ValueError(
                "Expected every array in data to have the same first"
                f" dimension, got {len(array)} and {num_examples}."
            )
    validation.check_count("num_workers", num_workers)
    validation.check_count("replicas_per_worker", replicas_per_worker)
    validation.check_count("physical_batch_size", physical_batch_size)
    if num_workers > num_examples:
        raise ValueError(
            f"Expected num_workers={num_workers} <= the number of examples"
            f" {num_examples}."
        )
    # Validates B, b, the bound and the steps as poisson_batches does.
    layout = sampling.make_layout(
        num_examples, expected_batch_size, physical_batch_size,
        steps_per_epoch, max_overflow_probability, None,
    )
    q = layout.sampling_rate
    # Every worker pads to the capacity of the largest shard, so that all
    # take the same k micro-batches per logical step.
    largest = math.ceil(num_examples / num_workers)
    per_step = physical_batch_size * replicas_per_worker
    capacity, overflow = sampling.poisson_capacity(
        largest, q * largest, per_step, max_overflow_probability
    )
    k = capacity // per_step
    # The k L physical batches of one worker's step, in the order its
    # replicas take them.
    worker_layout = layout._replace(
        capacity=capacity, accumulation_steps=k * replicas_per_worker,
        overflow_probability=overflow,
    )
    key = sampling.resolve_key(
        seed, "sharded_poisson_batches"
    )
    x, y = data[0], data[1]
    weight = data[2] if len(data) == 3 else np.ones(num_examples, "float32")

    # The whole step (all workers): N, B and the k of each worker's
    # replicas; the accounting is that of the union. Registered for the
    # `dataset_fn` (a strategy's distributed dataset) and for each dataset
    # it makes (the default strategy hands that dataset to `fit`).
    plan = plans.PoissonPlan(num_examples, expected_batch_size, k)

    def dataset_fn(input_context=None):
        input_context = input_context or tf.distribute.InputContext()
        workers = input_context.num_input_pipelines
        worker = input_context.input_pipeline_id
        local = input_context.num_replicas_in_sync // workers
        if (workers, local) != (num_workers, replicas_per_worker):
            raise ValueError(
                f"sharded_poisson_batches was made for {num_workers} workers"
                f" of {replicas_per_worker} replicas each, but the strategy"
                f" has {workers} of {local}."
            )
        shard = shard_indices(num_examples, num_workers, worker)
        shard_tensor = tf.constant(shard)
        own_key = worker_key(key, worker)

        def sample_step(nonce):
            seed_pair = tf.stack([own_key, nonce])
            included = tf.random.stateless_uniform(
                [len(shard)], seed=seed_pair
            ) < q
            indices = tf.cast(tf.where(included)[:, 0], tf.int32)
            rows = sampling.gather_rows(
                (x, y, weight), tf.gather(shard_tensor, indices)
            )
            return sampling.pad_and_split(
                rows, tf.size(indices), worker_layout
            )

        return sampling.register_poisson(
            sampling.step_nonces(first_step)
            .map(sample_step, num_parallel_calls=tf.data.AUTOTUNE)
            .unbatch()
            .prefetch(tf.data.AUTOTUNE),
            plan,
        )

    sampling.register_poisson(dataset_fn, plan)
    return ShardedPoissonBatches(
        dataset_fn=dataset_fn,
        num_examples=num_examples,
        sampling_rate=q,
        expected_batch_size=expected_batch_size,
        physical_batch_size=physical_batch_size,
        accumulation_steps=k,
        steps_per_epoch=layout.steps_per_epoch,
        micro_steps_per_epoch=k * layout.steps_per_epoch,
        num_workers=num_workers,
        replicas_per_worker=replicas_per_worker,
        capacity=capacity,
        overflow_probability=min(1.0, num_workers * overflow),
    )
