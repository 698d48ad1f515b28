"""The Likelihood Ratio Attack (LiRA) with shadow models (Carlini et al. 2022).

"Membership Inference Attacks From First Principles" (IEEE S&P 2022). Train
k shadow models, each on a random half of a data pool that holds the target
model's candidates, and record every pool example's score (the logit-scaled
confidence, `scores.logit_confidence`) under every shadow, with the
inclusion mask `in_mask[i, j]` (example j in shadow i's training half).
Across shadows, the score of example j is close to Gaussian, N(mu_in_j,
s_in_j^2) when j was trained on and N(mu_out_j, s_out_j^2) when not. For the
target model's score x_j:

* online LiRA (in- and out-models): the log likelihood ratio

      log N(x_j; mu_in_j, s_in_j) - log N(x_j; mu_out_j, s_out_j);

* offline LiRA (out-models only; the shadows need not be retrained for each
  new candidate, the cheaper default): a one-sided test of "j is a
  non-member", scored by z_j = (x_j - mu_out_j) / s_out_j. Its p-value
  P[N(mu_out_j, s_out_j) >= x_j] = erfc(z_j / sqrt 2) / 2 decreases in z_j,
  so z_j ranks examples exactly as the p-value does.

With few shadows a per-example variance is noisy: `global_variance=True`
uses one pooled variance for all examples (the mean over examples of the
per-example variances about each example's own mean), as the paper
recommends below about 64 shadows.

The statistics are NumPy functions; `train_shadows` is the loop around the
user's own training function `train_fn(x, y) -> model`.
"""

from typing import NamedTuple

import numpy as np

from tf_dpadam import validation
from tf_dpadam.membership import scores as scores_lib

# Floor of a standard deviation (a constant score across shadows).
MIN_STD = 1e-6


class ShadowScores(NamedTuple):
    """Scores of a pool's examples under k shadow models (`train_shadows`).

    Attributes:
        scores: (k, n) float64, the score of example j under shadow i.
        in_mask: (k, n) bool, whether shadow i trained on example j.
    """

    scores: np.ndarray
    in_mask: np.ndarray


def inclusion_masks(num_shadows, num_examples, seed=0):
    """Random halves with every example in exactly half of the shadows.

    For each example independently, a uniformly random set of
    `num_shadows // 2` shadows trains on it (each shadow then gets about
    half the pool); with an even `num_shadows` every example has as many
    in-models as out-models, which both online and offline LiRA need.

    Args:
        num_shadows: k >= 2.
        num_examples: n >= 1, the pool's size.
        seed: seed of the generator.

    Returns:
        (k, n) bool array.
    """
    validation.check(validation.is_int(num_shadows) and num_shadows >= 2,
                     "num_shadows", num_shadows, "to be an int >= 2")
    validation.check_positive_int("num_examples", num_examples)
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((num_shadows, num_examples)), axis=0)
    return ranks < num_shadows // 2


def gaussian_log_density(x, mean, std):
    """log N(x; mean, std^2), elementwise."""
    x, mean, std = (np.asarray(a, np.float64) for a in (x, mean, std))
    return (-0.5 * ((x - mean) / std) ** 2 - np.log(std)
            - 0.5 * np.log(2 * np.pi))


def _check_shadows(target_scores, shadows):
    scores = np.asarray(shadows.scores, np.float64)
    in_mask = np.asarray(shadows.in_mask, bool)
    validation.check(scores.ndim == 2 and in_mask.shape == scores.shape,
                     "shadows", f"<scores {scores.shape}, in_mask"
                     f" {in_mask.shape}>", "to hold (k, n) scores and mask")
    target = np.asarray(target_scores, np.float64)
    validation.check(target.shape == scores.shape[1:], "target_scores",
                     f"<array of shape {target.shape}>",
                     f"to have shape ({scores.shape[1]},), one per example")
    return target, scores, in_mask


