"""Tests of tf_dpadam.membership.roc against independent computations.

References: a brute-force ROC (every threshold, counted with NumPy
comparisons), SciPy's Mann-Whitney U for the AUC, a brute-force balanced
accuracy, scikit-learn's `roc_curve` when it is installed (the `tests`
extra), and hand-computed small cases. Planted answers: identically
distributed scores give AUC 0.5 within 4 standard deviations of the
Mann-Whitney statistic, sqrt((m + n + 1) / (12 m n)); Gaussian scores shifted
by d give AUC Phi(d / sqrt 2), inside the bootstrap interval.
"""

import math

import numpy as np
import pytest
from scipy import stats

from tf_dpadam.tools import membership
from tf_dpadam.tools.membership import roc


def brute_force_roc(members, nonmembers, thresholds):
    tpr = np.array([np.mean(members >= t) for t in thresholds])
    fpr = np.array([np.mean(nonmembers >= t) for t in thresholds])
    return fpr, tpr


def tied_scores(seed, m=300, n=500, shift=0.8):
    rng = np.random.default_rng(seed)
    # Rounded: many ties, within and across the two groups.
    return (np.round(rng.normal(shift, 1, m), 1),
            np.round(rng.normal(0, 1, n), 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_roc_curve_matches_brute_force(seed):
    members, nonmembers = tied_scores(seed)
    fpr, tpr, thresholds = roc.roc_curve(members, nonmembers)
    assert thresholds[0] == np.inf
    assert np.all(np.diff(thresholds) < 0)
    np.testing.assert_array_equal(
        thresholds[1:], np.unique(np.r_[members, nonmembers])[::-1])
    ref_fpr, ref_tpr = brute_force_roc(members, nonmembers, thresholds)
    np.testing.assert_allclose(fpr, ref_fpr, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tpr, ref_tpr, rtol=0, atol=1e-12)
    assert (fpr[-1], tpr[-1]) == (1.0, 1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_is_the_mann_whitney_statistic(seed):
    members, nonmembers = tied_scores(seed)
    u = stats.mannwhitneyu(members, nonmembers).statistic  # Ties count 1/2.
    expected = u / (len(members) * len(nonmembers))
    fpr, tpr, _ = roc.roc_curve(members, nonmembers)
    assert roc.auc(fpr, tpr) == pytest.approx(expected, abs=1e-12)
    result = roc.evaluate_attack(members, nonmembers, num_bootstrap=0)
    assert result.auc == pytest.approx(expected, abs=1e-12)
    # Pairwise, by definition.
    diff = members[:, None] - nonmembers[None, :]
    assert result.auc == pytest.approx(
        np.mean(diff > 0) + 0.5 * np.mean(diff == 0), abs=1e-12)


def test_matches_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    members, nonmembers = tied_scores(3)
    labels = np.r_[np.ones(len(members)), np.zeros(len(nonmembers))]
    scores = np.r_[members, nonmembers]
    ref_fpr, ref_tpr, ref_thresholds = metrics.roc_curve(
        labels, scores, drop_intermediate=False)
    fpr, tpr, thresholds = roc.roc_curve(members, nonmembers)
    np.testing.assert_allclose(fpr, ref_fpr, atol=1e-12)
    np.testing.assert_allclose(tpr, ref_tpr, atol=1e-12)
    np.testing.assert_allclose(thresholds[1:], ref_thresholds[1:])
    assert roc.auc(fpr, tpr) == pytest.approx(
        metrics.roc_auc_score(labels, scores), abs=1e-12)


def test_balanced_accuracy_and_tpr_at_fpr_brute_force():
    members, nonmembers = tied_scores(4, m=200, n=1000, shift=1.5)
    result = roc.evaluate_attack(members, nonmembers,
                                 fpr_targets=(0.001, 0.01, 0.1),
                                 num_bootstrap=0)
    thresholds = np.r_[np.inf, np.unique(np.r_[members, nonmembers])]
    fpr, tpr = brute_force_roc(members, nonmembers, thresholds)
    assert result.balanced_accuracy == pytest.approx(
        np.max((tpr + 1 - fpr) / 2), abs=1e-12)
    for alpha in (0.001, 0.01, 0.1):
        assert result.tpr_at_fpr[alpha] == pytest.approx(
            np.max(tpr[fpr <= alpha]), abs=1e-12)
    assert result.intervals == {}


def test_hand_computed_case():
    # Members 4, 3, 2, 1; non-members 3.5, 2, 0, -1. Thresholds
    # inf, 4, 3.5, 3, 2, 1, 0, -1 give (FPR, TPR) = (0, 0), (0, 1/4),
    # (1/4, 1/4), (1/4, 1/2), (1/2, 3/4), (1/2, 1), (3/4, 1), (1, 1).
    fpr, tpr, _ = roc.roc_curve([4, 3, 2, 1], [3.5, 2, 0, -1])
    np.testing.assert_allclose(fpr, [0, 0, .25, .25, .5, .5, .75, 1])
    np.testing.assert_allclose(tpr, [0, .25, .25, .5, .75, 1, 1, 1])
    # Area: 1/4 * 1/4 + 1/4 * (1/2 + 3/4) / 2 + 1/2 * 1 = 0.71875 (pairs
    # won by the members: 4 + 3 + 2.5 + 2 = 11.5 of 16).
    assert roc.auc(fpr, tpr) == pytest.approx(0.71875)
    assert roc.tpr_at_fpr(fpr, tpr, 0.0) == 0.25
    assert roc.tpr_at_fpr(fpr, tpr, 0.3) == 0.5
    assert roc.tpr_at_fpr(fpr, tpr, 0.5) == 1.0
    result = roc.evaluate_attack([4, 3, 2, 1], [3.5, 2, 0, -1],
                                 num_bootstrap=0)
    assert result.balanced_accuracy == 0.75  # (1 + 1 - 1/2) / 2.


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_identical_distributions_give_chance(seed):
    rng = np.random.default_rng(seed)
    m = n = 2000
    result = roc.evaluate_attack(rng.normal(size=m), rng.normal(size=n),
                                 num_bootstrap=200, seed=seed)
    # Under the null the AUC has sd sqrt((m + n + 1) / (12 m n)) = 0.0065.
    tolerance = 4 * math.sqrt((m + n + 1) / (12 * m * n))
    assert abs(result.auc - 0.5) < tolerance
    assert result.tpr_at_fpr[0.01] < 0.01 + 4 * math.sqrt(0.01 / m)
    assert 0.5 <= result.balanced_accuracy < 0.5 + 0.04


def test_planted_shift_and_bootstrap_interval():
    rng = np.random.default_rng(5)
    shift = 1.0
    members, nonmembers = rng.normal(shift, 1, 1500), rng.normal(0, 1, 1500)
    result = roc.evaluate_attack(members, nonmembers, num_bootstrap=500)
    true_auc = stats.norm.cdf(shift / math.sqrt(2))  # 0.760.
    low, high = result.intervals["auc"]
    assert low < true_auc < high
    # Width about 2 * 1.96 * sd of the estimate (Hanley-McNeil, ~0.0122).
    assert 0.03 < high - low < 0.07
    # TPR at FPR 1% of two unit Gaussians: 1 - Phi(z_0.99 - d) = 0.092.
    true_tpr = stats.norm.sf(stats.norm.ppf(0.99) - shift)
    low, high = result.intervals[0.01]
    assert low < true_tpr < high
    for key in ("auc", "balanced_accuracy", 0.001, 0.01):
        low, high = result.intervals[key]
        value = (result.tpr_at_fpr[key] if key in result.tpr_at_fpr
                 else getattr(result, key))
        assert low <= value <= high or key == 0.001
    assert "AUC 0.7" in result.describe()
    assert "TPR at FPR 0.1%" in result.describe()


def test_the_bootstrap_is_seeded():
    members, nonmembers = tied_scores(6)
    first = roc.evaluate_attack(members, nonmembers, num_bootstrap=50, seed=1)
    again = roc.evaluate_attack(members, nonmembers, num_bootstrap=50, seed=1)
    other = roc.evaluate_attack(members, nonmembers, num_bootstrap=50, seed=2)
    assert first.intervals == again.intervals
    assert first.intervals != other.intervals


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="member_scores"):
        roc.roc_curve([], [1.0])
    with pytest.raises(ValueError, match="nonmember_scores"):
        roc.roc_curve([1.0], [[1.0]])
    with pytest.raises(ValueError, match="nonmember_scores"):
        roc.roc_curve([1.0], [np.nan])
    with pytest.raises(ValueError, match="confidence"):
        roc.evaluate_attack([1.0], [0.0], confidence=1.0)
    with pytest.raises(ValueError, match="num_bootstrap"):
        roc.evaluate_attack([1.0], [0.0], num_bootstrap=-1)
    with pytest.raises(ValueError, match="fpr_targets"):
        roc.evaluate_attack([1.0], [0.0], fpr_targets=(2.0,))
    with pytest.raises(ValueError, match="target_fpr"):
        roc.tpr_at_fpr([0, 1], [0, 1], -0.1)
    # Was a NumPy broadcast error naming neither argument.
    with pytest.raises(ValueError, match=r"tpr='<array of shape \(2,\)>' "
                       r"to have the shape of fpr, \(3,\)"):
        roc.tpr_at_fpr([0, 0.5, 1], [0, 1], 0.1)


def test_public_names_are_documented():
    assert membership.evaluate_attack is roc.evaluate_attack
    assert membership.AttackResult is roc.AttackResult
    assert len(set(membership.__all__)) == len(membership.__all__)
    for name in membership.__all__:
        assert getattr(membership, name).__doc__, name
