"""Keras 3 optimizers that carry the DP hyperparameters.

A Keras optimizer only sees the averaged gradient, so the privatization
(per-example clipping, noise, division by B) happens in the train step of a
model wrapped by `tf_dpadam.make_private`. The optimizers below hold the DP
hyperparameters that this train step reads (`l2_norm_clip`,
`noise_multiplier`, `batch_size`), so `model.compile(optimizer=...)` is the
one place a user sets them, and they refuse gradients that did not come from
that train step.

The three optimizers share the privatizer and differ only in the update rule:
`DPSGD` is Keras SGD, `DPAdam` is Keras Adam (the paper's "DP-Adam-Biased",
TF-Privacy's `DPKerasAdamOptimizer`), and `DPAdamCorrected` is Adam with the
bias-corrected denominator of Tang & Lecuyer.
"""

from typing import Optional, Union

import keras
from keras import ops

from tf_dpadam.privatizer import dp_math
from tf_dpadam.common import validation
from tf_dpadam.optimizers.arguments import DP_ARGS_DOC
from tf_dpadam.optimizers.base import constructor_arguments
from tf_dpadam.optimizers.base import DPOptimizerMixin

__all__ = ["DPAdam", "DPAdamCorrected", "DPSGD"]

# A learning rate: a number or a `keras.optimizers.schedules` schedule.
LearningRate = Union[float, keras.optimizers.schedules.LearningRateSchedule]

# Keras' gradient clipping runs on the averaged, already noised gradient. For
# DPSGD and DPAdam that is post-processing of a private gradient (allowed);
# DPAdamCorrected subtracts Phi from the second moment, and Phi is the noise's
# variance in the *unclipped* noised gradient, which these arguments change.
_PHI_CHANGING_WHY = (
    "Keras clips the averaged gradient after the noise was added, which"
    " changes the noise's variance, while the correction subtracts"
    " Phi = (noise_multiplier * l2_norm_clip / B)^2, the variance in the"
    " unclipped noised gradient; it would subtract the wrong Phi (with"
    " clipnorm=0.01, mean(v_hat)/Phi was measured at 0.0000, every coordinate"
    " on the gamma' floor). Each example's gradient is already clipped by"
    " `l2_norm_clip`; to clip harder, lower l2_norm_clip"
)
_PHI_CHANGING_KWARGS = {
    name: _PHI_CHANGING_WHY
    for name in ("clipnorm", "global_clipnorm", "clipvalue")
}


_POST_CLIP_DOC = """
    Keras' `clipnorm`, `global_clipnorm` and `clipvalue` clip the averaged
    gradient after the noise was added: post-processing of the private
    gradient, so allowed here (privacy unchanged). They are no substitute for
    `l2_norm_clip`, which bounds each example's gradient.
"""


@keras.saving.register_keras_serializable(package="tf_dpadam")
class DPSGD(DPOptimizerMixin, keras.optimizers.SGD):
    __doc__ = (
        "DP-SGD: Keras SGD (with optional momentum) on the privatized gradient."
        "\n" + DP_ARGS_DOC + "        Other arguments: as `keras.optimizers.SGD`.\n"
        + _POST_CLIP_DOC
    )

    def __init__(
        self,
        *,
        learning_rate: LearningRate = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "DPSGD",
        **kwargs,
    ):
        super().__init__(**constructor_arguments(locals()))

    def keras_arguments(self, *, learning_rate, momentum, **kwargs):
        validation.check_non_negative("momentum", momentum)
        validation.check_learning_rate(learning_rate)
        return dict(learning_rate=learning_rate, momentum=momentum, **kwargs)


class _DPAdamBase(DPOptimizerMixin, keras.optimizers.Adam):
    """Shared constructor checks of the two DP Adams."""

    def variable_index(self, variable):
        """The index of `variable` in the per-variable optimizer state."""
        return self._get_variable_index(variable)

    def moments(self, variable):
        """The first and second moment variables (m, v) of `variable`."""
        index = self.variable_index(variable)
        return self._momentums[index], self._velocities[index]

    @staticmethod
    def check_adam_arguments(learning_rate, beta_1, beta_2, epsilon):
        validation.check_learning_rate(learning_rate)
        validation.check_beta("beta_1", beta_1)
        validation.check_beta("beta_2", beta_2)
        if epsilon is not None:
            validation.check_positive("epsilon", epsilon)


