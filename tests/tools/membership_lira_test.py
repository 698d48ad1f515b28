"""Tests of tf_dpadam.membership.lira.

References: NumPy means and standard deviations of the selected scores,
SciPy's normal log-density. Planted answers: scores drawn from known
per-example Gaussians (examples of very different difficulty, members
shifted up) where LiRA must beat the global threshold and approach the
oracle likelihood ratio built from the true parameters; and a pool with no
signal, where it must stay at chance. End to end (slow): shadows of a tiny
Dense net that memorizes random labels.
"""

import math

import keras
import numpy as np
import pytest
from scipy import stats

from tf_dpadam.tools import membership
from tf_dpadam.tools.membership import lira
from tf_dpadam.tools.membership import roc


def test_inclusion_masks_balance_every_example():
    mask = lira.inclusion_masks(8, 1000, seed=3)
    assert mask.shape == (8, 1000) and mask.dtype == bool
    np.testing.assert_array_equal(mask.sum(axis=0), 4)
    # Each shadow trains on Bin(1000, 1/2)-like halves (mean 500, sd 16).
    assert np.all(np.abs(mask.sum(axis=1) - 500) < 80)
    assert not np.array_equal(mask, lira.inclusion_masks(8, 1000, seed=4))
    np.testing.assert_array_equal(mask, lira.inclusion_masks(8, 1000, seed=3))
    with pytest.raises(ValueError, match="num_shadows"):
        lira.inclusion_masks(1, 10)


def test_fit_gaussians_matches_numpy():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(6, 5)) * np.arange(1, 6)
    mask = lira.inclusion_masks(6, 5, seed=1)
    mean, std = lira.fit_gaussians(scores, mask)
    for j in range(5):
        np.testing.assert_allclose(mean[j], scores[mask[:, j], j].mean())
        np.testing.assert_allclose(std[j], scores[mask[:, j], j].std())
    _, pooled = lira.fit_gaussians(scores, mask, global_variance=True)
    within = np.concatenate([scores[mask[:, j], j] - mean[j]
                             for j in range(5)])
    np.testing.assert_allclose(pooled, np.sqrt(np.mean(within ** 2)))
    with pytest.raises(ValueError, match="mask"):
        lira.fit_gaussians(scores[:2], lira.inclusion_masks(2, 5))
    # One score per example is enough with a global variance.
    lira.fit_gaussians(scores[:2], lira.inclusion_masks(2, 5),
                       global_variance=True)


def test_gaussian_log_density_matches_scipy():
    x = np.linspace(-5, 5, 11)
    np.testing.assert_allclose(lira.gaussian_log_density(x, 0.5, 2.0),
                               stats.norm.logpdf(x, 0.5, 2.0))


