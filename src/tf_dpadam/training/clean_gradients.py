"""The clean gradient of each DP step: `make_private(diagnostics=True)` only.

NOT differentially private: the clipped but un-noised mean gradient of the
batch, kept so that `tf_dpadam.tools.diagnostics.MomentDiagnostics` can compare
Adam's clean and private moments, in float32 whatever the model's dtype
policy; and the number of examples whose gradient or loss was NaN or
infinite (they contribute nothing to the private gradient, and only this
count shows that they were there). The variables are held out of sight of
Keras' and TensorFlow's tracking by their owner: never model weights, never
saved.
"""

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.privatizer import dp_math
from tf_dpadam.training import hooks
from tf_dpadam.privatizer import noise
from tf_dpadam.privatizer import replicas


class CleanGradients(hooks.StepHooks):
    """One float32 variable per trainable variable: `sum_i clip(g_i) / B`.

    The step hooks of `make_private(diagnostics=True)`: `build` creates the
    variables, `after_clipping` counts the non-finite examples and
    `before_noise` stores the clean gradient.

    Attributes:
        variables: those variables (None before `build`).
        non_finite_count: a float32 scalar variable, the number of examples
            of all DP steps so far whose gradient or loss was NaN or
            infinite (None before `build`).
    """

    observes_clean_sum = True

    def __init__(self):
        self.variables = None
        self.non_finite_count = None

    def build(self, trainable_variables):
        """Creates the variables (anew after the model's weights change)."""
        if self.non_finite_count is None:
            self._check_scope()
            self.non_finite_count = keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=(),
                dtype="float32",
                trainable=False,
                # Summed over the replicas by `record_non_finite`.
                aggregation="only_first_replica",
                name="dp_diagnostics_non_finite_examples",
            )
        existing = self.variables
        if existing is not None and [v.shape for v in existing] == [
            v.shape for v in trainable_variables
        ]:
            return
        self._check_scope()
        self.variables = [
            keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=v.shape,
                dtype="float32",
                trainable=False,
                # The value is the same on every replica (see `record`).
                aggregation="only_first_replica",
                name=f"dp_diagnostics_clean_gradient_{i}",
            )
            for i, v in enumerate(trainable_variables)
        ]

    @staticmethod
    def _check_scope():
        if (tf.distribute.has_strategy()
                and not tf.distribute.in_cross_replica_context()):
            # In a replica's train step: too late to create mirrored state.
            raise ValueError(
                "make_private(diagnostics=True) under tf.distribute needs the"
                " model built before `compile` (e.g. start it with"
                " keras.Input), so that its clean-gradient variables are"
                " created in the strategy's scope."
            )

    def after_clipping(self, norms, losses, present):
        self.record_non_finite(norms, losses, present)

    def before_noise(self, summed, denominator):
        self.record(summed, denominator)

    def record_non_finite(self, norms, losses, present):
        """Adds the step's examples whose gradient or loss is not finite.

        Args:
            norms, losses: the step's per-example gradient norms and losses
                (this replica's).
            present: 1.0 for the examples of the batch, 0.0 for absent ones.
        """
        finite = dp_math.finite_examples(ops.cast(norms, "float32"),
                                         ops.cast(losses, "float32"))
        count = ops.sum(ops.cast(present, "float32")
                        * (1.0 - ops.cast(finite, "float32")))
        count = replicas.sum_over_replicas(count)
        self.non_finite_count.assign(self.non_finite_count + count)

    def record(self, summed, denominator):
        """Stores the private gradient without its noise.

        Args:
            summed: the step's clipped sums over all examples (and all
                replicas, so the same on every replica).
            denominator: the B the private gradient is divided by.
        """
        for variable, g in zip(self.variables,
                               noise.scale(summed, denominator)):
            variable.assign(g)
