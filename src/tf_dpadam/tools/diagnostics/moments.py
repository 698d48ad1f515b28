"""The math of the diagnostics: Adam's moments and their statistics.

WARNING: NOT DIFFERENTIALLY PRIVATE (see `tf_dpadam.tools.diagnostics`): a
`MomentSnapshot` holds Adam's moments of the clean, un-noised gradient.

Functions of flat arrays, in float64: Adam's moment recursion and bias
correction, the three update directions, the noise's predicted spread, and
the summaries (the paper's Table 2) and comparisons of one snapshot.
"""

import dataclasses
import math

import numpy as np
from keras import ops

from tf_dpadam.privatizer import dp_math

# The columns of a summary row, in order.
SUMMARY_COLUMNS = ("min", "25%", "median", "75%", "max", "mean")


def adam_moments(m, v, gradient, beta_1, beta_2):
    """One step of Adam's moment estimates, before bias correction.

    Returns:
        `(beta_1 m + (1 - beta_1) g, beta_2 v + (1 - beta_2) g^2)`.
    """
    gradient = np.asarray(gradient, np.float64)
    return (
        beta_1 * m + (1 - beta_1) * gradient,
        beta_2 * v + (1 - beta_2) * np.square(gradient),
    )


def bias_correct(m, v, beta_1, beta_2, step):
    """Adam's bias correction at step t >= 1: m/(1 - b1^t), v/(1 - b2^t)."""
    return m / (1 - beta_1**step), v / (1 - beta_2**step)


def adam_direction(m_hat, v_hat):
    """m_hat / sqrt(v_hat), and 0 where v_hat = 0 (where m_hat = 0 too)."""
    m_hat = np.asarray(m_hat, np.float64)
    v_hat = np.asarray(v_hat, np.float64)
    return np.divide(
        m_hat, np.sqrt(np.maximum(v_hat, 0.0)),
        out=np.zeros_like(m_hat), where=v_hat > 0,
    )


def corrected_direction(m_hat, v_hat, phi, gamma):
    """m_hat / sqrt(max(v_hat - Phi, gamma')), DP-AdamBC's update direction.

    The optimizer's own formula, `dp_math.corrected_adam_direction`, rather
    than a NumPy copy of it. It is written in `keras.ops`, so on float64
    NumPy input it runs eagerly in float64 on the backend (TensorFlow, which
    this package already needs) and returns a tensor, converted back here.
    The values are those of the NumPy expression
    m_hat / np.sqrt(np.maximum(v_hat - phi, gamma)) (both round each
    operation once; equal bit for bit on random float64 arrays).
    """
    direction = dp_math.corrected_adam_direction(
        np.asarray(m_hat, np.float64), np.asarray(v_hat, np.float64), phi,
        gamma,
    )
    return np.asarray(ops.convert_to_numpy(direction), np.float64)


def second_moment_noise_std(phi, beta_2, step):
    """The std that the noise alone gives v^p - v^c at step t.

    With w_s = (1 - b2) b2^(t-s) / (1 - b2^t) the bias-corrected EMA weights,
    v^p - v^c = sum_s w_s (2 g_s z_s / B + z_s^2 / B^2) per coordinate, with
    z_s / B ~ N(0, Phi) independent of the past. Its variance is
    sum_s w_s^2 (2 Phi^2 + 4 Phi g_s^2); the noise-only part is

        Phi * sqrt(2 sum_s w_s^2),
        sum_s w_s^2 = (1 - b2) (1 + b2^t) / ((1 + b2) (1 - b2^t)).

    It is Phi * sqrt(2) at t = 1 and shrinks to Phi * sqrt(2 (1 - b2) / (1 +
    b2)) (0.032 Phi for b2 = 0.999): the floor below which v^p - Phi cannot
    resolve v^c.
    """
    weights_squared = (1 - beta_2) * (1 + beta_2**step) / (
        (1 + beta_2) * (1 - beta_2**step)
    )
    return phi * math.sqrt(2 * weights_squared)


def summary_statistics(values):
    """min, quartiles, max and mean of `values` (flattened), as floats.

    Quartiles are NumPy's default (linear interpolation).

    Returns:
        A dict keyed by `SUMMARY_COLUMNS`.
    """
    values = np.ravel(np.asarray(values, np.float64))
    if values.size == 0:
        raise ValueError("Expected at least one value to summarize.")
    q25, q50, q75 = np.quantile(values, [0.25, 0.5, 0.75])
    return {
        "min": float(values.min()),
        "25%": float(q25),
        "median": float(q50),
        "75%": float(q75),
        "max": float(values.max()),
        "mean": float(values.mean()),
    }


def _ratio(a, b):
    """a / b, or nan when b is 0 (e.g. Phi without noise)."""
    return float(a) / float(b) if b else math.nan


def _cosine(a, b):
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(np.dot(a, b) / norm) if norm else math.nan


