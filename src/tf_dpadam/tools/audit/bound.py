"""The one-run audit's statistics: from correct guesses to a lower bound on epsilon.

Steinke, Nasr & Jagielski (NeurIPS 2023), "Privacy Auditing with One (1)
Training Run". m canaries are each included in the training data
independently with probability 1/2; after training, the auditor makes r
guesses (included or not) and abstains on the other m - r canaries. If the
training algorithm is (epsilon, delta)-DP, the number W of correct guesses
satisfies, for every v (their Theorem 5.2),

    P[W >= v] <= P[Bin(r, p) >= v] + 2 m delta * max_{1 <= i <= v}
                 P[v - i <= Bin(r, p) < v] / i,      p = e^eps / (1 + e^eps),

i.e. W is at most as large as the number of successes of r randomized
responses at epsilon, up to a delta term. The right-hand side is a p-value
for the hypothesis "the run was (epsilon, delta)-DP"; if it is below
1 - confidence for the observed v, that hypothesis is rejected, and the
largest epsilon rejected is the audit's lower bound. With delta = 0 and
v = r it has the closed form

    epsilon = log(p / (1 - p)),    p = (1 - confidence)^(1/r).

Binomial tails here are exact sums of probabilities, computed in log space
from `math.lgamma` (no normal approximation, no SciPy).
"""

import math

from tf_dpadam.common import validation

# Bisection iterations of `epsilon_lower_bound`: the bracket [0, 2^k] halves
# each time, so the result is within 2^k / 2^60 of the supremum.
_BISECTION_STEPS = 60


def _check_counts(num_canaries, num_guesses, num_correct):
    validation.check(validation.is_int(num_canaries) and num_canaries >= 1,
                     "num_canaries", num_canaries, "to be an int >= 1")
    validation.check(
        validation.is_int(num_guesses) and 0 <= num_guesses <= num_canaries,
        "num_guesses", num_guesses,
        f"to be an int in [0, num_canaries={num_canaries}]",
    )
    validation.check(
        validation.is_int(num_correct) and 0 <= num_correct <= num_guesses,
        "num_correct", num_correct,
        f"to be an int in [0, num_guesses={num_guesses}]",
    )


def _check_delta(delta):
    validation.check(
        validation.is_real(delta) and 0 <= delta < 1, "delta", delta,
        "in [0, 1)",
    )


def _log_binomial_pmf(n, p):
    """log P[Bin(n, p) = k] for k = 0..n."""
    if p <= 0.0 or p >= 1.0:
        mass_at = 0 if p <= 0.0 else n
        return [0.0 if k == mass_at else -math.inf for k in range(n + 1)]
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n_factorial = math.lgamma(n + 1)
    return [
        log_n_factorial - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        + k * log_p + (n - k) * log_q
        for k in range(n + 1)
    ]


def _binomial_pmf(n, p):
    return [math.exp(value) for value in _log_binomial_pmf(n, p)]


def p_value(num_canaries, num_guesses, num_correct, epsilon, delta):
    """P[at least `num_correct` correct guesses] if the run was (eps, delta)-DP.

    The right-hand side of the theorem in this module's docstring, capped at
    1: P[Bin(r, p) >= v] + 2 m delta max_i P[v - i <= Bin(r, p) < v] / i with
    p = e^eps / (1 + e^eps).

    Args:
        num_canaries: m, the canaries (each included with probability 1/2).
        num_guesses: r <= m, the guesses made (the rest are abstentions).
        num_correct: v <= r, the correct guesses.
        epsilon: the epsilon of the hypothesis, >= 0 (may be inf).
        delta: the delta of the hypothesis, in [0, 1).

    Returns:
        The p-value, a float in [0, 1].
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    _check_delta(delta)
    validation.check(validation.is_real(epsilon) and epsilon >= 0,
                     "epsilon", epsilon, ">= 0")
    m, r, v = num_canaries, num_guesses, num_correct
    # p = e^eps / (1 + e^eps), the accuracy of randomized response at eps.
    p = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
    pmf = _binomial_pmf(r, p)
    tail = math.fsum(pmf[v:])  # P[Bin(r, p) >= v]
    worst = 0.0  # max over i of P[v - i <= Bin(r, p) < v] / i
    below = 0.0
    for i in range(1, v + 1):
        below += pmf[v - i]
        worst = max(worst, below / i)
    return min(1.0, tail + 2.0 * m * delta * worst)


def epsilon_lower_bound(num_canaries, num_guesses, num_correct, delta,
                        confidence=0.95):
    """The one-run audit's lower bound on epsilon (Steinke et al. 2023).

    The largest epsilon at which "the run was (epsilon, delta)-DP" is
    rejected at the given confidence, i.e. the supremum of the epsilons
    whose `p_value` is below 1 - confidence (found by bisection; the p-value
    grows with epsilon). 0.0 if even epsilon = 0 is not rejected.

    Read it as: with probability at least `confidence` over the canaries'
    inclusion coins and the training randomness, a run that is
    (epsilon, delta)-DP does not produce this many correct guesses for any
    epsilon below the returned value. A result at or below the claimed
    epsilon is consistent with the claim; it does not prove it.

    Args:
        num_canaries: m, the canaries, each included with probability 1/2.
        num_guesses: r, the guesses made (0 <= r <= m).
        num_correct: v, the correct guesses (0 <= v <= r).
        delta: the delta of the claimed guarantee, in [0, 1).
        confidence: in (0, 1); 0.95 rejects at p < 0.05.

    Returns:
        epsilon, a float >= 0.

    Raises:
        ValueError: on arguments out of range, naming the argument.
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    _check_delta(delta)
    validation.check(
        validation.is_real(confidence) and 0 < confidence < 1,
        "confidence", confidence, "in (0, 1)",
    )
    alpha = 1.0 - confidence

    def rejected(epsilon):
        return p_value(num_canaries, num_guesses, num_correct, epsilon,
                       delta) < alpha

    if not rejected(0.0):
        return 0.0
    high = 1.0
    while rejected(high):
        high *= 2.0
        if high > 1e3:  # p-values this small are below float resolution.
            return math.inf
    low = 0.0
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if rejected(middle):
            low = middle
        else:
            high = middle
    return low


def best_possible_bound(num_canaries, delta, confidence=0.95):
    """The bound if every one of the m canaries is guessed, all correctly.

    No attack on m canaries can show more (e.g. about 6 for m = 1,000 at
    delta = 1e-5): a claimed epsilon above it cannot be refuted by this
    audit, however leaky the training.
    """
    return epsilon_lower_bound(num_canaries, num_canaries, num_canaries,
                               delta, confidence)