def fit_gaussians(scores, mask, *, global_variance=False):
    """Per-example mean and standard deviation of the masked scores.

    Args:
        scores: (k, n) scores.
        mask: (k, n) bool, which of them to use (e.g. `in_mask` or its
            negation); every example needs 1 score with `global_variance`,
            else 2.
        global_variance: whether all examples share the pooled variance
            mean_j Var_j (each about its own mean) instead of their own.

    Returns:
        `(mean, std)`, two (n,) arrays; std is at least `MIN_STD`.
    """
    scores, mask = np.asarray(scores, np.float64), np.asarray(mask, bool)
    counts = mask.sum(axis=0)
    need = 1 if global_variance else 2
    validation.check(counts.min() >= need, "mask", f"<{counts.min()} scores"
                     " for some example>", f"to select >= {need} score(s) of"
                     " every example (more shadows, or global_variance)")
    mean = np.sum(np.where(mask, scores, 0.0), axis=0) / counts
    variance = np.sum(np.where(mask, (scores - mean) ** 2, 0.0), axis=0)
    if global_variance:
        variance = np.full_like(mean, variance.sum() / counts.sum())
    else:
        variance = variance / counts
    return mean, np.maximum(np.sqrt(variance), MIN_STD)


def lira_online(target_scores, shadows, *, global_variance=False):
    """Online LiRA: log N(x; mu_in, s_in) - log N(x; mu_out, s_out).

    Args:
        target_scores: (n,) the target model's scores of the pool.
        shadows: `ShadowScores` of the same pool.
        global_variance: pooled variances (see `fit_gaussians`).

    Returns:
        (n,) log likelihood ratios; higher: "member".
    """
    target, scores, in_mask = _check_shadows(target_scores, shadows)
    mean_in, std_in = fit_gaussians(scores, in_mask,
                                    global_variance=global_variance)
    mean_out, std_out = fit_gaussians(scores, ~in_mask,
                                      global_variance=global_variance)
    return (gaussian_log_density(target, mean_in, std_in)
            - gaussian_log_density(target, mean_out, std_out))


def lira_offline(target_scores, shadows, *, global_variance=False):
    """Offline LiRA: z = (x - mu_out) / s_out, from the out-models only.

    Args:
        target_scores: (n,) the target model's scores of the pool.
        shadows: `ShadowScores` of the same pool (the in-scores are unused).
        global_variance: a pooled variance (see `fit_gaussians`).

    Returns:
        (n,) z-scores; higher: "member". The one-sided p-value of "not a
        member" is erfc(z / sqrt 2) / 2.
    """
    target, scores, in_mask = _check_shadows(target_scores, shadows)
    mean_out, std_out = fit_gaussians(scores, ~in_mask,
                                      global_variance=global_variance)
    return (target - mean_out) / std_out


def train_shadows(train_fn, x, y, *, num_shadows, seed=0,
                  score="logit_confidence", batch_size=512, in_mask=None):
    """Trains k shadow models on random halves of (x, y) and scores the pool.

    Shadow i trains on `x[in_mask[i]], y[in_mask[i]]` through
    `train_fn`, which should train as the target was trained (the same
    architecture, optimizer, privacy settings and number of steps), and
    scores every example of the pool with `scores.model_scores`.

    Args:
        train_fn: `train_fn(x, y) -> model`, a trained Keras classifier with
            logits as outputs.
        x: the pool's inputs (a NumPy array, indexable by a bool mask).
        y: (n,) integer labels.
        num_shadows: k >= 2 (even, so each example has as many in- as
            out-models; 8 to 16 with `global_variance` for small studies,
            64+ in the paper).
        seed: seed of `inclusion_masks`.
        score: "logit_confidence" (LiRA's) or "loss".
        batch_size: `predict` batch size.
        in_mask: (k, n) bool; default `inclusion_masks(k, n, seed)`.

    Returns:
        `ShadowScores`.
    """
    y = np.asarray(y).reshape(-1)
    validation.check(len(x) == len(y), "y", f"<{len(y)} labels>",
                     f"to have one label per example of x ({len(x)})")
    if in_mask is None:
        in_mask = inclusion_masks(num_shadows, len(y), seed)
    in_mask = np.asarray(in_mask, bool)
    validation.check(in_mask.shape == (num_shadows, len(y)), "in_mask",
                     f"<array of shape {in_mask.shape}>",
                     f"to have shape ({num_shadows}, {len(y)})")
    rows = []
    for mask in in_mask:
        model = train_fn(x[mask], y[mask])
        rows.append(scores_lib.model_scores(model, x, y, score=score,
                                            batch_size=batch_size))
    return ShadowScores(scores=np.stack(rows), in_mask=in_mask)
