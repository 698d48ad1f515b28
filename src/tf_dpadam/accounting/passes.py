"""Epsilon without amplification by subsampling: fixed batches, passes.

Amplification by subsampling needs batches drawn the way the accountant
assumes (Poisson: every example joins every step independently with
probability q, by a secret coin). Shuffled fixed-size batches, a user's
`tf.data` pipeline, a `PyDataset` or a generator have no such guarantee
(Chua et al., ICML 2024, "How Private are DP-SGD Implementations?"). Their
honest accounting takes no amplification: each step in which an example
takes part is a Gaussian mechanism on it, and a step whose clipped sum holds
the example m times (accumulation over a pass boundary) has sensitivity m C.
Gaussian mechanisms compose exactly into one Gaussian mechanism:

    noise multiplier sigma / sqrt(S),   S = sum over steps of m_s^2,

so the epsilon only needs S, an upper bound on the sum of squares of an
example's participations (`participation_bound`):

* each pass over the data holds every example at most once, P passes were
  begun in T logical steps of k physical batches (`passes_begun`); a logical
  step lies in one pass if k divides the physical batches of a pass, else
  it can span up to `ceil((k - 1) / b) + 1` passes (b physical batches per
  pass) and hold the example once from each: S <= m_max * P;
* nothing known of the passes (an infinite dataset, a generator): every
  physical batch may hold the example, S <= (k^2) T.

`GaussianDpEvent(sigma / sqrt(S))` then goes to the same accountants as the
Poisson events (RDP over `RDP_ORDERS`, or PLD), both exact for a Gaussian.
PLD's distribution grows as sigma / sqrt(S) shrinks: past
`pld.MAX_PLD_POINTS` points (sigma / sqrt(S) below about 0.0667) it
raises `pld.PLDTooLargeError` rather than take seconds and GBs.
"""

import functools
import math

from tf_dpadam.common import validation
from tf_dpadam.accounting import accountants
from tf_dpadam.accounting import pld
from tf_dpadam.accounting import search


def passes_begun(steps, batches_per_pass, accumulation_steps=1):
    """P: the passes over the data that T logical steps of k batches begin.

    Args:
        steps: T >= 0 logical steps, taken from the start of a pass.
        batches_per_pass: b > 0 physical batches in one pass.
        accumulation_steps: k >= 1 physical batches per logical step.
    """
    return math.ceil(steps * accumulation_steps / batches_per_pass)


def participation_bound(steps, batches_per_pass=None, accumulation_steps=1):
    """S >= sum over steps of m_s^2, m_s an example's copies in step s.

    Args:
        steps: T >= 0 logical steps.
        batches_per_pass: b, the physical batches of one pass (each example
            at most once per pass), or None if unknown (every physical batch
            may hold the example).
        accumulation_steps: k >= 1 physical batches per logical step.

    Returns:
        S as an int (0 for T = 0).
    """
    k = accumulation_steps
    if batches_per_pass is None:
        return k * k * steps
    passes = passes_begun(steps, batches_per_pass, k)
    if batches_per_pass % k == 0:
        return passes
    most_passes_per_step = math.ceil((k - 1) / batches_per_pass) + 1
    return min(most_passes_per_step * passes, k * k * steps)


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(noise_multiplier, delta, accountant):
    """Epsilon at `delta` of one Gaussian mechanism of multiplier sigma > 0,
    sensitivity 1, add-or-remove-one, by an `accountants.Accountant`;
    arguments not checked, cached.

    Raises:
        PLDTooLargeError: for PLD and a sigma whose distribution would
            have more than `pld.MAX_PLD_POINTS` points.
    """
    return accountant.gaussian_epsilon(noise_multiplier, delta)


