"""Gradient accumulation's state: the sums of a logical step of k batches.

The sums of clipped per-example gradients and the example counts of the
micro-batches of the current logical step are optimizer state (created by
the DP optimizer's `build`, saved and restored with it, so a resumed run
continues the logical step). `GradientAccumulator` only holds and updates
that state; when the logical step is noised and applied is decided by the
private train step (`tf_dpadam.training.update`).

Under `tf.distribute` (R replicas, one or several workers) each replica
keeps its own copy of the accumulators (`synchronization="on_read"`) and adds
its own micro-batches to it without communication; reading them in
cross-replica context gives their sum.
"""

from typing import Sequence

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.common import compat
from tf_dpadam.privatizer import replicas


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
    compat.track_optimizer_variable(optimizer, variable)
    return variable


class GradientAccumulator:
    """The accumulators of a DP optimizer with k > 1 physical batches.

    Args:
        optimizer: the optimizer whose state the accumulators are.
        var_list: the trainable variables (one accumulator each).
        steps: k, physical batches per logical step.

    Attributes:
        sums: one float32 variable per trainable variable (this replica's
            sums; without replicas, just the sums).
        count: the number of examples added (float32).
        micro_step: the micro-batches so far (int64, one for all replicas).
        unclipped: with adaptive clipping (`num_counts` G > 0), the shifted
            counts of unclipped examples, `[G]` float32; else None.
    """

    def __init__(self, optimizer, var_list: Sequence, steps: int,
                 num_counts: int = 0):
        self.steps = steps
        # Float32 whatever the variables' dtype: the clipped sums are float32
        # (`step.clipping.clip_and_sum`), and so is their accumulation.
        self.sums = [
            _replica_local_variable(
                optimizer, v.shape, "float32", f"dp_accumulator_{i}"
            )
            for i, v in enumerate(var_list)
        ]
        self.count = _replica_local_variable(
            optimizer, (), "float32", "dp_accumulated_count"
        )
        self.unclipped = None
        if num_counts:
            self.unclipped = _replica_local_variable(
                optimizer, (num_counts,), "float32", "dp_accumulated_unclipped"
            )
        self.micro_step = optimizer.add_variable(
            shape=(),
            dtype="int64",
            aggregation="only_first_replica",
            name="dp_micro_step",
        )

    def add(self, summed: Sequence, count, unclipped=None) -> None:
        """Adds a micro-batch's clipped sums and count (this replica's), and
        with adaptive clipping its shifted counts of unclipped examples."""
        for accumulator, g in zip(self.sums, summed):
            accumulator.assign(accumulator + ops.cast(g, "float32"))
        self.count.assign(self.count + count)
        if self.unclipped is not None:
            self.unclipped.assign(self.unclipped + unclipped)

    def advance(self) -> tf.Tensor:
        """Counts a micro-batch; True if it ends a logical step (a tensor)."""
        self.micro_step.assign(self.micro_step + 1)
        return self.micro_step.value % self.steps == 0

    def totals(self) -> tuple:
        """`(sums, count, unclipped)` as tensors (one replica); `unclipped`
        (the adaptive clipping counts) is None without adaptive clipping."""
        unclipped = None if self.unclipped is None else self.unclipped.value
        return [a.value for a in self.sums], self.count.value, unclipped

    def state(self) -> list:
        """The variables that a logical step sums over replicas: the sums,
        the count and (adaptive clipping) the unclipped counts."""
        extra = [] if self.unclipped is None else [self.unclipped]
        return self.sums + [self.count] + extra

    def clear(self) -> None:
        """Zeros the sums and the count (one replica)."""
        for accumulator in self.sums:
            accumulator.assign(ops.zeros_like(accumulator))
        self.count.assign(0.0)
        if self.unclipped is not None:
            self.unclipped.assign(ops.zeros_like(self.unclipped))

    def clear_all_copies(self) -> None:
        """Zeros every replica's copies (cross-replica context)."""
        for accumulator in self.state():
            for copy in replicas.local_copies(accumulator):
                copy.assign(tf.zeros_like(copy))
