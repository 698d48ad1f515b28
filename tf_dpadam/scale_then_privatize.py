"""Scale-then-privatize: Adam whose preconditioner is applied before the noise.

Ganesh, McMahan & Thakurta, "On Design Principles for Private Adaptive
Optimizers" (arXiv 2507.01129, 2025; JAX Privacy's
`experimental.optimizers.scale_then_privatize`). Instead of removing the
noise's bias from Adam's second moment (`DPAdamCorrected`), they move the
preconditioning in front of the privatization: each example's gradient is
scaled coordinate-wise by the previous step's private second-moment
estimate, clipped in that geometry, summed and noised, and the scaling is
undone on the noised sum before Adam's update.
"""

from typing import Mapping, Optional, Union

import keras
from keras import ops

from tf_dpadam import preclip
from tf_dpadam import validation
from tf_dpadam.optimizer_base import constructor_arguments
from tf_dpadam.optimizers import DP_ARGS_DOC
from tf_dpadam.optimizers import DPAdam

__all__ = ["DPAdamScaleThenPrivatize", "preconditioner"]


def preconditioner(velocity, iterations, beta_2, scale_epsilon):
    """s_t = 1 / (sqrt(v_hat_{t-1}) + eps_s), float32.

    Args:
        velocity: Adam's second moment v after t - 1 = `iterations` steps
            (not bias-corrected; 0 before the first step).
        iterations: t - 1, the number of steps applied so far.
        beta_2: Adam's beta_2.
        scale_epsilon: eps_s > 0.

    Returns:
        s, of `velocity`'s shape: 1 / eps_s before the first step, then
        with v_hat_{t-1} = v / (1 - beta_2^(t-1)).
    """
    velocity = ops.cast(velocity, "float32")
    done = ops.cast(iterations, "float32")
    correction = 1.0 - ops.power(ops.cast(beta_2, "float32"), done)
    v_hat = ops.where(done > 0, velocity / ops.maximum(correction, 1e-30),
                      ops.zeros_like(velocity))
    return 1.0 / (ops.sqrt(v_hat) + scale_epsilon)


@keras.saving.register_keras_serializable(package="tf_dpadam")
class DPAdamScaleThenPrivatize(DPAdam):
    __doc__ = r"""DP-Adam with scale-then-privatize (Ganesh, McMahan & Thakurta 2025).

    At step t, with s_t = 1 / (sqrt(v_hat_{t-1}) + eps_s) from Adam's
    second moment after the previous step (`preconditioner`; 1 / eps_s
    before the first step):

        g_tilde_scaled = (sum_i clip(s_t * g_i, C) + N(0, sigma^2 C^2 I)) / B
        g_tilde = g_tilde_scaled / s_t
        then Keras Adam on g_tilde (m, v, bias corrections, `epsilon`).

    The private train step (`tf_dpadam.make_private`) clips s_t * g_i, so C
    is a norm in the scaled geometry, where a coordinate's gradient is
    measured against its own typical size: coordinates with a small second
    moment get less noise (sigma C / (B s_t) in gradient units), where DP-Adam
    and DP-AdamBC add the same noise everywhere. Adam's update is scale-free,
    so the size of s_t does not matter, only its shape; `scale_epsilon`
    bounds how far a coordinate whose v_hat is tiny can be magnified.

    Privacy: unchanged, and accounted as DP-SGD with the same sigma, q and
    steps. Each example adds one vector of norm at most C (in the scaled
    space) to the sum, and s_t depends only on v_{t-1}, a function of the
    previous steps' private outputs: a fixed, public linear map for step t
    given the past, so the release of step t is the Gaussian mechanism of
    sensitivity C, and dividing by s_t afterwards is post-processing.

    The step needs each example's full gradient (the vectorized path;
    `make_private(clipping="ghost")` raises). The clipped sum that the
    diagnostics' `clean_gradients` show is in the scaled space.
""" + DP_ARGS_DOC + r"""        learning_rate, beta_1, beta_2, epsilon, amsgrad: Keras Adam's
            (`epsilon` outside the square root of Adam's update).
        scale_epsilon: eps_s > 0 in s_t = 1 / (sqrt(v_hat) + eps_s).
        **kwargs: other Keras optimizer arguments, as for `DPAdam`.
    """

    def __init__(
        self,
        *,
        l2_norm_clip: Union[float, Mapping[str, float]],
        noise_multiplier: float,
        batch_size: Optional[int] = None,
        target_unclipped_quantile: Optional[float] = None,
        clip_learning_rate: float = 0.2,
        clipped_count_stddev: Optional[float] = None,
        per_layer_clipping: bool = False,
        learning_rate=0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        scale_epsilon: float = 1e-8,
        name: str = "DPAdamScaleThenPrivatize",
        **kwargs,
    ):
        arguments = constructor_arguments(locals())
        arguments.pop("scale_epsilon")
        validation.check_positive("scale_epsilon", scale_epsilon)
        if amsgrad:
            raise ValueError(
                "Expected amsgrad=False for DPAdamScaleThenPrivatize.")
        super().__init__(**arguments)
        self.scale_epsilon = float(scale_epsilon)

    def scales(self, variables) -> list:
        """s_t of each of `variables` (float32; the optimizer is built)."""
        return [
            preconditioner(self.moments(v)[1], self.iterations, self.beta_2,
                           self.scale_epsilon)
            for v in variables
        ]

    def per_example_transform(self, variables):
        return preclip.PerExampleTransform(scales=self.scales(variables))

    def update_step(self, gradient, variable, learning_rate):
        # v is still v_{t-1} here: undo the scaling the step clipped in.
        scale = preconditioner(self.moments(variable)[1], self.iterations,
                               self.beta_2, self.scale_epsilon)
        gradient = ops.cast(gradient, "float32") / scale
        super().update_step(ops.cast(gradient, variable.dtype), variable,
                            learning_rate)

    def get_config(self):
        config = super().get_config()
        config["scale_epsilon"] = self.scale_epsilon
        return config