def epsilon_without_amplification(
    *,
    steps: int,
    noise_multiplier: float,
    delta: float,
    batches_per_pass: int | None = None,
    accumulation_steps: int = 1,
    accountant: str = "rdp",
) -> float:
    """Epsilon of T logical steps of fixed (not Poisson-sampled) batches.

    Each pass over the data is one Gaussian mechanism per example, composed
    over the passes begun (see the module docstring for the bound used with
    accumulation, and without a known pass).

    For example, 30 steps of 3 passes (10 batches each) at sigma = 1 give
    epsilon = 8.39 at delta = 1e-5 (PLD): the Gaussian mechanism of
    multiplier 1 / sqrt(3). Poisson sampling at q = 0.1 would give 4.18.

    Args:
        steps: T >= 0 logical steps (the optimizer's iterations).
        noise_multiplier: sigma >= 0 (0 gives inf for T > 0).
        delta: in (0, 1).
        batches_per_pass: physical batches per pass, or None if unknown.
        accumulation_steps: k >= 1 physical batches per logical step.
        accountant: "rdp" or "pld" (a name in `ACCOUNTANTS`).

    Returns:
        epsilon as a float.

    Raises:
        ValueError: if an argument is out of range.
        PLDTooLargeError (a ValueError): for "pld", if sigma / sqrt(S) is
            below about 0.067 (`pld.check_pld_noise_multiplier`).
    """
    validation.check_steps(steps)
    chosen = _check_setting(noise_multiplier, delta, batches_per_pass,
                            accumulation_steps, accountant)
    bound = participation_bound(int(steps), batches_per_pass,
                                int(accumulation_steps))
    try:
        return _participations_epsilon(bound, noise_multiplier, delta,
                                       chosen)
    except pld.PLDTooLargeError as error:
        raise pld.PLDTooLargeError(
            f"Expected steps={steps!r} fewer for the PLD accountant: they are"
            f" {bound} participations of an example, one Gaussian mechanism"
            f" of noise multiplier noise_multiplier / sqrt({bound}) ="
            f" {noise_multiplier / math.sqrt(bound):.4g}, below the"
            f" {pld.smallest_pld_noise_multiplier():.4g} that"
            " the PLD accountant accounts (pld.MAX_PLD_POINTS); use"
            " accountant=\"rdp\"."
        ) from error


def _check_setting(noise_multiplier, delta, batches_per_pass,
                   accumulation_steps, accountant):
    """Checks the arguments of `epsilon_without_amplification` but T;
    returns the accountant."""
    validation.check_non_negative("noise_multiplier", noise_multiplier)
    validation.check_delta(delta)
    chosen = accountants.get_accountant(accountant)
    if batches_per_pass is not None:
        validation.check_positive_int("batches_per_pass", batches_per_pass)
    validation.check_positive_int("accumulation_steps", accumulation_steps)
    return chosen


def _participations_epsilon(participations, noise_multiplier, delta,
                            accountant):
    """Epsilon of S participations (S a bound on the sum of squares),
    arguments checked (`accountant` an `accountants.Accountant`)."""
    if participations == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return gaussian_epsilon(
        float(noise_multiplier) / math.sqrt(participations), float(delta),
        accountant)


def max_steps_without_amplification(*, target_epsilon, noise_multiplier,
                                    delta, batches_per_pass=None,
                                    accumulation_steps=1, accountant="rdp",
                                    limit=2**40):
    """The largest T <= limit with `epsilon_without_amplification(T) <= target`.

    Returns 0 if even one step exceeds the target, and `limit` if `limit`
    steps are within it. Epsilon depends on T only through the
    participations S = `participation_bound(T)`, non-decreasing in T: the
    search (`search.largest_within`) finds the largest S within the target
    (from RDP's answer for PLD, so that PLD builds a few distributions, near
    the answer), then the largest T with at most S participations, in
    integer arithmetic.

    Raises:
        ValueError: if an argument is out of range.
        PLDTooLargeError (a ValueError): for "pld", if the participations
            near the answer need a distribution of more than
            `pld.MAX_PLD_POINTS` points.
    """
    validation.check_positive_real("target_epsilon", target_epsilon)
    chosen = _check_setting(noise_multiplier, delta, batches_per_pass,
                            accumulation_steps, accountant)
    validation.check_positive_int("limit", limit)

    def participations(steps):
        return participation_bound(steps, batches_per_pass,
                                   int(accumulation_steps))

    def eps(bound, accountant=chosen):
        return _participations_epsilon(bound, noise_multiplier, delta,
                                       accountant)

    most = participations(limit)
    start = chosen.steps_guess(eps, target_epsilon, most)
    too_large = {}
    bound = search.largest_within(
        search.inf_beyond_pld_limit(eps, too_large),
        target_epsilon, cap=most, start=start)
    if bound + 1 in too_large:
        smallest = pld.smallest_pld_noise_multiplier()
        raise pld.PLDTooLargeError(
            f"target_epsilon={target_epsilon!r} allows more participations"
            " of an example (passes over the data) than the PLD accountant"
            f" accounts at noise_multiplier={noise_multiplier!r}: at most"
            f" {math.floor((noise_multiplier / smallest)**2)}, one Gaussian"
            " mechanism of noise multiplier noise_multiplier / sqrt(S) >="
            f" {smallest:.4g} (pld.MAX_PLD_POINTS); lower target_epsilon"
            " or use accountant=\"rdp\"."
        )
    return _most_steps_with(participations, bound, limit)


def _most_steps_with(participations, bound, limit):
    """The largest T in [0, limit] with participations(T) <= bound, for a
    non-decreasing `participations` with participations(0) = 0."""
    if participations(limit) <= bound:
        return limit
    low, high = 0, limit  # participations(low) <= bound < ...(high).
    while high - low > 1:
        middle = (low + high) // 2
        if participations(middle) <= bound:
            low = middle
        else:
            high = middle
    return low
