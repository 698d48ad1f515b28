"""The PLD accountant of Poisson-sampled Gaussian steps, with bounded cost.

dp-accounting's privacy loss distribution (PLD) of
PoissonSampledDpEvent(q, GaussianDpEvent(sigma)) is built once per
(q, sigma) (`pld_one_step`) and self-composed T times (`pld_self_composed`):
the operations of its `PLDAccountant` on `dp_sgd_event(q, sigma, T)`, with
the same epsilon, bit for bit (`pld_epsilon`).

A distribution's cost grows with its points (probabilities on the grid of
`PLD_VALUE_DISCRETIZATION_INTERVAL`): T steps spread it, and a small sigma
widens even one step. Nothing here composes more than `MAX_PLD_POINTS`
points, or builds a step that would take more than about a second: it
raises `PLDTooLargeError` (a `ValueError`) first, and RDP, whose cost does
not grow, is the way out. And dp-accounting decides whether to compose a
sparse one-step distribution sparsely by computing size**T, an integer of
millions of digits for T in the millions (44 s at T = 10**7, 23.5 GB at
10**11); `pld_self_composed` composes a dense copy instead, which is what
dp-accounting then does anyway.
"""

import functools
import math

import dp_accounting
from dp_accounting.pld import common as pld_common

# Value discretization interval of the PLD accountant (see
# `tf_dpadam.accounting`).
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3

# The most points of a distribution composed here. Measured on 2 shared CPU
# cores: T steps composed into 2**19 points, and epsilon read off, take
# about 0.7 s and 40 MB (T = 10**7 at q = 256/60000, sigma = 6: 300,000
# points, 0.5 s). One step is held to fewer (`check_pld_noise_multiplier`).
MAX_PLD_POINTS = 2**19

_PLD = dp_accounting.pld.privacy_loss_distribution
_ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
# dp-accounting's default truncation of `self_compose`.
_TAIL_MASS_TRUNCATION = 1e-15
# dp-accounting composes a sparse distribution of s points sparsely only if
# s**T <= 1000, so never for T >= 10.
_FEWEST_DENSE_STEPS = 10
# dp-accounting keeps about 9.75 standard deviations on each side of a
# Gaussian; `gaussian_pld_points` assumes 10.
_GAUSSIAN_TAIL_SIGMAS = 10.0
# Building a subsampled step (q < 1) costs about 4 times as much a point
# (dp-accounting inverts its privacy loss point by point, in Python).
_SUBSAMPLED_COST = 4


class PLDTooLargeError(ValueError):
    """The PLD accountant would need more than `MAX_PLD_POINTS` points, or a
    step that takes seconds to build; the message says which argument and
    suggests the RDP accountant."""


def gaussian_pld_points(noise_multiplier):
    """About the points of one Gaussian step's PLD, without building it.

    The privacy loss of a Gaussian mechanism of multiplier sigma
    (sensitivity 1) over the 10 standard deviations kept on each side spans
    1 / sigma^2 + 20 / sigma: within 3% of dp-accounting's points (20,493 at
    sigma = 1, 294,911 at sigma = 0.1); Poisson subsampling (q < 1) about
    halves them. A float (`inf` where 1 / sigma overflows).
    """
    inverse = 1.0 / noise_multiplier
    span = inverse * inverse + 2 * _GAUSSIAN_TAIL_SIGMAS * inverse
    return span / PLD_VALUE_DISCRETIZATION_INTERVAL + 1


def _most_one_step_points(sampling_probability):
    """The most `gaussian_pld_points` of a step built here (about 1.3 s)."""
    if sampling_probability < 1:
        return MAX_PLD_POINTS // _SUBSAMPLED_COST
    return MAX_PLD_POINTS


def smallest_pld_noise_multiplier(sampling_probability=1.0):
    """The smallest sigma of a step at rate q that the PLD accountant builds
    (`check_pld_noise_multiplier`): about 0.0667 for q = 1 and 0.192 for
    q < 1."""
    # 1 / sigma = r solves r^2 + 2 k r = (points - 1) * interval.
    k = _GAUSSIAN_TAIL_SIGMAS
    area = ((_most_one_step_points(sampling_probability) - 1)
            * PLD_VALUE_DISCRETIZATION_INTERVAL)
    return 1.0 / (math.sqrt(k * k + area) - k)


def check_pld_noise_multiplier(noise_multiplier, sampling_probability=1.0):
    """Raises `PLDTooLargeError` unless sigma >=
    `smallest_pld_noise_multiplier(q)`: `gaussian_pld_points(sigma)` at most
    `MAX_PLD_POINTS` for q = 1, a quarter of it for q < 1."""
    points = gaussian_pld_points(noise_multiplier)
    if points > _most_one_step_points(sampling_probability):
        smallest = smallest_pld_noise_multiplier(sampling_probability)
        raise PLDTooLargeError(
            f"Expected noise_multiplier={noise_multiplier!r} >="
            f" {smallest:.4g} for the PLD accountant at sampling rate"
            f" q={sampling_probability:.4g}: one step's privacy loss"
            f" distribution would have about {points:,.0f} points, too many"
            f" (MAX_PLD_POINTS = {MAX_PLD_POINTS:,}); use"
            " accountant=\"rdp\"."
        )