def planted(seed, n=2000, k=16, shift=1.0, sd=0.5):
    """Per-example N(mu_j + shift * in, sd^2) scores: k shadows and a target
    trained on the first half of the pool; mu_j ~ N(0, 3^2)."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, 3, n)
    mask = lira.inclusion_masks(k, n, seed=seed)
    shadow_scores = mu + shift * mask + rng.normal(0, sd, (k, n))
    is_member = np.arange(n) < n // 2
    target = mu + shift * is_member + rng.normal(0, sd, n)
    return target, lira.ShadowScores(shadow_scores, mask), mu, is_member


def auc_of(scores, is_member):
    return roc.evaluate_attack(scores[is_member], scores[~is_member],
                               num_bootstrap=0).auc


@pytest.mark.parametrize("global_variance", [False, True])
def test_planted_gaussians(global_variance):
    target, shadows, mu, is_member = planted(0)
    # The oracle: the true likelihood ratio, d = shift / sd = 2, AUC
    # Phi(d / sqrt 2) = 0.921.
    oracle = stats.norm.cdf(2 / math.sqrt(2))
    assert auc_of(target - mu, is_member) == pytest.approx(oracle, abs=0.02)
    # A global threshold drowns in the examples' different difficulty.
    assert auc_of(target, is_member) < 0.65
    online = lira.lira_online(target, shadows,
                              global_variance=global_variance)
    offline = lira.lira_offline(target, shadows,
                                global_variance=global_variance)
    for scores in (online, offline):
        assert auc_of(scores, is_member) > oracle - 0.03
    # Offline is the one-sided test against the out-Gaussian.
    mean_out, std_out = lira.fit_gaussians(
        shadows.scores, ~shadows.in_mask, global_variance=global_variance)
    np.testing.assert_allclose(offline, (target - mean_out) / std_out)
    mean_in, std_in = lira.fit_gaussians(
        shadows.scores, shadows.in_mask, global_variance=global_variance)
    np.testing.assert_allclose(
        online, stats.norm.logpdf(target, mean_in, std_in)
        - stats.norm.logpdf(target, mean_out, std_out), rtol=1e-9)


def test_no_signal_stays_at_chance():
    target, shadows, _, is_member = planted(1, shift=0.0)
    n = len(target)
    tolerance = 4 * math.sqrt((n + 1) / (12 * (n / 2) ** 2))  # 0.026.
    for attack in (lira.lira_online, lira.lira_offline):
        assert abs(auc_of(attack(target, shadows), is_member) - 0.5) < tolerance


def test_shape_checks():
    target, shadows, _, _ = planted(2, n=10, k=4)
    with pytest.raises(ValueError, match="target_scores"):
        lira.lira_offline(target[:5], shadows)
    with pytest.raises(ValueError, match="shadows"):
        lira.lira_online(target, lira.ShadowScores(shadows.scores,
                                                   shadows.in_mask[:2]))


def planted_queries(seed, n=2000, k=16, queries=4, shift=0.4, sd=0.5):
    """`planted` with Q views per example: each view's score has its own
    noise, and members are shifted up in every view."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, 3, (n, 1)) + rng.normal(0, 1, (n, queries))
    mask = lira.inclusion_masks(k, n, seed=seed)
    shadow_scores = (mu + shift * mask[..., None]
                     + rng.normal(0, sd, (k, n, queries)))
    is_member = np.arange(n) < n // 2
    target = mu + shift * is_member[:, None] + rng.normal(0, sd, (n, queries))
    return target, lira.ShadowScores(shadow_scores, mask), is_member


@pytest.mark.parametrize("global_variance", [False, True])
def test_fit_gaussians_per_query_match_numpy(global_variance):
    target, shadows, _ = planted_queries(3, n=40, k=6, queries=3)
    del target
    scores, mask = shadows.scores, shadows.in_mask
    mean, std = lira.fit_gaussians(scores, mask,
                                   global_variance=global_variance)
    assert mean.shape == std.shape == (40, 3)
    for q in range(3):
        within = []
        for j in range(40):
            chosen = scores[mask[:, j], j, q]
            np.testing.assert_allclose(mean[j, q], chosen.mean())
            if not global_variance:
                np.testing.assert_allclose(std[j, q], chosen.std())
            within.append(chosen - chosen.mean())
        if global_variance:  # One pooled variance per query.
            np.testing.assert_allclose(
                std[:, q], np.sqrt(np.mean(np.concatenate(within) ** 2)))


@pytest.mark.parametrize("global_variance", [False, True])
def test_queries_average_each_query_test(global_variance):
    target, shadows, _ = planted_queries(4, n=50, k=8, queries=3)
    mean_in, std_in = lira.fit_gaussians(shadows.scores, shadows.in_mask,
                                         global_variance=global_variance)
    mean_out, std_out = lira.fit_gaussians(
        shadows.scores, ~shadows.in_mask, global_variance=global_variance)
    np.testing.assert_allclose(
        lira.lira_online(target, shadows, global_variance=global_variance),
        np.mean(stats.norm.logpdf(target, mean_in, std_in)
                - stats.norm.logpdf(target, mean_out, std_out), axis=1),
        rtol=1e-9)
    np.testing.assert_allclose(
        lira.lira_offline(target, shadows, global_variance=global_variance),
        np.mean((target - mean_out) / std_out, axis=1), rtol=1e-9)
    # One query is the attack without queries.
    one = lira.ShadowScores(shadows.scores[..., :1], shadows.in_mask)
    flat = lira.ShadowScores(shadows.scores[..., 0], shadows.in_mask)
    for attack in (lira.lira_online, lira.lira_offline):
        np.testing.assert_allclose(attack(target[:, :1], one),
                                   attack(target[:, 0], flat))


