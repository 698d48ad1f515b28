"""The search the calibrations share: few evaluations, near the answer.

`largest_within` finds the largest integer T (steps, or participations) whose
epsilon stays within a budget. A PLD evaluation costs up to about a second
(`tf_dpadam.accounting.pld`), so the search starts from a guess (RDP's
answer: microseconds a probe), steps away from it by growing factors, and
narrows its bracket by interpolation: 3 to 8 evaluations from a guess within
a factor 4, and never more than about 2 log2 of the bracket.
`inf_beyond_pld_limit` lets it run into PLD's size limit without stopping.

The noise multiplier's searches (`calibrate_noise_multiplier`, which each
accountant runs its own way, `tf_dpadam.accounting.accountants`):
`halving_noise_search` bisects from sigma = 1 (RDP), and
`smallest_noise_within` steps away from a guess and interpolates (PLD, from
RDP's answer), both within [`MIN_NOISE_MULTIPLIER`, `MAX_NOISE_MULTIPLIER`]
to a relative `NOISE_MULTIPLIER_RTOL`.
"""

import math

from tf_dpadam.accounting import pld

# The first step from the start, a factor (squared at each further step).
_FIRST_FACTOR = 1.25
# `calibrate_noise_multiplier` searches sigma in this range.
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e6
# `calibrate_noise_multiplier` returns sigma within this relative tolerance;
# `smallest_noise_within`'s first step from a guess is this factor.
NOISE_MULTIPLIER_RTOL = 0.01
_FIRST_NOISE_FACTOR = 1.1


def largest_within(epsilon_of, target, *, cap, start=1):
    """The largest T in [0, cap] with epsilon_of(T) <= target.

    For a non-decreasing `epsilon_of` on the integers with epsilon_of(0) = 0
    (never evaluated). The answer T < cap comes with both sides evaluated,

        epsilon_of(T) <= target < epsilon_of(T + 1)

    (only the right one for T = 0), and cap with epsilon_of(cap) <= target.

    The search probes `start`, steps up or down from it by factors 1.25,
    1.56, 2.44, 5.96, ... to a bracket, and narrows the bracket by
    interpolating log epsilon linearly in log T (regula falsi, with the
    Illinois modification), bisecting whenever two probes did not halve it.

    Args:
        epsilon_of: T -> epsilon, for integers 1 <= T <= cap.
        target: The budget epsilon > 0.
        cap: The largest T searched, >= 1.
        start: Where the search begins (clipped to [1, cap]).

    Returns:
        T as an int in [0, cap].
    """
    t = min(max(int(start), 1), cap)
    factor = _FIRST_FACTOR
    low = high = None
    e = epsilon_of(t)
    if e <= target:
        low, e_low = t, e
        while high is None:
            if low == cap:
                return cap
            t = min(max(math.floor(low * factor), low + 1), cap)
            factor *= factor
            e = epsilon_of(t)
            if e <= target:
                low, e_low = t, e
            else:
                high, e_high = t, e
    else:
        high, e_high = t, e
        while low is None:
            if high == 1:
                return 0
            t = max(min(math.floor(high / factor), high - 1), 1)
            factor *= factor
            e = epsilon_of(t)
            if e <= target:
                low, e_low = t, e
            else:
                high, e_high = t, e
    return _narrow(epsilon_of, target, (low, e_low), (high, e_high))


def inf_beyond_pld_limit(epsilon_of, failures):
    """`epsilon_of` with `inf` where it raises `pld.PLDTooLargeError`.

    A probe past PLD's limit then reads as over any target, so a search
    narrows to the limit instead of stopping at the first probe past it
    (e.g. a step up overshooting), and `failures` (a dict) keeps the error
    of each such argument, for the message if the answer borders on one.
    """
    def wrapped(argument):
        try:
            return epsilon_of(argument)
        except pld.PLDTooLargeError as error:
            failures[argument] = error
            return math.inf
    return wrapped


def _narrow(epsilon_of, target, low, high):
    """`largest_within`'s bracket of (T, epsilon) pairs, `low` within the
    target and `high` above it, narrowed to adjacent T; returns low's T."""
    (low, e_low), (high, e_high) = low, high
    f_low, f_high = log_ratio(e_low, target), log_ratio(e_high, target)
    moved = None  # Which end the last probe moved.
    widths = [math.inf, math.inf]  # The bracket's before the last 2 probes.
    while high - low > 1:
        guess = None
        if high - low <= widths[0] / 2:
            guess = _interpolate(low, f_low, high, f_high)
        t = (low + high) // 2 if guess is None else guess
        t = min(max(t, low + 1), high - 1)
        widths = [widths[1], high - low]
        e = epsilon_of(t)
        if e <= target:
            low, f_low = t, log_ratio(e, target)
            if moved == "low" and f_high is not None:
                f_high /= 2  # Illinois: pull the guess towards high.
            moved = "low"
        else:
            high, f_high = t, log_ratio(e, target)
            if moved == "high" and f_low is not None:
                f_low /= 2
            moved = "high"
    return low


def log_ratio(epsilon, target):
    """log(epsilon / target), or None where it is not finite."""
    if not 0 < epsilon < math.inf:
        return None
    return math.log(epsilon) - math.log(target)


def _interpolate(low, f_low, high, f_high):
    """Where the line through (log low, f_low) and (log high, f_high)
    crosses 0, as the integer T below it; None without finite ends."""
    if f_low is None or f_high is None or not f_low <= 0 < f_high:
        return None
    x_low, x_high = math.log(low), math.log(high)
    x = x_low + (x_high - x_low) * (-f_low) / (f_high - f_low)
    return math.floor(math.exp(x))


