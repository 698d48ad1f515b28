"""DiSK: DP-Adam on a Kalman-filtered private gradient.

Zhang et al., "DiSK: Differentially Private Optimizer with Simplified
Kalman Filter for Noise Reduction" (arXiv 2410.03883, 2024; Opacus'
research folder). The private gradient is the observation of a simplified
Kalman filter whose state is the true gradient: each example's gradient is
taken at the weights x_t and at x_t + gamma (x_t - x_{t-1}) (one extra
forward and backward pass), combined *before* clipping so that the
combination carries the curvature term the filter's prediction needs, and
the noised result is averaged into the filter's state with gain kappa.
"""

import keras
from keras import ops

from tf_dpadam.privatizer import preclip
from tf_dpadam.common import validation
from tf_dpadam.optimizers.arguments import DP_ARGS_DOC
from tf_dpadam.optimizers.base import constructor_arguments
from tf_dpadam.optimizers.paper import DPAdam

__all__ = ["DPAdamDiSK", "shift_weight"]


def shift_weight(kappa: float, gamma: float) -> float:
    """w = (1 - kappa) / (kappa gamma), the weight of the gradient at the
    shifted weights in each example's combined gradient."""
    return (1.0 - kappa) / (kappa * gamma)


@keras.saving.register_keras_serializable(package="tf_dpadam")
class DPAdamDiSK(DPAdam):
    __doc__ = r"""DP-Adam on the DiSK-filtered private gradient (Zhang et al. 2024).

    With w = (1 - kappa) / (kappa gamma) (`shift_weight`), each example's
    combined gradient is

        d_i = w g_i(x_t + gamma (x_t - x_{t-1})) + (1 - w) g_i(x_t),

    both with the same dropout masks; the step clips, sums, noises and
    divides it by B as any gradient (g_tilde), and the optimizer filters:

        g_t = (1 - kappa) g_{t-1} + kappa g_tilde     (g_1 = g_tilde)
        then Keras Adam on g_t.

    At the first step x_{t-1} = x_t, so d_i = g_i(x_t). To first order,
    E[g_tilde] is grad f(x_t) + ((1 - kappa) / kappa) H (x_t - x_{t-1}), which
    is what makes g_t track grad f(x_t) while averaging the noise of past
    steps (its variance falls to kappa / (2 - kappa) of g_tilde's).

    Privacy: unchanged, and accounted as DP-SGD with the same sigma, q and
    steps. The two gradients of an example are combined before clipping, so
    it adds one vector of norm at most C to the sum, and the shift
    gamma (x_t - x_{t-1}) depends only on past private outputs; the filter
    is post-processing. The price: one more forward and backward pass per
    example, and two optimizer states (x_{t-1} and g_{t-1}).

    Ghost clipping takes it with a second batched forward and backward pass
    at the shifted weights (the same dropout masks as the first), whose
    records join the first pass's so that each example's norm is that of
    the combination; rules that read a weight after the forward pass
    (WSConv2D's, LoRA's, the fallback's) read it where each record's pass
    read it. A user's rule that does not set `Rule.shifted_pass` sends the
    step to the vectorized path under `clipping="auto"`
    (`clipping="ghost"` raises).
""" + DP_ARGS_DOC + r"""        learning_rate, beta_1, beta_2, epsilon, amsgrad: Keras Adam's.
        kappa: the filter's gain, in (0, 1] (1: no filtering, DP-Adam).
        gamma: the shift's step, > 0 (the paper's defaults: kappa = 0.7,
            gamma = 0.5).
        **kwargs: other Keras optimizer arguments, as for `DPAdam`.
    """

    def __init__(
        self,
        *,
        learning_rate=0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        kappa: float = 0.7,
        gamma: float = 0.5,
        name: str = "DPAdamDiSK",
        **kwargs,
    ):
        arguments = constructor_arguments(locals())
        arguments.pop("kappa")
        arguments.pop("gamma")
        validation.check_positive("gamma", gamma)
        validation.check(validation.is_real(kappa) and 0.0 < kappa <= 1.0,
                         "kappa", kappa, "to be a number in (0, 1]")
        super().__init__(**arguments)
        self.kappa = float(kappa)
        self.gamma = float(gamma)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._previous = [self.add_variable_from_reference(v, "disk_previous")
                          for v in var_list]
        self._filtered = [self.add_variable_from_reference(v, "disk_filtered")
                          for v in var_list]

    def state(self, variable):
        """`(x_{t-1}, g_{t-1})`: the previous weights and filtered gradient
        of `variable` (optimizer variables)."""
        index = self.variable_index(variable)
        return self._previous[index], self._filtered[index]

    def shifts(self, variables) -> list:
        """gamma (x_t - x_{t-1}) of each of `variables` (0 at the first
        step)."""
        first = ops.equal(self.iterations, 0)
        shifts = []
        for v in variables:
            previous, _ = self.state(v)
            shift = self.gamma * (v.value - previous.value)
            shifts.append(ops.where(first, ops.zeros_like(shift), shift))
        return shifts

    def per_example_transform(self, variables):
        return preclip.PerExampleTransform(
            shifts=self.shifts(variables),
            shift_weight=shift_weight(self.kappa, self.gamma))

    def update_step(self, gradient, variable, learning_rate):
        previous, filtered = self.state(variable)
        gradient = ops.cast(gradient, variable.dtype)
        estimate = ops.where(
            ops.equal(self.iterations, 0), gradient,
            (1.0 - self.kappa) * filtered + self.kappa * gradient)
        self.assign(filtered, estimate)
        self.assign(previous, variable)
        super().update_step(estimate, variable, learning_rate)

    def get_config(self):
        config = super().get_config()
        config.update(kappa=self.kappa, gamma=self.gamma)
        return config
