"""The DP part that `DPSGD`, `DPAdam` and `DPAdamCorrected` share.

`DPOptimizerMixin` goes before a Keras optimizer class: its constructor is
the one constructor of the three optimizers (the DP arguments, checked,
become an `arguments.DPConfig`), it applies only gradients that the private
train step privatized (`apply_private`, with the Phi the privatizer
returned), creates the accumulators of gradient accumulation, and adds the DP
arguments to `get_config`. The Keras hooks it needs to override are in
`compat.OptimizerOverrides`.
"""

from typing import Mapping

import keras
import tensorflow as tf
from keras import ops

from tf_dpadam.optimizers import accumulation
from tf_dpadam.optimizers import arguments as arguments_lib
from tf_dpadam.privatizer import adaptive_clipping
from tf_dpadam.privatizer import clip_groups
from tf_dpadam.common import compat

_UNSUPPORTED_KWARGS = {
    "loss_scale_factor": "loss scaling is not supported by the DP train step",
}


class DPOptimizerMixin(compat.OptimizerOverrides):
    """The DP part of every tf_dpadam optimizer (composed with a Keras one).

    Its `__init__` is the one constructor of every DP optimizer: it takes
    the DP arguments (`tf_dpadam.optimizers.arguments`) out of the keyword
    arguments and checks them, then the update rule's (`keras_arguments`,
    which a subclass overrides), then runs the Keras optimizer's
    constructor. A subclass's `__init__` declares only its update rule's
    arguments and `**kwargs`; the signature that `inspect.signature` and
    the docs show has the DP arguments too (`__init_subclass__`).
    `from_config` goes through it, so a saved config is checked the same
    way.

    Attributes:
        dp_config: the `arguments.DPConfig` (C, sigma, B) that the private train
            step uses for this optimizer.
    """

    # Keras optimizer arguments that this class refuses on top of
    # `_UNSUPPORTED_KWARGS` (name -> why).
    _refused_kwargs = {}

    def __init_subclass__(cls, **kwargs):
        """Gives a DP optimizer class the full signature: the DP arguments
        (`arguments.ARGUMENTS`), then its update rule's own (those of its
        `__init__`, else of the Keras optimizer's)."""
        super().__init_subclass__(**kwargs)
        init = next(vars(c)["__init__"] for c in cls.__mro__
                    if "__init__" in vars(c) and c is not DPOptimizerMixin)
        full = arguments_lib.signature(init)
        if "__init__" in vars(cls):
            cls.__init__.__signature__ = full
        # `inspect.signature(cls)` (Sphinx, IDEs), also without an __init__.
        cls.__signature__ = full.replace(
            parameters=list(full.parameters.values())[1:])

    def __init__(self, **kwargs):
        dp = arguments_lib.pop_arguments(kwargs, type(self).__name__)
        l2_norm_clip = dp["l2_norm_clip"]
        per_layer_clipping = dp["per_layer_clipping"]
        target_unclipped_quantile = dp["target_unclipped_quantile"]
        clip_learning_rate = dp["clip_learning_rate"]
        clipped_count_stddev = dp["clipped_count_stddev"]
        refused = {**_UNSUPPORTED_KWARGS, **self._refused_kwargs}
        for name, why in refused.items():
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"Expected {name}=None for {type(self).__name__}: {why}."
                )
        # The private train step accumulates clipped gradients itself
        # (Keras' own accumulation would add noise to every micro-batch).
        steps = dp["gradient_accumulation_steps"]
        clip_groups.check_spec(l2_norm_clip, per_layer_clipping)
        adaptive = None
        if target_unclipped_quantile is not None:
            adaptive = adaptive_clipping.AdaptiveClipping(
                target_unclipped_quantile=target_unclipped_quantile,
                clip_learning_rate=clip_learning_rate,
                clipped_count_stddev=clipped_count_stddev)
        elif (clipped_count_stddev is not None or clip_learning_rate
              != adaptive_clipping.DEFAULT_CLIP_LEARNING_RATE):
            raise ValueError(
                f"Expected clipped_count_stddev={clipped_count_stddev!r} and"
                f" clip_learning_rate={clip_learning_rate!r} to keep their"
                " defaults without target_unclipped_quantile (adaptive"
                " clipping is off).")
        mapping = isinstance(l2_norm_clip, Mapping)
        dp_config = arguments_lib.DPConfig(
            l2_norm_clip=(clip_groups.total_clip_norm(l2_norm_clip.values())
                          if mapping else l2_norm_clip),
            noise_multiplier=dp["noise_multiplier"],
            batch_size=dp["batch_size"],
            accumulation_steps=1 if steps is None else steps,
            noise_strategy=dp["noise_strategy"],
        )
        if adaptive is not None and dp_config.noise_bands > 1:
            raise ValueError(
                f"Expected noise_strategy with 1 band with adaptive clipping"
                f" (target_unclipped_quantile={target_unclipped_quantile!r}),"
                f" got {dp_config.noise_bands} bands: correlated noise mixes"
                " the noise of steps whose C differs, which its sensitivity"
                " does not allow for.")
        super().__init__(**self.keras_arguments(**kwargs))
        self.dp_config = dp_config
        self._private_apply_depth = 0
        # A mapping is kept as (key, C_l) pairs: Keras would track a dict.
        self._clip_items = (tuple((k, float(c)) for k, c in
                                  l2_norm_clip.items()) if mapping else None)
        self.per_layer_clipping = per_layer_clipping
        self.adaptive_clipping = adaptive
        # Set by `build`, which knows the variables and so the groups.
        self._adaptive_clips = None
        self.clip_group_names = [clip_groups.FLAT_GROUP]
        self._initial_clips = [dp_config.l2_norm_clip]
        self._group_of = None
        if adaptive is not None and (mapping or not per_layer_clipping):
            # Checks sigma_b now where G is known (else in `build`).
            self.gradient_noise_multiplier_for(
                len(l2_norm_clip) if mapping else 1)

    def keras_arguments(self, **kwargs):
        """Checks the update rule's arguments; returns Keras' (default: all
        of them unchecked)."""
        return kwargs

    def get_config(self):
        config = super().get_config()
        k = self.dp_accumulation_steps
        adaptive = self.adaptive_clipping
        config.update({
            "l2_norm_clip": self.clip_spec,
            "per_layer_clipping": self.per_layer_clipping,
            "target_unclipped_quantile":
                adaptive and adaptive.target_unclipped_quantile,
            "clip_learning_rate": (
                adaptive.clip_learning_rate if adaptive
                else adaptive_clipping.DEFAULT_CLIP_LEARNING_RATE),
            "clipped_count_stddev": adaptive and adaptive.clipped_count_stddev,
            "noise_multiplier": self.noise_multiplier,
            "batch_size": self.batch_size,
            "gradient_accumulation_steps": None if k == 1 else k,
            "noise_strategy": (None if self.noise_strategy is None
                               else self.noise_strategy.to_config()),
        })
        return config

    @property
    def clip_spec(self):
        """`l2_norm_clip` as given: a number, or a dict `{key: C_l}`."""
        if self._clip_items is None:
            return self.dp_config.l2_norm_clip
        return dict(self._clip_items)

    @property
    def l2_norm_clip(self):
        """The current C: the constructor's, or, with adaptive clipping and
        once built, the clip norm that the next step uses (a float; a dict
        `{group: C_l}` with per-layer clipping). Inside a traced function,
        the constructor's value: the step itself reads `clip_norms()`."""
        if self._adaptive_clips is not None and tf.executing_eagerly():
            values = [float(c)
                      for c in ops.convert_to_numpy(self.clip_norms())]
        elif self._group_of is not None:  # built: the groups are known
            values = list(self._initial_clips)
        else:
            return self.clip_spec
        if not clip_groups.is_grouped(self.clip_spec,
                                      self.per_layer_clipping):
            return values[0]
        return dict(zip(self.clip_group_names, values))

    @property
    def noise_multiplier(self):
        return self.dp_config.noise_multiplier

    @property
    def batch_size(self):
        return self.dp_config.batch_size

    @property
    def noise_strategy(self):
        """None (independent noise) or the `BandedToeplitz` of correlated
        noise."""
        return self.dp_config.noise_strategy

    @property
    def noise_bands(self):
        """b, the noise strategy's bands (1: independent noise)."""
        return self.dp_config.noise_bands

    @property
    def dp_accumulation_steps(self):
        """k: physical batches per logical step (1 without accumulation)."""
        return self.dp_config.accumulation_steps

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # Phi of the current step, as the privatizer returned it with the
        # private gradient (from the very sigma, C and B of its noise),
        # written before the update. (Saved with the optimizer in the slot
        # that older versions used for B; every step writes it first.)
        self._step_phi = self.add_variable(
            shape=(),
            initializer="zeros",
            dtype="float32",
            aggregation="only_first_replica",
            name="dp_step_phi",
        )
        self.clip_group_names, self._initial_clips, self._group_of = (
            clip_groups.assign([v.path for v in var_list], self.clip_spec,
                               self.per_layer_clipping))
        self._adaptive_clips = None
        if self.adaptive_clipping is not None:
            self.gradient_noise_multiplier_for(len(self._initial_clips))
            # C of each group, moved after every step and saved with the
            # optimizer (a resumed run goes on from the C it reached).
            self._adaptive_clips = self.add_variable(
                shape=(len(self._initial_clips),),
                initializer=keras.initializers.Constant(self._initial_clips),
                dtype="float32",
                aggregation="only_first_replica",
                name="dp_adaptive_clip_norms",
            )
        # The accumulators of a logical step of k > 1 physical batches.
        self.dp_accumulator = None
        if self.dp_accumulation_steps > 1:
            self.dp_accumulator = accumulation.GradientAccumulator(
                self, var_list, self.dp_accumulation_steps,
                num_counts=(len(self._initial_clips)
                            if self.adaptive_clipping is not None else 0),
            )

    def apply_private(self, grads, trainable_variables, phi,
                      unclipped_fraction=None):
        """Applies privatized gradients; called by the private train step only.

        Args:
            grads: the privatized gradients (noised sum divided by B), in
                float32 whatever the variables' dtype; each is cast to its
                variable's dtype here, after the noise (post-processing).
            trainable_variables: the variables they belong to.
            phi: Phi = (sigma C / B)^2, the variance that the noise adds to
                each coordinate of `grads`, as the privatizer returned it
                (`privatizer.noise.divide`).
            unclipped_fraction: with adaptive clipping, the privatized
                fraction b_tilde of unclipped examples per group (`[G]`);
                C moves after the update.
        """
        if not self.built:
            self.build(trainable_variables)
        grads = [ops.cast(g, v.dtype)
                 for g, v in zip(grads, trainable_variables)]
        self._step_phi.assign(ops.cast(phi, "float32"))
        self.before_private_apply()
        self._private_apply_depth += 1
        try:
            result = self.apply(grads, trainable_variables)
        finally:
            self._private_apply_depth -= 1
        if self._adaptive_clips is not None:
            settings = self.adaptive_clipping
            self._adaptive_clips.assign(adaptive_clipping.next_clip_norms(
                self._adaptive_clips.value, unclipped_fraction,
                settings.target_unclipped_quantile,
                settings.clip_learning_rate))
        return result

    def before_private_apply(self):
        """Runs before the update, after B is known (default: nothing)."""

    def per_example_transform(self, variables):
        """None, or the `preclip.PerExampleTransform` the step applies to
        each example's gradient before clipping, for this step's weights
        `variables` (default: None, the gradient itself)."""
        del variables
        return None

    def clip_norms(self):
        """C of each clipping group this step, a float32 `[G]` tensor (the
        moving clip norms with adaptive clipping)."""
        if self._adaptive_clips is not None:
            return self._adaptive_clips.value
        return ops.convert_to_tensor(self._initial_clips, "float32")

    def variable_groups(self):
        """The clipping group of each trainable variable (a list of ints),
        or None for flat clipping (one global norm)."""
        if not clip_groups.is_grouped(self.clip_spec,
                                      self.per_layer_clipping):
            return None
        return list(self._group_of)

    def total_clip_norm(self):
        """sqrt(sum_l C_l^2), the sensitivity of the clipped sum: a float,
        or a tensor with adaptive clipping."""
        if self._adaptive_clips is None:
            return self.dp_config.l2_norm_clip
        return ops.sqrt(ops.sum(ops.square(self._adaptive_clips.value)))

    def gradient_noise_multiplier_for(self, num_groups):
        """z_grad for G groups: `noise_multiplier`, raised with adaptive
        clipping so that gradient and counts together have it
        (`adaptive_clipping.gradient_noise_multiplier`)."""
        if self.adaptive_clipping is None:
            return self.noise_multiplier
        return adaptive_clipping.gradient_noise_multiplier(
            self.noise_multiplier, self.clipped_count_stddev(), num_groups)

    @property
    def gradient_noise_multiplier(self):
        """z_grad, the gradient noise's std over the total C (built)."""
        return self.gradient_noise_multiplier_for(len(self._initial_clips))

    def clipped_count_stddev(self):
        """sigma_b, the std of the noise of each count of unclipped
        examples (adaptive clipping only)."""
        return self.adaptive_clipping.count_stddev(self.batch_size)

    def gradient_noise_stddev(self):
        """The std of the noise on the clipped sum: z_grad times the total C
        (a float, or a tensor with adaptive clipping)."""
        if self._adaptive_clips is None:
            return self.dp_config.noise_stddev
        return self.gradient_noise_multiplier * self.total_clip_norm()

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
        """Phi = (sigma C / B)^2 of the current (or last) step, as the
        privatizer returned it with the private gradient (a tensor; 0
        before the first step)."""
        return tf.convert_to_tensor(self._step_phi.value)


# The mixin's own constructor: the DP arguments, and the rest for Keras
# (what `inspect.signature` shows of a subclass without an `__init__`).
DPOptimizerMixin.__init__.__signature__ = arguments_lib.signature(
    DPOptimizerMixin.__init__)


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
