"""Adaptive clipping: C follows a quantile of the per-example gradient norms.

Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with
Adaptive Clipping" (NeurIPS 2021). Each step, besides the clipped gradient
sum, the privatizer releases the fraction of examples that were not clipped,
itself privatized: with b_i = 1 if ||g_i|| <= C, else 0,

    b_tilde = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / B + 1/2,

(each example moves the shifted count by 1/2, so its sensitivity is 1/2)
and C moves geometrically toward the target quantile gamma of the norms:

    C <- C * exp(-eta * (b_tilde - gamma)).

Too many unclipped examples (b_tilde > gamma) shrink C; too few grow it.

**Privacy.** The count is a second Gaussian query on the same sample. Its
noise multiplier is 2 sigma_b (sensitivity 1/2), and with G clipping groups
(per-layer clipping, one count per group) the vector of counts has
sensitivity sqrt(G) / 2, so its multiplier is 2 sigma_b / sqrt(G). Both
queries together are one Gaussian query on the concatenated vector, whose
multiplier z satisfies z^-2 = z_grad^-2 + G (2 sigma_b)^-2. Following the
paper, the gradient's noise multiplier is raised to

    z_grad = (z^-2 - G (2 sigma_b)^-2)^(-1/2),

so that the two together have exactly the configured `noise_multiplier` z,
and the accountant (which is given z) states the guarantee of the whole
step. C, the count and its noise are public or privatized: every later
use of C (the noise's std z_grad C, Phi) is post-processing.

These functions use `keras.ops` (or plain Python) only.
"""

import dataclasses
import math

from keras import ops

from tf_dpadam.common import validation

# Andrew et al.'s defaults: eta = 0.2 and sigma_b = B / 20 (the expected
# number of examples of a step over 20).
DEFAULT_CLIP_LEARNING_RATE = 0.2
DEFAULT_COUNT_STDDEV_FRACTION = 1 / 20


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """The public settings of adaptive clipping (TF-Privacy's names).

    Attributes:
        target_unclipped_quantile: gamma in (0, 1), the fraction of examples
            that should not be clipped.
        clip_learning_rate: eta > 0, the geometric step size of C.
        clipped_count_stddev: sigma_b >= 0, the std of the noise on the
            count of unclipped examples (None: B / 20, the paper's default;
            needs an int `batch_size`).
    """

    target_unclipped_quantile: float
    clip_learning_rate: float = DEFAULT_CLIP_LEARNING_RATE
    clipped_count_stddev: float | None = None

    def __post_init__(self):
        gamma = self.target_unclipped_quantile
        validation.check(
            validation.is_real(gamma) and 0 < gamma < 1,
            "target_unclipped_quantile", gamma, "to be None or in (0, 1)")
        validation.check_positive("clip_learning_rate",
                                  self.clip_learning_rate)
        if self.clipped_count_stddev is not None:
            validation.check_non_negative("clipped_count_stddev",
                                          self.clipped_count_stddev)

    def count_stddev(self, batch_size) -> float:
        """sigma_b: `clipped_count_stddev`, or B / 20 for None.

        Raises:
            ValueError: if `clipped_count_stddev` is None and `batch_size`
                is None (the default needs the public B).
        """
        if self.clipped_count_stddev is not None:
            return float(self.clipped_count_stddev)
        if batch_size is None:
            raise ValueError(
                "Expected batch_size to be an int when"
                " target_unclipped_quantile is set and"
                " clipped_count_stddev=None: the default sigma_b is B / 20,"
                " with B the public (expected) batch size. Set batch_size or"
                " clipped_count_stddev."
            )
        return DEFAULT_COUNT_STDDEV_FRACTION * batch_size


def gradient_noise_multiplier(noise_multiplier: float,
                              clipped_count_stddev: float,
                              num_groups: int = 1) -> float:
    """z_grad = (z^-2 - G (2 sigma_b)^-2)^(-1/2): the gradient's noise
    multiplier that leaves the step (gradient and counts) at multiplier z.

    Args:
        noise_multiplier: z, the configured (and accounted) multiplier.
        clipped_count_stddev: sigma_b, the std of each count's noise.
        num_groups: G, the number of counts (clipping groups).

    Returns:
        z_grad >= z (0 if z is 0: no privacy is claimed).

    Raises:
        ValueError: if the counts alone would spend the budget
            (2 sigma_b / sqrt(G) <= z).
    """
    z = float(noise_multiplier)
    if z == 0:
        return 0.0
    count_multiplier = 2 * float(clipped_count_stddev) / math.sqrt(num_groups)
    if count_multiplier <= z:
        raise ValueError(
            f"Expected clipped_count_stddev={clipped_count_stddev!r} >"
            f" noise_multiplier * sqrt(G) / 2 = {z * math.sqrt(num_groups) / 2}"
            f" (G = {num_groups} clipping groups): the privatized counts of"
            " unclipped examples would spend the whole privacy budget of"
            " the step (Andrew et al. 2021 use B / 20)."
        )
    return (z ** -2 - count_multiplier ** -2) ** -0.5


def composed_noise_multiplier(gradient_multiplier: float,
                              clipped_count_stddev: float,
                              num_groups: int = 1) -> float:
    """z of the gradient query and G count queries together (the inverse of
    `gradient_noise_multiplier`): (z_grad^-2 + G (2 sigma_b)^-2)^(-1/2)."""
    if gradient_multiplier == 0 or clipped_count_stddev == 0:
        return 0.0
    return (gradient_multiplier ** -2
            + num_groups * (2 * clipped_count_stddev) ** -2) ** -0.5


def shifted_unclipped_counts(norms, clip_norms, present):
    """sum_i present_i (b_i - 1/2) per group: `[G]` from `[G, B]` norms.

    b_i = 1 if example i's norm is <= C (a NaN or infinite norm counts as
    clipped). Each example moves each entry by 1/2 at most.
    """
    norms = ops.cast(norms, "float32")
    clip_norms = ops.reshape(ops.cast(clip_norms, "float32"), (-1, 1))
    unclipped = ops.cast(ops.less_equal(norms, clip_norms), "float32")
    present = ops.reshape(ops.cast(present, "float32"), (1, -1))
    return ops.sum((unclipped - 0.5) * present, axis=1)


def unclipped_fraction(noised_shifted_counts, denominator):
    """b_tilde = noised shifted count / B + 1/2."""
    return (ops.cast(noised_shifted_counts, "float32")
            / ops.cast(denominator, "float32") + 0.5)


def next_clip_norms(clip_norms, fraction, target_unclipped_quantile,
                    clip_learning_rate):
    """C * exp(-eta * (b_tilde - gamma)), per group."""
    return clip_norms * ops.exp(
        -clip_learning_rate * (fraction - target_unclipped_quantile))
