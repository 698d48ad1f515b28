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

With augmented queries (`queries`: each example scored under Q views, as
flips and shifts of an image), the scores are (n, Q) per model: a Gaussian
per example and query (a pooled variance per query with
`global_variance`), and the attack's score is the mean over the queries of
each query's test (the log likelihood ratio, or z), which for independent
queries ranks as their sum, the diagonal-covariance likelihood ratio.

The statistics are NumPy functions; `train_shadows` is the loop around the
user's own training function `train_fn(x, y) -> model`.
"""

from typing import NamedTuple

import numpy as np

from tf_dpadam.common import validation
from tf_dpadam.tools.membership import scores as scores_lib

# Floor of a standard deviation (a constant score across shadows).
MIN_STD = 1e-6


class ShadowScores(NamedTuple):
    """Scores of a pool's examples under k shadow models (`train_shadows`).

    Attributes:
        scores: (k, n) float64, the score of example j under shadow i, or
            (k, n, Q) with Q queries per example.
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
    validation.check(scores.ndim in (2, 3) and in_mask.ndim == 2
                     and in_mask.shape == scores.shape[:2], "shadows",
                     f"<scores {scores.shape}, in_mask {in_mask.shape}>",
                     "to hold (k, n) or (k, n, Q) scores and a (k, n) mask")
    target = np.asarray(target_scores, np.float64)
    validation.check(target.shape == scores.shape[1:], "target_scores",
                     f"<array of shape {target.shape}>",
                     f"to have shape {scores.shape[1:]}, as each shadow's"
                     " scores (one per example, and per query)")
    return target, scores, in_mask


def fit_gaussians(scores, mask, *, global_variance=False):
    """Per-example mean and standard deviation of the masked scores.

    Args:
        scores: (k, n) scores, or (k, n, Q) with Q queries per example (a
            Gaussian per example and query).
        mask: (k, n) bool, which of them to use (e.g. `in_mask` or its
            negation); every example needs 1 score with `global_variance`,
            else 2.
        global_variance: whether all examples share the pooled variance
            mean_j Var_j (each about its own mean) instead of their own
            (with queries, one pooled variance per query).

    Returns:
        `(mean, std)`, two arrays of shape (n,) or (n, Q); std is at least
        `MIN_STD`.
    """
    scores, mask = np.asarray(scores, np.float64), np.asarray(mask, bool)
    validation.check(mask.ndim == 2 and scores.ndim in (2, 3)
                     and scores.shape[:2] == mask.shape, "scores",
                     f"<array of shape {scores.shape}>",
                     f"to be (k, n) or (k, n, Q) for a {mask.shape} mask")
    counts = mask.sum(axis=0)
    need = 1 if global_variance else 2
    validation.check(counts.min() >= need, "mask", f"<{counts.min()} scores"
                     " for some example>", f"to select >= {need} score(s) of"
                     " every example (more shadows, or global_variance)")
    extra = (1,) * (scores.ndim - 2)
    mask = mask.reshape(mask.shape + extra)
    counts = counts.reshape(counts.shape + extra)
    mean = np.sum(np.where(mask, scores, 0.0), axis=0) / counts
    variance = np.sum(np.where(mask, (scores - mean) ** 2, 0.0), axis=0)
    if global_variance:
        variance = np.broadcast_to(variance.sum(axis=0) / counts.sum(),
                                   mean.shape)
    else:
        variance = variance / counts
    return mean, np.maximum(np.sqrt(variance), MIN_STD)


def _over_queries(tests):
    """(n,) from each example's tests: the mean over queries if (n, Q)."""
    return tests.mean(axis=1) if tests.ndim == 2 else tests


def lira_online(target_scores, shadows, *, global_variance=False):
    """Online LiRA: log N(x; mu_in, s_in) - log N(x; mu_out, s_out).

    Args:
        target_scores: (n,) the target model's scores of the pool, or
            (n, Q) with queries (then the mean of the Q ratios).
        shadows: `ShadowScores` of the same pool (and queries).
        global_variance: pooled variances (see `fit_gaussians`).

    Returns:
        (n,) log likelihood ratios; higher: "member".
    """
    target, scores, in_mask = _check_shadows(target_scores, shadows)
    mean_in, std_in = fit_gaussians(scores, in_mask,
                                    global_variance=global_variance)
    mean_out, std_out = fit_gaussians(scores, ~in_mask,
                                      global_variance=global_variance)
    return _over_queries(gaussian_log_density(target, mean_in, std_in)
                         - gaussian_log_density(target, mean_out, std_out))


def lira_offline(target_scores, shadows, *, global_variance=False):
    """Offline LiRA: z = (x - mu_out) / s_out, from the out-models only.

    Args:
        target_scores: (n,) the target model's scores of the pool, or
            (n, Q) with queries (then the mean of the Q z-scores).
        shadows: `ShadowScores` of the same pool (the in-scores are unused).
        global_variance: a pooled variance (see `fit_gaussians`).

    Returns:
        (n,) z-scores; higher: "member". Without queries the one-sided
        p-value of "not a member" is erfc(z / sqrt 2) / 2.
    """
    target, scores, in_mask = _check_shadows(target_scores, shadows)
    mean_out, std_out = fit_gaussians(scores, ~in_mask,
                                      global_variance=global_variance)
    return _over_queries((target - mean_out) / std_out)


def train_shadows(train_fn, x, y, *, num_shadows, seed=0,
                  score="logit_confidence", batch_size=512, in_mask=None,
                  queries=None):
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
        queries: None, or Q views of each example (`queries`): the scores
            are then (k, n, Q); score the target with the same queries.

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
                                            batch_size=batch_size,
                                            queries=queries))
    return ShadowScores(scores=np.stack(rows), in_mask=in_mask)
