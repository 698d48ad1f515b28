"""The clean gradient of each DP step: `make_private(diagnostics=True)` only.

NOT differentially private: the clipped but un-noised mean gradient of the
batch, kept so that `tf_dpadam.diagnostics.MomentDiagnostics` can compare
Adam's clean and private moments. The variables are held out of sight of
Keras' and TensorFlow's tracking by their owner: never model weights, never
saved.
"""

import keras
import tensorflow as tf

from tf_dpadam import privatizer


class CleanGradients:
    """One variable per trainable variable: `sum_i clip(g_i) / B`."""

    def __init__(self):
        self.variables = None

    def build(self, trainable_variables):
        """Creates the variables (anew after the model's weights change)."""
        existing = self.variables
        if existing is not None and [v.shape for v in existing] == [
            v.shape for v in trainable_variables
        ]:
            return
        if (tf.distribute.has_strategy()
                and not tf.distribute.in_cross_replica_context()):
            # In a replica's train step: too late to create mirrored state.
            raise ValueError(
                "make_private(diagnostics=True) under tf.distribute needs the"
                " model built before `compile` (e.g. start it with"
                " keras.Input), so that its clean-gradient variables are"
                " created in the strategy's scope."
            )
        self.variables = [
            keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=v.shape,
                dtype=v.dtype,
                trainable=False,
                # The value is the same on every replica (see `record`).
                aggregation="only_first_replica",
                name=f"dp_diagnostics_clean_gradient_{i}",
            )
            for i, v in enumerate(trainable_variables)
        ]

    def record(self, summed, denominator):
        """Stores the private gradient without its noise.

        Args:
            summed: the step's clipped sums over all examples (and all
                replicas, so the same on every replica).
            denominator: the B the private gradient is divided by.
        """
        for variable, g in zip(self.variables,
                               privatizer.scale(summed, denominator)):
            variable.assign(g)
