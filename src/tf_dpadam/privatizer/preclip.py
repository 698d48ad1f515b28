"""What an optimizer asks the private step to do to each example's gradient
before clipping.

Two of the DP optimizers change the per-example gradient that is clipped:

* scale-then-privatize (`tf_dpadam.DPAdamScaleThenPrivatize`) multiplies it
  coordinate-wise by a preconditioner s computed from past private outputs,
  so the step clips s * g_i, sums, noises and divides by B, and the
  optimizer divides by s afterwards;
* DiSK (`tf_dpadam.DPAdamDiSK`) clips a combination of the example's
  gradient at the weights theta and at theta + delta,
  (1 - w) g_i(theta) + w g_i(theta + delta).

`PerExampleTransform` says which, and `transform_gradients` applies it to
materialized per-example gradients (the vectorized path). Ghost clipping
takes the scales (`ghost_clipping.clipped_gradient_sum(scales=...)`: the
norms of the scaled gradients, and the scale times the clipped sum); shifts
need each example's gradient at two points, so DiSK takes the vectorized
path (`make_private(clipping="ghost")` raises). Either way each
example contributes one vector clipped to C, so the sensitivity of the sum
is C and the accounting is unchanged.
"""

import dataclasses
from typing import Optional, Sequence

from keras import ops


@dataclasses.dataclass(frozen=True)
class PerExampleTransform:
    """A pre-clipping transform of the per-example gradients.

    Attributes:
        scales: None, or one float32 tensor per trainable variable (its
            shape): each example's gradient is multiplied by it before
            clipping, and the clipped sum the optimizer receives is in that
            scaled space.
        shifts: None, or one tensor per trainable variable: the step also
            computes each example's gradient at the weights plus `shifts`.
        shift_weight: w, the weight of the gradient at the shifted weights
            in (1 - w) g_i(theta) + w g_i(theta + shifts).
    """
    scales: Optional[Sequence] = None
    shifts: Optional[Sequence] = None
    shift_weight: float = 0.0

    def __post_init__(self):
        if self.scales is None and self.shifts is None:
            raise ValueError(
                "Expected scales or shifts for a PerExampleTransform.")


def shifted_value(variable, shift):
    """The value of `variable` plus `shift` (its gradient stopped), in the
    variable's dtype: where DiSK's second point reads the weight."""
    return variable.value + ops.cast(ops.stop_gradient(shift), variable.dtype)


def transform_gradients(grads: Sequence, transform: PerExampleTransform,
                        shifted_grads: Optional[Sequence] = None) -> list:
    """The per-example gradients the step clips.

    Args:
        grads: `[batch, *shape]` per variable, at the weights.
        transform: the `PerExampleTransform`.
        shifted_grads: `[batch, *shape]` per variable at the shifted
            weights (needed when `transform.shifts` is set).

    Returns:
        float32 `[batch, *shape]` per variable:
        s * ((1 - w) g + w g_shifted), with s = 1 and w = 0 where the
        transform has no scales or shifts.
    """
    grads = [ops.cast(g, "float32") for g in grads]
    if transform.shifts is not None:
        if shifted_grads is None:
            raise ValueError(
                "Expected shifted_grads when the transform has shifts.")
        w = float(transform.shift_weight)
        grads = [(1.0 - w) * g + w * ops.cast(h, "float32")
                 for g, h in zip(grads, shifted_grads)]
    if transform.scales is not None:
        grads = [g * ops.cast(s, "float32")[None]
                 for g, s in zip(grads, transform.scales)]
    return grads