def test_more_queries_find_more_members():
    # Four views with independent noise: the averaged test's effect size
    # grows (about 2x at Q = 4), so the AUC rises well above one view's
    # (0.65 to 0.69 against 0.77 to 0.85 here; the AUC's sd at n = 2000
    # is about 0.01).
    target, shadows, is_member = planted_queries(5)
    one = lira.ShadowScores(shadows.scores[..., 0], shadows.in_mask)
    for attack in (lira.lira_online, lira.lira_offline):
        single = auc_of(attack(target[:, 0], one), is_member)
        several = auc_of(attack(target, shadows), is_member)
        assert several > single + 0.08, (attack.__name__, single, several)


def test_query_shape_checks():
    target, shadows, _ = planted_queries(6, n=10, k=4, queries=2)
    with pytest.raises(ValueError, match="target_scores"):
        lira.lira_offline(target[:, 0], shadows)
    with pytest.raises(ValueError, match="shadows"):
        lira.lira_online(target, lira.ShadowScores(
            shadows.scores, shadows.in_mask[..., None]))
    with pytest.raises(ValueError, match="scores"):
        lira.fit_gaussians(shadows.scores[None], shadows.in_mask)


class Memorizer:
    """A stand-in model: logit 5 on the true class of the examples it was
    trained on, 0 elsewhere (a class per example: y = its index)."""

    def __init__(self, x):
        self.seen = set(np.asarray(x).reshape(-1).tolist())

    def predict(self, x, batch_size=None, verbose=0):
        del batch_size, verbose
        logits = np.zeros((len(x), 3))
        for i, value in enumerate(np.asarray(x).reshape(-1)):
            logits[i, 0] = 5.0 if value in self.seen else 0.0
        return logits


def test_train_shadows_trains_on_the_masked_half_and_scores_the_pool():
    x = np.arange(20, dtype=np.float32)[:, None]
    y = np.zeros(20, dtype=np.int64)
    calls = []

    def train_fn(x_half, y_half):
        calls.append((x_half.copy(), y_half.copy()))
        return Memorizer(x_half)

    shadows = lira.train_shadows(train_fn, x, y, num_shadows=4, seed=7)
    np.testing.assert_array_equal(shadows.in_mask,
                                  lira.inclusion_masks(4, 20, seed=7))
    for (x_half, _), mask in zip(calls, shadows.in_mask):
        np.testing.assert_array_equal(x_half[:, 0], x[mask, 0])
    # Logit confidence of logits (5, 0, 0): 5 - log 2; of (0, 0, 0): -log 2.
    np.testing.assert_allclose(
        shadows.scores, np.where(shadows.in_mask, 5.0, 0.0) - math.log(2))
    with pytest.raises(ValueError, match="in_mask"):
        lira.train_shadows(train_fn, x, y, num_shadows=4,
                           in_mask=np.ones((3, 20), bool))
    # Queries: each shadow scores each view of the pool (here x + 100 is
    # never seen, x itself is).
    views = lira.train_shadows(train_fn, x, y, num_shadows=4, seed=7,
                               queries=[lambda v: v, lambda v: v + 100])
    assert views.scores.shape == (4, 20, 2)
    np.testing.assert_allclose(views.scores[..., 0], shadows.scores)
    np.testing.assert_allclose(views.scores[..., 1], -math.log(2))


@pytest.mark.slow
def test_lira_on_a_tiny_memorizing_model():
    # A pool of 64 random inputs with random labels: a Dense net trained on
    # a half memorizes it, and LiRA with 4 shadows tells members apart.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, 64)

    def train_fn(x_half, y_half):
        keras.utils.set_random_seed(len(y_half))
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        # 150 full-batch steps in one epoch (Keras' per-epoch cost is high).
        model.fit(np.tile(x_half, (150, 1)), np.tile(y_half, 150),
                  batch_size=len(y_half), shuffle=False, verbose=0)
        return model

    target = train_fn(x[:32], y[:32])
    shadows = membership.train_shadows(train_fn, x, y, num_shadows=4, seed=1)
    is_member = np.arange(64) < 32
    scores = membership.lira_offline(membership.model_scores(target, x, y),
                                     shadows, global_variance=True)
    # Chance is 0.5 (sd 0.07 for 32 + 32 examples): 0.8 is > 4 sd above.
    assert auc_of(scores, is_member) > 0.8