@keras.saving.register_keras_serializable(package="tf_dpadam")
class DPAdam(_DPAdamBase):
    __doc__ = (
        "DP-Adam \"biased\": Keras Adam on the privatized gradient.\n\n"
        "    This is the paper's DP-Adam-Biased baseline and TF-Privacy's\n"
        "    `DPKerasAdamOptimizer`: the noise's Phi = (sigma C / B)^2 stays in\n"
        "    the second moment. `epsilon` is Keras Adam's (outside the root).\n"
        + DP_ARGS_DOC
        + "        Other arguments: as `keras.optimizers.Adam`.\n"
        + _POST_CLIP_DOC
    )

    def __init__(
        self,
        *,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "DPAdam",
        **kwargs,
    ):
        super().__init__(**constructor_arguments(locals()))

    def keras_arguments(self, *, learning_rate, beta_1, beta_2, epsilon,
                        **kwargs):
        self.check_adam_arguments(learning_rate, beta_1, beta_2, epsilon)
        if epsilon is None:
            raise ValueError("Expected epsilon=None to be a finite number > 0.")
        return dict(learning_rate=learning_rate, beta_1=beta_1,
                    beta_2=beta_2, epsilon=epsilon, **kwargs)


@keras.saving.register_keras_serializable(package="tf_dpadam")
class DPAdamCorrected(_DPAdamBase):
    __doc__ = r"""DP-AdamBC: Adam with the DP bias removed from the second moment.

    Tang & Lecuyer, "DP-Adam: Correcting DP Bias in Adam's Second Moment
    Estimation" (Algorithm 1). On the privatized gradient g_tilde:

        m <- beta_1 m + (1 - beta_1) g_tilde
        v <- beta_2 v + (1 - beta_2) g_tilde^2
        m_hat = m / (1 - beta_1^t),    v_hat = v / (1 - beta_2^t)
        theta <- theta - lr * m_hat / sqrt(max(v_hat - Phi, gamma'))

    where Phi = (noise_multiplier * l2_norm_clip / B)^2 is the variance the
    noise adds to each coordinate of g_tilde, computed from the very C, sigma
    and B that the private train step used.

    Warning: `epsilon` is gamma', a floor *inside* the square root, not
    Keras Adam's epsilon outside it. gamma' only makes sense relative to Phi:
    the paper uses gamma' of about 0.04 * Phi (CIFAR-10: Phi = 2.4e-7,
    gamma' = 1e-8; SNLI: Phi = 2.44e-8, gamma' = 1e-9), and a gamma' far
    below Phi diverges (measured on Fashion-MNIST at Phi = 6.8e-6:
    gamma' = 1e-9 gave 18% accuracy, 1e-7 gave 80.6%). The default
    `epsilon=None` uses 0.04 * Phi of each step (at least 1e-14, so that it
    is positive without noise). Gradients must be privatized per example by
    `tf_dpadam.make_private`; Phi assumes B is the public (expected) batch
    size.
""" + DP_ARGS_DOC + r"""        learning_rate: eta.
        beta_1, beta_2: Adam's decay rates, in [0, 1).
        epsilon: gamma' (inside the square root), or None for 0.04 * Phi.
        phi: None for the true (sigma C / B)^2, or a float >= 0 that replaces
            it (the paper's Phi' ablation).
        **kwargs: other Keras optimizer arguments (`weight_decay`,
            `use_ema`, ...). `clipnorm`, `global_clipnorm` and `clipvalue`
            raise a `ValueError`: Keras applies them after the noise, which
            changes the noise's variance, so Phi would be wrong (they are
            allowed on DPSGD and DPAdam, where they are post-processing).
    """  # A docstring built from parts: `__doc__`, or Python drops it.

    _refused_kwargs = _PHI_CHANGING_KWARGS

    def __init__(
        self,
        *,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: Optional[float] = None,
        phi: Optional[float] = None,
        name: str = "DPAdamCorrected",
        **kwargs,
    ):
        super().__init__(**constructor_arguments(locals()))
        self.epsilon = None if epsilon is None else float(epsilon)
        self.phi = None if phi is None else float(phi)

    def keras_arguments(self, *, learning_rate, beta_1, beta_2, epsilon, phi,
                        **kwargs):
        self.check_adam_arguments(learning_rate, beta_1, beta_2, epsilon)
        if phi is not None:
            validation.check_non_negative("phi", phi)
        if kwargs.pop("amsgrad", False):
            raise ValueError("Expected amsgrad=False for DPAdamCorrected.")
        # epsilon=1.0 is a placeholder; gamma' is set after Keras' __init__.
        return dict(learning_rate=learning_rate, beta_1=beta_1,
                    beta_2=beta_2, epsilon=1.0, **kwargs)

    def check_gradient_clipping(self):
        # Also refuses clipping switched on after construction.
        for name in _PHI_CHANGING_KWARGS:
            if getattr(self, name, None) is not None:
                raise ValueError(
                    f"Expected {name}=None for {type(self).__name__}:"
                    f" {_PHI_CHANGING_WHY}."
                )

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # Under adaptive clipping C moves, and the noise's share of v_hat
        # is the bias-corrected moving average of the past steps' Phi_tau,
        # with v's own weights: (1 - beta_2) sum_tau beta_2^(t - tau)
        # Phi_tau / (1 - beta_2^t). This variable holds its numerator.
        # So does Phi_t under correlated noise (its variance grows over the
        # first steps, `correlated_noise.correlate`).
        self._phi_average = None
        if self.phi is None and (self.adaptive_clipping is not None
                                 or self.noise_bands > 1):
            self._phi_average = self.add_variable(
                shape=(), initializer="zeros", dtype="float32",
                aggregation="only_first_replica", name="dp_phi_average")

    def before_private_apply(self):
        if self._phi_average is not None:
            self._phi_average.assign(
                self.beta_2 * self._phi_average.value
                + (1 - self.beta_2) * self.noise_phi())

    def step_phi(self):
        """The Phi subtracted this step: `phi` if given; else
        (sigma C / B)^2, or under adaptive clipping or correlated noise
        the bias-corrected moving average of the past steps' Phi_tau
        (sigma C_tau / B)^2 times the variance of step tau's correlated
        noise)."""
        if self.phi is not None:
            return ops.convert_to_tensor(self.phi, "float32")
        if self._phi_average is not None:
            t = ops.cast(self.iterations + 1, "float32")
            return self._phi_average.value / (
                1 - ops.power(ops.cast(self.beta_2, "float32"), t))
        return self.noise_phi()

    def step_gamma(self, phi):
        """gamma' of this step: `epsilon` if given, else 0.04 * Phi."""
        if self.epsilon is not None:
            return ops.convert_to_tensor(self.epsilon, "float32")
        return dp_math.default_gamma(phi)

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        t = ops.cast(self.iterations + 1, dtype)
        m, v = self.moments(variable)
        self.assign(m, self.beta_1 * m + (1 - self.beta_1) * gradient)
        self.assign(v, self.beta_2 * v + (1 - self.beta_2) * ops.square(gradient))
        m_hat = m / (1 - ops.power(ops.cast(self.beta_1, dtype), t))
        v_hat = v / (1 - ops.power(ops.cast(self.beta_2, dtype), t))
        phi = self.step_phi()
        gamma = self.step_gamma(phi)
        direction = dp_math.corrected_adam_direction(
            m_hat, v_hat, ops.cast(phi, dtype), ops.cast(gamma, dtype)
        )
        self.assign_sub(variable, lr * direction)

    def get_config(self):
        config = super().get_config()
        config.pop("amsgrad", None)
        config["epsilon"] = self.epsilon
        config["phi"] = self.phi
        return config
