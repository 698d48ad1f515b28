"""Tests of tf_dpadam.audit.bound against independent computations.

The independent references: SciPy's binomial distribution (a different
implementation of the same tails), the closed form for delta = 0 and all
guesses correct, and a Monte Carlo check that the bound is valid (a run that
is exactly eps-DP randomized response exceeds eps at most 5% of the time).
"""

import inspect
import math

import numpy as np
import pytest
from scipy import stats

import tf_dpadam
from tf_dpadam.tools import audit


def scipy_p_value(m, r, v, eps, delta):
    """The theorem's right-hand side, written with SciPy's binomial."""
    p = math.exp(eps) / (1 + math.exp(eps))
    tail = stats.binom.sf(v - 1, r, p)  # P[Bin >= v]
    ratios = [
        (stats.binom.cdf(v - 1, r, p) - stats.binom.cdf(v - i - 1, r, p)) / i
        for i in range(1, v + 1)
    ]
    return min(1.0, tail + 2 * m * delta * max(ratios, default=0.0))


def test_signature_is_exactly_the_documented_one():
    signature = inspect.signature(tf_dpadam.audit.epsilon_lower_bound)
    assert list(signature.parameters) == [
        "num_canaries", "num_guesses", "num_correct", "delta", "confidence"]
    assert signature.parameters["confidence"].default == 0.95


@pytest.mark.parametrize("m, r, v, eps, delta", [
    (1000, 200, 150, 0.5, 1e-5),
    (1000, 200, 150, 1.5, 1e-5),
    (1000, 1000, 1000, 5.0, 1e-5),
    (500, 100, 60, 0.0, 1e-3),
    (100, 40, 39, 3.0, 0.0),
    (2000, 300, 250, 2.2, 1e-6),
    (10, 10, 5, 1.0, 1e-2),
])
def test_p_value_matches_scipy(m, r, v, eps, delta):
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(
        scipy_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("r", [1, 10, 100, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_closed_form_without_delta(r, confidence):
    # delta = 0, all r guesses right: P[Bin(r, p) = r] = p^r = 1 - confidence.
    p = (1 - confidence) ** (1 / r)
    expected = max(0.0, math.log(p / (1 - p)))  # one guess shows nothing
    assert audit.epsilon_lower_bound(r, r, r, 0.0, confidence) == (
        pytest.approx(expected, abs=1e-9))


@pytest.mark.parametrize("m, r, v, delta", [
    (1000, 200, 150, 1e-5), (1000, 200, 190, 1e-5), (1000, 100, 99, 1e-5),
    (1000, 1000, 600, 1e-5), (300, 300, 280, 1e-4), (1000, 600, 600, 1e-5),
])
def test_bound_is_where_scipy_p_value_crosses_alpha(m, r, v, delta):
    bound = audit.epsilon_lower_bound(m, r, v, delta)
    assert bound > 0
    assert scipy_p_value(m, r, v, bound - 1e-6, delta) < 0.05
    assert scipy_p_value(m, r, v, bound + 1e-6, delta) >= 0.05


def test_a_perfect_attack_on_1000_canaries_shows_about_6():
    best = audit.best_possible_bound(1000, 1e-5)
    assert 5.7 < best < 5.9  # the "about 6"
    assert best == audit.epsilon_lower_bound(1000, 1000, 1000, 1e-5)
    assert audit.best_possible_bound(10000, 1e-5) > best


def test_bound_is_zero_when_guesses_are_no_better_than_chance():
    assert audit.epsilon_lower_bound(1000, 200, 100, 1e-5) == 0.0
    assert audit.epsilon_lower_bound(1000, 200, 110, 1e-5) == 0.0
    assert audit.epsilon_lower_bound(1000, 0, 0, 1e-5) == 0.0


def test_bound_grows_with_correct_guesses_and_shrinks_with_delta():
    bounds = [audit.epsilon_lower_bound(1000, 200, v, 1e-5)
              for v in (130, 150, 170, 190, 200)]
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert (audit.epsilon_lower_bound(1000, 200, 190, 1e-3)
            < audit.epsilon_lower_bound(1000, 200, 190, 1e-5)
            <= audit.epsilon_lower_bound(1000, 200, 190, 0.0))
    assert (audit.epsilon_lower_bound(1000, 200, 190, 1e-5, 0.99)
            < audit.epsilon_lower_bound(1000, 200, 190, 1e-5, 0.9))


@pytest.mark.slow
def test_bound_is_valid_for_randomized_response():
    # An exactly eps-DP "training run": each of the r guesses is right with
    # probability e^eps / (1 + e^eps), independently. The 95% bound may
    # exceed eps in at most 5% of runs; over 400 runs the count of
    # exceedances is below 20 + 4 standard deviations (4 * 4.4) but for a
    # broken bound (e.g. one computed at 50% confidence) it is not.
    eps, r, runs = 1.0, 200, 400
    rng = np.random.default_rng(0)
    correct = rng.binomial(r, math.exp(eps) / (1 + math.exp(eps)), runs)
    exceed = sum(audit.epsilon_lower_bound(r, r, int(v), 0.0) > eps
                 for v in correct)
    assert exceed <= 20 + 4 * math.sqrt(runs * 0.05 * 0.95)
    loose = sum(audit.epsilon_lower_bound(r, r, int(v), 0.0, 0.5) > eps
                for v in correct)
    assert loose > 20 + 4 * math.sqrt(runs * 0.05 * 0.95)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_canaries=0, num_guesses=0, num_correct=0), "num_canaries"),
    (dict(num_canaries=10, num_guesses=11, num_correct=0), "num_guesses"),
    (dict(num_canaries=10, num_guesses=5, num_correct=6), "num_correct"),
    (dict(num_canaries=10, num_guesses=5, num_correct=2.5), "num_correct"),
    (dict(num_canaries=10, num_guesses=5, num_correct=5, delta=1.0), "delta"),
    (dict(num_canaries=10, num_guesses=5, num_correct=5, confidence=1.0),
     "confidence"),
])
def test_bad_arguments_are_named(kwargs, name):
    kwargs = {"delta": 1e-5, **kwargs}
    with pytest.raises(ValueError, match=f"Expected {name}="):
        audit.epsilon_lower_bound(**kwargs)
