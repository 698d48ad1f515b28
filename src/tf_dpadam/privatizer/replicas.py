"""Replicas: the clipped sums and the noise of one step under `tf.distribute`.

Every replica clips its own examples; the sums are added over the replicas
(`sum_over_replicas`), the noise is drawn once (on the first replica:
`first_replica_share`) and the denominator is the global B. With gradient
accumulation the per-replica sums of a logical step are all-reduced once, in
cross-replica context (`sum_replica_copies`). Without `tf.distribute` every
function here is the identity (one replica).
"""

from typing import Callable, Optional, Sequence

import tensorflow as tf


def sum_over_replicas(values):
    """Sums a structure of tensors over `tf.distribute` replicas (if any)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return values
    return context.all_reduce(tf.distribute.ReduceOp.SUM, values)


def replica_share(summed: Sequence) -> list:
    """This replica's share of sums that every replica holds whole.

    Keras adds the gradients that the `tf.distribute` replicas hand to the
    optimizer, so each replica hands in 1/R of the whole clipped sum (and
    only the first one the noise: `first_replica_share`).
    """
    replicas = num_replicas()
    if replicas == 1:
        return summed
    return [g / replicas for g in summed]


def num_replicas() -> int:
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


def sum_replica_copies(strategy: tf.distribute.Strategy, variables: Sequence,
                       first_replica: Optional[Callable] = None) -> list:
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


def local_copies(variable) -> tuple:
    """This worker's per-replica copies of a Keras variable (cross-replica)."""
    return tf.distribute.get_strategy().experimental_local_results(
        variable.value
    )


def merge(fn: Callable) -> None:
    """Runs `fn(strategy)` once for all replicas, in cross-replica context.

    Called by every replica's step, outside control flow (`tf.distribute`
    refuses a `merge_call` inside a `tf.cond` of a replica's step).
    """
    tf.distribute.get_replica_context().merge_call(fn)