def halving_noise_search(epsilon_of, target, *, lowest, highest, rtol):
    """The smallest-noise search of `calibrate_noise_multiplier` for a cheap
    accountant (RDP's, `accountants.Accountant.smallest_noise_within`).

    From sigma = 1 it doubles (or halves) sigma to a bracket
    epsilon_of(low) > target >= epsilon_of(high), then bisects it
    geometrically until high <= low * (1 + rtol), and returns high. (RDP
    probes cost microseconds; the recorded studies' sigmas were calibrated
    so, and reading them back needs the same numbers.)

    Raises:
        ValueError: if sigma would have to lie outside [lowest, highest].
    """
    high = 1.0
    if epsilon_of(high) > target:
        low = high
        while epsilon_of(high) > target:
            low, high = high, 2 * high
            if high > highest:
                raise ValueError(f"target_epsilon={target!r} needs"
                                 f" noise_multiplier > {highest!r}.")
    else:
        low = high / 2
        while epsilon_of(low) <= target:
            low, high = low / 2, low
            if low < lowest:
                raise ValueError(
                    f"target_epsilon={target!r} is met by every"
                    f" noise_multiplier >= {high!r}; the search gives up"
                    " there.")
    while high > low * (1 + rtol):
        middle = math.sqrt(low * high)
        if epsilon_of(middle) <= target:
            high = middle
        else:
            low = middle
    return high


def smallest_noise_within(eps, target_epsilon, start,
                          smallest=MIN_NOISE_MULTIPLIER):
    """(sigma, low): sigma with eps(sigma) <= target < eps(low), low >=
    sigma / (1 + rtol), searched in [smallest, 1e6] from `start`
    (`calibrate_noise_multiplier`); (smallest, None) if `smallest` meets
    the target.

    Raises:
        ValueError: if 1e6 does not meet the target.
    """
    # Invariant once bracketed: eps(low) > target >= eps(high). The steps
    # from `start` grow (x1.1, x1.21, x1.46, x2.1, ...): the answer is
    # usually near a guess, and a PLD probe costs more the smaller sigma.
    sigma = min(max(start, smallest), MAX_NOISE_MULTIPLIER)
    factor = _FIRST_NOISE_FACTOR
    e = eps(sigma)
    if e > target_epsilon:
        low, e_low = sigma, e
        while True:
            if low >= MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon!r} needs"
                    f" noise_multiplier > {MAX_NOISE_MULTIPLIER!r}."
                )
            sigma, factor = min(low * factor, MAX_NOISE_MULTIPLIER), factor**2
            e = eps(sigma)
            if e <= target_epsilon:
                high, e_high = sigma, e
                break
            low, e_low = sigma, e
    else:
        high, e_high = sigma, e
        while True:
            if high <= smallest:
                return high, None
            sigma, factor = max(high / factor, smallest), factor**2
            e = eps(sigma)
            if e > target_epsilon:
                low, e_low = sigma, e
                break
            high, e_high = sigma, e
    return _narrow_noise(eps, target_epsilon, (low, e_low), (high, e_high))


def _narrow_noise(eps, target_epsilon, low, high):
    """The bracket (sigma, epsilon) pairs `low` (above the target) and
    `high` (within it) narrowed to a ratio of 1 + rtol; returns the sigmas
    (high, low).

    Works on x = log sigma: interpolates log epsilon linearly in x (regula
    falsi, Illinois modification), aims a third of the tolerance past the
    crossing towards the farther end, so that the next probe can close the
    bracket, and bisects whenever two probes did not halve it.
    """
    gap = math.log1p(NOISE_MULTIPLIER_RTOL)
    x_low, x_high = math.log(low[0]), math.log(high[0])
    f_low = log_ratio(low[1], target_epsilon)
    f_high = log_ratio(high[1], target_epsilon)
    sigma_low, sigma_high = low[0], high[0]
    moved = None
    widths = [math.inf, math.inf]  # The bracket's before the last 2 probes.
    while sigma_high > sigma_low * (1 + NOISE_MULTIPLIER_RTOL):
        width = x_high - x_low
        x = (x_low + x_high) / 2
        if width > 2 * gap and width <= widths[0] / 2:
            crossing = _crossing(x_low, f_low, x_high, f_high)
            if crossing is not None:
                towards_high = crossing - x_low < x_high - crossing
                x = crossing + (gap / 3 if towards_high else -gap / 3)
                x = min(max(x, x_low + gap / 2), x_high - gap / 2)
        widths = [widths[1], width]
        sigma = math.exp(x)
        e = eps(sigma)
        f = log_ratio(e, target_epsilon)
        if e > target_epsilon:
            x_low, f_low, sigma_low = x, f, sigma
            if moved == "low" and f_high is not None:
                f_high /= 2  # Illinois: pull the crossing towards high.
            moved = "low"
        else:
            x_high, f_high, sigma_high = x, f, sigma
            if moved == "high" and f_low is not None:
                f_low /= 2
            moved = "high"
    return sigma_high, sigma_low


def _crossing(x_low, f_low, x_high, f_high):
    """Where the line through (x_low, f_low > 0) and (x_high, f_high <= 0)
    crosses 0; None without finite ends."""
    if f_low is None or f_high is None or not f_high <= 0 < f_low:
        return None
    return x_low + (x_high - x_low) * f_low / (f_low - f_high)
