"""Gradient accumulation: one logical DP step from k physical batches.

The sums of clipped per-example gradients and the example counts of the
micro-batches of the current logical step are optimizer state (created by
the DP optimizer's `build`, saved and restored with it, so a resumed run
continues the logical step). The private train step adds each micro-batch;
on every k-th one the accumulated sum is noised once, divided by B and
applied, and the accumulators are cleared.
"""

from keras import ops


class GradientAccumulator:
    """The accumulators of a DP optimizer with k > 1 physical batches.

    Args:
        optimizer: the optimizer whose state the accumulators are.
        var_list: the trainable variables (one accumulator each).
        steps: k, physical batches per logical step.
    """

    def __init__(self, optimizer, var_list, steps):
        self.steps = steps
        # Sums over the replicas (so the same on every replica).
        self.sums = [
            optimizer.add_variable(
                shape=v.shape,
                dtype=v.dtype,
                aggregation="only_first_replica",
                name=f"dp_accumulator_{i}",
            )
            for i, v in enumerate(var_list)
        ]
        self.count = optimizer.add_variable(
            shape=(),
            dtype="float32",
            aggregation="only_first_replica",
            name="dp_accumulated_count",
        )
        self.micro_step = optimizer.add_variable(
            shape=(),
            dtype="int64",
            aggregation="only_first_replica",
            name="dp_micro_step",
        )

    def add(self, summed, count, apply_step):
        """Adds a micro-batch; runs the logical step on every k-th one.

        Args:
            summed: the micro-batch's clipped sums (over all replicas).
            count: its number of examples (over all replicas).
            apply_step: `f(sums, count)` that noises, scales and applies the
                logical step's accumulated sums.
        """
        for accumulator, g in zip(self.sums, summed):
            accumulator.assign(accumulator + g)
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
