"""Gradient accumulation: one logical DP step from k physical batches.

The sums of clipped per-example gradients and the example counts of the
micro-batches of the current logical step are optimizer state (created by
the DP optimizer's `build`, saved and restored with it, so a resumed run
continues the logical step). The private train step adds each micro-batch;
on every k-th one the accumulated sum is noised once, divided by B and
applied, and the accumulators are cleared.

Under `tf.distribute` (R replicas, one or several workers) each replica
keeps its own copy of the accumulators (`synchronization="on_read"`) and adds
its own micro-batches to it without communication. The logical step runs in
cross-replica context: all replicas meet in one `merge_call` per micro-batch
(outside any control flow, as Keras' own gradient aggregation does), and
inside it one `tf.cond` all-reduces the per-replica sums once, noises,
divides by the global B and applies, on every k-th micro-batch only. (The
reverse nesting, a `merge_call` inside a `tf.cond` of the replica's step,
is what `tf.distribute` refuses.)
"""

import keras
import tensorflow as tf
from keras import ops


def _replica_local_variable(optimizer, shape, dtype, name):
    """An optimizer variable with one copy per replica, summed when saved.

    `keras.Optimizer.add_variable` has no `synchronization` argument; this is
    the same variable with `synchronization="on_read"`: each replica assigns
    its own copy without communication, and reading it in cross-replica
    context (as saving does) gives the sum over the replicas. Without
    `tf.distribute` it is an ordinary variable.
    """
    with keras.name_scope(optimizer.name, caller=optimizer):
        variable = keras.Variable(
            initializer="zeros",
            shape=shape,
            dtype=dtype,
            trainable=False,
            aggregation="sum",
            synchronization="on_read",
            name=name,
        )
    optimizer._track_variable(variable)  # pylint: disable=protected-access
    return variable


def _local_copies(variable):
    """This worker's per-replica copies of a Keras variable (cross-replica)."""
    return tf.distribute.get_strategy().experimental_local_results(
        variable.value
    )


class GradientAccumulator:
    """The accumulators of a DP optimizer with k > 1 physical batches.

    Args:
        optimizer: the optimizer whose state the accumulators are.
        var_list: the trainable variables (one accumulator each).
        steps: k, physical batches per logical step.
    """

    def __init__(self, optimizer, var_list, steps):
        self.steps = steps
        # This replica's sums (the sum over all replicas when read in
        # cross-replica context; without replicas, just the sums). Float32
        # whatever the variables' dtype: the clipped sums are float32
        # (`privatizer.clip_and_sum`), and so is their accumulation.
        self.sums = [
            _replica_local_variable(
                optimizer, v.shape, "float32", f"dp_accumulator_{i}"
            )
            for i, v in enumerate(var_list)
        ]
        self.count = _replica_local_variable(
            optimizer, (), "float32", "dp_accumulated_count"
        )
        self.micro_step = optimizer.add_variable(
            shape=(),
            dtype="int64",
            aggregation="only_first_replica",
            name="dp_micro_step",
        )

    def add(self, summed, count, apply_step):
        """Adds a micro-batch; runs the logical step on every k-th one.

        Without `tf.distribute` replicas (see `add_on_replicas`).

        Args:
            summed: the micro-batch's clipped sums.
            count: its number of examples.
            apply_step: `f(sums, count)` that noises, scales and applies the
                logical step's accumulated sums.
        """
        for accumulator, g in zip(self.sums, summed):
            accumulator.assign(accumulator + ops.cast(g, "float32"))
        self.count.assign(self.count + count)
        self.micro_step.assign(self.micro_step + 1)

        def step():
            apply_step([a.value for a in self.sums], self.count.value)
            for accumulator in self.sums:
                accumulator.assign(ops.zeros_like(accumulator))
            self.count.assign(0.0)
            return ops.zeros(())

        ops.cond(
            self.micro_step % self.steps == 0, step, lambda: ops.zeros(())
        )

    def add_on_replicas(self, summed, count, logical_step):
        """Adds this replica's micro-batch; the logical step on every k-th.

        In a replica's train step under `tf.distribute`, outside control
        flow. Each replica adds its own clipped sums to its own accumulators
        (no communication); then every replica enters one `merge_call`, in
        which the k-th micro-batch runs `logical_step` under a `tf.cond` and
        clears the accumulators.

        Args:
            summed: this replica's clipped sums of the micro-batch.
            count: this replica's number of examples in it.
            logical_step: `f(strategy, sums, count)`, called in cross-replica
                context with the accumulator variables (one copy per replica;
                `privatizer.sum_replica_copies` all-reduces them), that
                noises, scales and applies the logical step.
        """
        for accumulator, g in zip(self.sums, summed):
            accumulator.assign(accumulator + ops.cast(g, "float32"))
        self.count.assign(self.count + count)

        def merge_fn(strategy):
            self.micro_step.assign(self.micro_step + 1)

            def step():
                logical_step(strategy, self.sums, self.count)
                for accumulator in self.sums + [self.count]:
                    for copy in _local_copies(accumulator):
                        copy.assign(tf.zeros_like(copy))
                return tf.zeros(())

            tf.cond(
                self.micro_step.value % self.steps == 0,
                step, lambda: tf.zeros(()),
            )

        tf.distribute.get_replica_context().merge_call(merge_fn)