@dataclasses.dataclass(frozen=True, eq=False)
class MomentSnapshot:
    """Clean and private Adam moments at one step (NOT private).

    All arrays are bias-corrected, flattened over every trainable variable
    (in the model's order) and float64.

    Attributes:
        step: t, the optimizer's step (1 for the first update).
        phi: Phi, what the corrected update subtracts: (sigma C / B)^2 of the
            step, or the optimizer's `phi` override (the paper's Phi').
        gamma: gamma', the floor inside the corrected square root.
        noise_phi: (sigma C / B)^2, the noise's bias in E[v^p] (equal to
            `phi` unless `phi` is overridden).
        beta_1, beta_2: the optimizer's (and the clean moments') betas.
        m_clean, v_clean: m^c, v^c, Adam's moments of the clean gradient.
        m_private, v_private: m^p, v^p, the DP optimizer's own moments.
    """

    step: int
    phi: float
    gamma: float
    noise_phi: float
    beta_1: float
    beta_2: float
    m_clean: np.ndarray
    v_clean: np.ndarray
    m_private: np.ndarray
    v_private: np.ndarray

    def updates(self):
        """The three update directions (see `tf_dpadam.tools.diagnostics`)."""
        return {
            "clean": adam_direction(self.m_clean, self.v_clean),
            "private": adam_direction(self.m_private, self.v_private),
            "corrected": corrected_direction(
                self.m_private, self.v_private, self.phi, self.gamma
            ),
        }


def moment_summary(snapshot):
    """The paper's Table 2 for one snapshot, plus the update magnitudes.

    Returns:
        A dict of `summary_statistics` dicts, keyed (in this order) by
        v_clean, v_private, v_private_minus_phi, abs_m_clean, abs_m_private,
        abs_update_clean, abs_update_private and abs_update_corrected (the
        rows of `report.SUMMARY_ROWS`).
    """
    s = snapshot
    updates = s.updates()
    rows = {
        "v_clean": s.v_clean,
        "v_private": s.v_private,
        "v_private_minus_phi": s.v_private - s.phi,
        "abs_m_clean": np.abs(s.m_clean),
        "abs_m_private": np.abs(s.m_private),
        "abs_update_clean": np.abs(updates["clean"]),
        "abs_update_private": np.abs(updates["private"]),
        "abs_update_corrected": np.abs(updates["corrected"]),
    }
    return {name: summary_statistics(values) for name, values in rows.items()}


def moment_comparison(snapshot):
    """How far the private second moments and updates are from the clean ones.

    `bias_over_phi` is (mean v^p - mean v^c) / Phi over all coordinates,
    whose expectation is 1 (the noise's bias, with `noise_phi`), and
    `std_over_phi` the spread of v^p - v^c over coordinates, to compare with
    `noise_std_over_phi` (`second_moment_noise_std`; the measured spread also
    has the cross term 2 g z / B and the spread of the bias). The
    log-errors compare each coordinate's denominator with the clean one,
    over the coordinates with v^c > 0 (and v^p > 0, which holds unless a
    coordinate never had a gradient): 0 means v^p (or the corrected
    max(v^p - Phi, gamma')) equals v^c, 1 a factor of 10. Cosines and norm
    ratios compare the update directions with the clean one. Ratios to Phi
    are nan without noise.

    Returns:
        A dict of floats, keyed in the order of `report.COMPARISON_ROWS`.
    """
    s = snapshot
    updates = s.updates()
    corrected_v = np.maximum(s.v_private - s.phi, s.gamma)
    positive = (s.v_clean > 0) & (s.v_private > 0)
    clean_norm = np.linalg.norm(updates["clean"])
    return {
        "phi": float(s.phi),
        "gamma": float(s.gamma),
        "median_v_clean_over_phi": _ratio(np.median(s.v_clean), s.phi),
        "median_v_private_over_phi": _ratio(np.median(s.v_private), s.phi),
        "bias_over_phi": _ratio(
            np.mean(s.v_private) - np.mean(s.v_clean), s.noise_phi
        ),
        "std_over_phi": _ratio(np.std(s.v_private - s.v_clean), s.noise_phi),
        "noise_std_over_phi": _ratio(
            second_moment_noise_std(s.noise_phi, s.beta_2, s.step),
            s.noise_phi,
        ),
        "floored_fraction": float(np.mean(s.v_private - s.phi < s.gamma)),
        "median_log10_error_private": float(np.median(np.abs(np.log10(
            s.v_private[positive] / s.v_clean[positive]
        )))) if positive.any() else math.nan,
        "median_log10_error_corrected": float(np.median(np.abs(np.log10(
            corrected_v[positive] / s.v_clean[positive]
        )))) if positive.any() else math.nan,
        "cosine_private": _cosine(updates["clean"], updates["private"]),
        "cosine_corrected": _cosine(updates["clean"], updates["corrected"]),
        "norm_ratio_private": _ratio(
            np.linalg.norm(updates["private"]), clean_norm
        ),
        "norm_ratio_corrected": _ratio(
            np.linalg.norm(updates["corrected"]), clean_norm
        ),
    }
