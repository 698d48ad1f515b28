"""The DP part that `DPSGD`, `DPAdam` and `DPAdamCorrected` share.

`DPOptimizerMixin` goes before a Keras optimizer class: its constructor is
the one constructor of the three optimizers (the DP arguments, checked,
become a `dp_math.DPConfig`), it applies only gradients that the private
train step privatized (`apply_private`), keeps the step's denominator B for
Phi, creates the accumulators of gradient accumulation, and adds the DP
arguments to `get_config`. The Keras hooks it needs to override are in
`compat.OptimizerOverrides`.
"""

from keras import ops

from tf_dpadam import accumulation
from tf_dpadam import compat
from tf_dpadam import dp_math

_UNSUPPORTED_KWARGS = {
    "loss_scale_factor": "loss scaling is not supported by the DP train step",
}


class DPOptimizerMixin(compat.OptimizerOverrides):
    """The DP part of every tf_dpadam optimizer (composed with a Keras one).

    Its `__init__` is the one constructor of `DPSGD`, `DPAdam` and
    `DPAdamCorrected`: it checks the DP arguments, then the update rule's
    (`keras_arguments`, which a subclass overrides), then runs the Keras
    optimizer's constructor. `from_config` goes through it, so a saved
    config is checked the same way.

    Attributes:
        dp_config: the `dp_math.DPConfig` (C, sigma, B) that the private train
            step uses for this optimizer.
    """

    # Keras optimizer arguments that this class refuses on top of
    # `_UNSUPPORTED_KWARGS` (name -> why).
    _refused_kwargs = {}

    def __init__(self, *, l2_norm_clip, noise_multiplier, batch_size,
                 **kwargs):
        refused = {**_UNSUPPORTED_KWARGS, **self._refused_kwargs}
        for name, why in refused.items():
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"Expected {name}=None for {type(self).__name__}: {why}."
                )
        # The private train step accumulates clipped gradients itself
        # (Keras' own accumulation would add noise to every micro-batch).
        steps = kwargs.pop("gradient_accumulation_steps", None)
        dp_config = dp_math.DPConfig(
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            batch_size=batch_size,
            accumulation_steps=1 if steps is None else steps,
        )
        super().__init__(**self.keras_arguments(**kwargs))
        self.dp_config = dp_config
        self._private_apply_depth = 0

    def keras_arguments(self, **kwargs):
        """Checks the update rule's arguments; returns Keras' (default: all
        of them unchecked)."""
        return kwargs

    def get_config(self):
        config = super().get_config()
        k = self.dp_accumulation_steps
        config.update({
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "batch_size": self.batch_size,
            "gradient_accumulation_steps": None if k == 1 else k,
        })
        return config

    @property
    def l2_norm_clip(self):
        return self.dp_config.l2_norm_clip

    @property
    def noise_multiplier(self):
        return self.dp_config.noise_multiplier

    @property
    def batch_size(self):
        return self.dp_config.batch_size

    @property
    def dp_accumulation_steps(self):
        """k: physical batches per logical step (1 without accumulation)."""
        return self.dp_config.accumulation_steps

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # B of the current step, written by the private train step before it
        # applies the gradient, so that Phi is computed from the very
        # denominator the privatizer divided by.
        self._step_denominator = self.add_variable(
            shape=(),
            initializer="ones",
            dtype="float32",
            aggregation="only_first_replica",
            name="dp_step_denominator",
        )
        # The accumulators of a logical step of k > 1 physical batches.
        self.dp_accumulator = None
        if self.dp_accumulation_steps > 1:
            self.dp_accumulator = accumulation.GradientAccumulator(
                self, var_list, self.dp_accumulation_steps
            )

    def apply_private(self, grads, trainable_variables, denominator):
        """Applies privatized gradients; called by the private train step only.

        Args:
            grads: the privatized gradients (noised sum divided by B), in
                float32 whatever the variables' dtype; each is cast to its
                variable's dtype here, after the noise (post-processing).
            trainable_variables: the variables they belong to.
            denominator: the B that the gradients were divided by.
        """
        if not self.built:
            self.build(trainable_variables)
        grads = [ops.cast(g, v.dtype)
                 for g, v in zip(grads, trainable_variables)]
        self._step_denominator.assign(ops.cast(denominator, "float32"))
        self._private_apply_depth += 1
        try:
            return self.apply(grads, trainable_variables)
        finally:
            self._private_apply_depth -= 1

    def apply(self, grads, trainable_variables=None):
        if not self._private_apply_depth:
            raise ValueError(
                f"{type(self).__name__} was asked to apply gradients that were"
                " not privatized. Wrap the model with"
                " `tf_dpadam.make_private(model)` before `compile`, so that"
                " each example's gradient is clipped and noise is added;"
                " otherwise training would not be differentially private."
            )
        return super().apply(grads, trainable_variables)

    def noise_phi(self):
        """Phi = (sigma C / B)^2 for the current step's B (a tensor)."""
        return dp_math.noise_variance_phi(
            self.l2_norm_clip, self.noise_multiplier, self._step_denominator
        )


def constructor_arguments(arguments: dict) -> dict:
    """A DP optimizer constructor's arguments, from its `locals()` on entry,
    as the keywords of `DPOptimizerMixin.__init__` (without `self`, with
    `**kwargs` merged in)."""
    named = {name: value for name, value in arguments.items()
             if name not in ("self", "__class__", "kwargs")}
    return {**named, **arguments["kwargs"]}


def is_dp_optimizer(optimizer) -> bool:
    """Whether `optimizer` is a tf_dpadam DP optimizer."""
    return isinstance(optimizer, DPOptimizerMixin)