@functools.lru_cache(maxsize=64)
def pld_one_step(q, sigma):
    """The privacy loss distribution of one Poisson-sampled Gaussian step.

    What dp-accounting's `PLDAccountant` builds for
    PoissonSampledDpEvent(q, GaussianDpEvent(sigma)): pessimistic,
    add-or-remove-one, value discretization
    `PLD_VALUE_DISCRETIZATION_INTERVAL`. Cached per (q, sigma) because
    building it is most of the cost of an epsilon (about 25 ms at sigma = 1
    and 150 ms at sigma = 0.3, q = 256/60000); the T-step distribution is
    its `self_compose(T)`, which leaves it unchanged.

    Raises:
        PLDTooLargeError: if sigma is too small
            (`check_pld_noise_multiplier`).
    """
    check_pld_noise_multiplier(sigma, q)
    return _PLD.from_gaussian_mechanism(
        standard_deviation=sigma,
        value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL,
        sampling_prob=q,
        neighboring_relation=_ADD_OR_REMOVE_ONE,
    )


@functools.lru_cache(maxsize=64)
def _dense_one_step(q, sigma):
    """`pld_one_step` with dense PMFs, exactly: its mixture with itself at
    weight 1/2 (halving and adding back a double is exact), dp-accounting's
    public way to a dense copy."""
    one_step = pld_one_step(q, sigma)
    return one_step.compute_mixture(one_step, 0.5)


def _probabilities(dense_pld):
    """The probability arrays of a dense PLD's remove and add PMFs.

    dp-accounting has no public accessor: these are its attributes
    `_pmf_remove`, `_pmf_add` and `_probs` (0.4 to 0.6), read only to
    predict a composition's size; `tf_dpadam.common.compat`, the home of private
    Keras and TensorFlow APIs, imports TensorFlow, which the accounting does
    not.
    """
    pmfs = (getattr(dense_pld, "_pmf_remove"), getattr(dense_pld, "_pmf_add"))
    return [getattr(pmf, "_probs") for pmf in pmfs]


def pld_points(q, sigma, steps):
    """The points of the dense PLD of T steps (its larger PMF), without
    composing it: the bounds to which dp-accounting's `self_convolve`
    truncates (Chernoff bounds at tail mass 1e-15). Builds one step."""
    points = 0
    for probs in _probabilities(_dense_one_step(q, sigma)):
        lower, upper = pld_common.compute_self_convolve_bounds(
            probs, steps, _TAIL_MASS_TRUNCATION)
        points = max(points, upper - lower + 1, len(probs))
    return points


def pld_self_composed(q, sigma, steps):
    """`pld_one_step(q, sigma).self_compose(T)` for T >= 1, bit for bit, but
    bounded: no size**T, and `PLDTooLargeError` rather than a result of more
    than `MAX_PLD_POINTS` points. Arguments not checked."""
    if steps > 1 and (points := pld_points(q, sigma, steps)) > MAX_PLD_POINTS:
        raise PLDTooLargeError(
            f"Expected steps={steps!r} few enough for the PLD accountant"
            f" (sampling rate q={q:.4g}, noise_multiplier={sigma!r}): their"
            f" privacy loss distribution would have {points:,} points, more"
            f" than MAX_PLD_POINTS = {MAX_PLD_POINTS:,}; use"
            " accountant=\"rdp\" or fewer steps."
        )
    if steps < _FEWEST_DENSE_STEPS:  # Perhaps sparse: dp-accounting's way.
        return pld_one_step(q, sigma).self_compose(steps,
                                                   _TAIL_MASS_TRUNCATION)
    return _dense_one_step(q, sigma).self_compose(steps,
                                                  _TAIL_MASS_TRUNCATION)


def pld_epsilon(q, sigma, steps, delta):
    """PLD epsilon of T >= 1 steps at rate q (sigma > 0); not checked.

    `pld_self_composed` composed with the identity distribution, exactly the
    operations of `PLDAccountant` on `dp_sgd_event(q, sigma, T)`: the same
    epsilon, bit for bit, without building the one-step distribution again.
    At most about a second (0.5 s at T = 10**7, q = 256/60000, sigma = 6).

    Raises:
        PLDTooLargeError: if one step, or T steps, would be too large.
    """
    pld = _PLD.identity(
        value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL
    ).compose(pld_self_composed(q, sigma, steps))
    return float(pld.get_epsilon_for_delta(delta))
