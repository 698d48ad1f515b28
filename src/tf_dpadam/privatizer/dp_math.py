"""The DP-Adam math, in small functions you can read next to the paper.

Notation (Tang & Lecuyer, "DP-Adam: Correcting DP Bias in Adam's Second Moment
Estimation"): C is the per-example clipping norm (`l2_norm_clip`), sigma the
noise multiplier, B the public denominator (the expected or logical batch
size). One DP step privatizes the gradient as

        g_tilde = (sum_i clip(g_i, C) + z) / B,    z ~ N(0, sigma^2 C^2 I),

and the noise adds Phi = (sigma C / B)^2 to the expectation of every coordinate
of Adam's bias-corrected second moment v_hat. The corrected update is

        theta <- theta - lr * m_hat / sqrt(max(v_hat - Phi, gamma')).

Phi itself comes with each private gradient from the privatizer
(`noise.noise_variance_phi`, its one formula); here are the clip factors,
the norms, gamma' and the corrected direction. These functions use `keras.ops` only, so they accept NumPy arrays and tensors
alike and carry no Keras state.
"""

import dataclasses

from keras import ops


# The fraction of Phi used as gamma' when `epsilon=None`. Both of the paper's
# settings use gamma' of about 0.04 * Phi (CIFAR-10: Phi = 2.4e-7 and
# gamma' = 1e-8; SNLI: Phi = 2.44e-8 and gamma' = 1e-9).
DEFAULT_GAMMA_OVER_PHI = 0.04
# The floor of the default gamma' when Phi is (close to) zero, i.e. without
# noise; as a floor inside the square root it matches Keras Adam's 1e-7 outside.
MIN_DEFAULT_GAMMA = 1e-14


def default_gamma(phi):
    """gamma' for `epsilon=None`: 0.04 * Phi, floored at `MIN_DEFAULT_GAMMA`."""
    return ops.maximum(DEFAULT_GAMMA_OVER_PHI * phi, MIN_DEFAULT_GAMMA)


def per_example_global_norms(per_example_grads):
    """L2 norm of each example's gradient over all variables.

    Sums squares directly instead of `tf.linalg.global_norm`, which is built on
    L2Loss and is not vectorized (it silently becomes a loop inside pfor).

    Args:
        per_example_grads: list of tensors with a leading example axis.

    Returns:
        A vector of one norm per example.
    """
    total = 0.0
    for g in per_example_grads:
        g = ops.cast(g, "float32")
        total = total + ops.sum(ops.square(ops.reshape(g, (ops.shape(g)[0], -1))),
                                                        axis=1)
    return ops.sqrt(total)


def finite_examples(norms, losses=None):
    """True for each example whose gradient norm (and loss) is finite.

    An example with a NaN or infinite gradient (or loss), e.g. from an `inf`
    feature, has a NaN or infinite norm (its squared norm sums the squares of
    its gradient's coordinates, in float32); so does a finite gradient whose
    squared norm overflows float32. Such examples are clipped to zero.
    """
    finite = ops.isfinite(norms)
    if losses is not None:
        finite = ops.logical_and(finite, ops.isfinite(losses))
    return finite


def clip_factors(norms, l2_norm_clip, finite=None):
    """min(1, C / ||g_i||), written so that a zero gradient gives 1, not nan.

    An example whose norm is not finite (NaN or inf), or that `finite` marks
    False, gets the factor 0, computed without NaN arithmetic: its gradient
    then contributes nothing to the clipped sum, so the sum's sensitivity
    stays C whatever the data. (The sum must not multiply 0 by its
    non-finite gradient: see `step.clipping.clip_and_sum`.) The factors are
    float32 whatever the dtype of `norms`.
    """
    norms = ops.cast(norms, "float32")
    ok = finite_examples(norms)
    if finite is not None:
        ok = ops.logical_and(ok, finite)
    clip = ops.cast(l2_norm_clip, "float32")
    safe = ops.where(ok, norms, clip)
    return ops.where(ok, clip / ops.maximum(safe, clip), ops.zeros_like(safe))


def corrected_adam_direction(m_hat, v_hat, phi, gamma):
    """m_hat / sqrt(max(v_hat - Phi, gamma')), the paper's Algorithm 1 step."""
    return m_hat / ops.sqrt(ops.maximum(v_hat - phi, gamma))


@dataclasses.dataclass(frozen=True)
class GroupClip:
    """Per-layer (group-wise) clipping of one step (`tf_dpadam.privatizer.clip_groups`).

    Attributes:
        clip_norms: C_l of each group, `[G]` (a tensor or a sequence).
        groups: the group index of each trainable variable, in order.
    """

    clip_norms: object
    groups: tuple

    @classmethod
    def of(cls, clip, groups):
        """`clip` itself for flat clipping (`groups` None), else a
        `GroupClip`."""
        return clip if groups is None else cls(clip, tuple(groups))

    @property
    def num_groups(self) -> int:
        return max(self.groups) + 1


def global_norms(norms):
    """Each example's global norm: `norms` itself (`[B]`), or from per-group
    norms `[G, B]`, sqrt(sum_l norm_l^2)."""
    if len(norms.shape) == 1:
        return norms
    return ops.sqrt(ops.sum(ops.square(ops.cast(norms, "float32")), axis=0))


def group_clip_factors(group_norms, clip_norms, finite=None):
    """min(1, C_l / ||g_i,l||) per group, `[G, B]`, from `[G, B]` norms.

    An example whose norm in any group is not finite (or that `finite`
    marks False) gets the factor 0 in every group, so that it adds nothing.
    """
    group_norms = ops.cast(group_norms, "float32")
    ok = finite_examples(global_norms(group_norms))
    if finite is not None:
        ok = ops.logical_and(ok, finite)
    clips = ops.reshape(
        ops.broadcast_to(ops.cast(clip_norms, "float32"),
                         (group_norms.shape[0],)), (-1, 1))
    return clip_factors(group_norms, clips, finite=ok)
