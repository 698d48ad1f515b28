"""Calibration: the steps a privacy budget allows, or the noise it needs.

Both are bracketed searches over `epsilon_after_steps` (PLD, discretization
1e-3, by default, or RDP over `RDP_ORDERS`): they print nothing, raise
`ValueError` when the ask is impossible, and warn once if delta >= 1 / N.

They are bounded: `calibrate_steps` answers at most `MAX_CALIBRATED_STEPS`
steps, PLD raises `pld.PLDTooLargeError` (a `ValueError`) rather than take
more than about a second a probe, and a PLD search starts from RDP's answer
(`search`), so it probes PLD a few times: a few seconds in all.
"""

import math

from tf_dpadam.common import validation
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import passes
from tf_dpadam.accounting import pld
from tf_dpadam.accounting import search

# The most steps `calibrate_steps` returns: a budget that allows more raises
# `ValueError`. PLD at T = 10**7 (q = 256/60000, sigma = 6) takes about
# 0.5 s and 300,000 points.
MAX_CALIBRATED_STEPS = 10**7
# `calibrate_noise_multiplier` searches sigma in this range.
_MIN_NOISE_MULTIPLIER = 1e-3
_MAX_NOISE_MULTIPLIER = 1e6
# `calibrate_noise_multiplier` returns sigma within this relative tolerance;
# its first step from a guess is this factor.
_NOISE_MULTIPLIER_RTOL = 0.01
_FIRST_NOISE_FACTOR = 1.1


def calibrate_steps(
    *,
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    delta: float,
    accountant: str = "pld",
    sampling: str = "poisson",
) -> int:
    """The largest number of steps T whose epsilon stays within the target.

    `sampling="poisson"` (default) assumes Poisson sampling at
    q = batch_size / num_examples (tf_dpadam's Poisson batches, the default
    of a private model's `fit` on in-memory data). `sampling="shuffled"`:
    shuffled fixed batches of batch_size, without amplification (each pass
    of ceil(N / B) steps one Gaussian mechanism per example,
    `tf_dpadam.accounting.passes`).

    Returns T >= 1 with

        epsilon(T) <= target_epsilon < epsilon(T + 1),

    where epsilon(T) is `epsilon_after_steps(steps=T, ...)` (so PLD with
    value discretization 1e-3, or RDP over `RDP_ORDERS`), and
    T <= `MAX_CALIBRATED_STEPS` (10**7). The search
    (`search.largest_within`; for PLD from RDP's answer) brackets T and
    narrows the bracket by interpolation; both sides of the returned bracket
    are evaluated, so the inequality above holds exactly. Since epsilon(T)
    is non-decreasing in T (exactly for RDP, whose curve is linear in T), T
    is the largest such integer.

    Args:
        target_epsilon: Privacy budget epsilon > 0.
        num_examples: N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        noise_multiplier: sigma > 0.
        delta: Target delta in (0, 1).
        accountant: "pld" (default) or "rdp".
        sampling: "poisson" (default) or "shuffled".

    Returns:
        T as an int.

    Warns:
        LargeDeltaWarning (a UserWarning): if delta >= 1 / num_examples.

    Raises:
        ValueError: if an argument is out of range, if even one step exceeds
            the target (the message gives epsilon(1), the smallest epsilon of
            any training), or if the target allows `MAX_CALIBRATED_STEPS`
            steps or more.
        PLDTooLargeError (a ValueError): with the PLD accountant, if the
            steps near the answer, or one step at this noise_multiplier,
            need a distribution of more than `pld.MAX_PLD_POINTS` points
            (use accountant="rdp").
    """
    validation.check_positive_real("target_epsilon", target_epsilon)
    validation.check_sizes("num_examples", num_examples, batch_size)
    validation.check_positive_real("noise_multiplier", noise_multiplier)
    validation.check_delta(delta)
    validation.check_accountant(accountant)
    accounting_epsilon.check_sampling(sampling)
    validation.warn_large_delta(delta, num_examples)
    return steps_within(
        target_epsilon=target_epsilon, num_examples=num_examples,
        batch_size=batch_size, noise_multiplier=noise_multiplier,
        delta=delta, accountant=accountant, sampling=sampling)


def steps_within(*, target_epsilon, num_examples, batch_size,
                 noise_multiplier, delta, accountant, sampling="poisson"):
    """`calibrate_steps` on checked arguments, without the delta warning
    (for callers that warn once themselves, e.g. `PrivacyBudget`)."""
    if sampling == "shuffled":
        return _shuffled_steps_within(
            target_epsilon=target_epsilon, num_examples=num_examples,
            batch_size=batch_size, noise_multiplier=noise_multiplier,
            delta=delta, accountant=accountant)
    q = batch_size / num_examples

    def eps(steps, accountant=accountant):
        return accounting_epsilon.epsilon_at_rate(
            q, float(noise_multiplier), steps, float(delta), accountant)

    smallest = eps(steps=1)
    setting = (f"noise_multiplier={noise_multiplier!r},"
               f" batch_size={batch_size!r}, num_examples={num_examples!r}"
               f" and delta={delta!r}")
    if smallest > target_epsilon:
        raise ValueError(
            f"Expected target_epsilon={target_epsilon!r} >= {smallest!r}, the"
            " epsilon of a single step (the smallest epsilon reachable with"
            f" {setting})."
        )
    start = 1
    if accountant == "pld":  # RDP's answer, a guess for PLD's.
        start = search.largest_within(
            lambda steps: eps(steps, "rdp"), target_epsilon,
            cap=MAX_CALIBRATED_STEPS)
    too_large = {}
    steps = search.largest_within(
        search.inf_beyond_pld_limit(eps, too_large),
        target_epsilon, cap=MAX_CALIBRATED_STEPS, start=start)
    if steps + 1 in too_large:
        raise pld.PLDTooLargeError(
            f"target_epsilon={target_epsilon!r} allows more than the"
            f" {steps} steps that the PLD accountant can account with"
            f" {setting}: {too_large[steps + 1]}"
        )
    if steps == MAX_CALIBRATED_STEPS:
        raise ValueError(_too_many_steps_message(
            target_epsilon, eps(MAX_CALIBRATED_STEPS), setting))
    return steps


def _shuffled_steps_within(*, target_epsilon, num_examples, batch_size,
                           noise_multiplier, delta, accountant):
    """`steps_within` for shuffled fixed batches (no amplification)."""
    batches_per_pass = math.ceil(num_examples / batch_size)
    setting = (f"noise_multiplier={noise_multiplier!r}, {batches_per_pass}"
               f" batches a pass and delta={delta!r}")
    steps = passes.max_steps_without_amplification(
        target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
        delta=delta, accountant=accountant,
        batches_per_pass=batches_per_pass, limit=MAX_CALIBRATED_STEPS)
    if steps == 0:
        raise ValueError(
            f"Expected target_epsilon={target_epsilon!r} >= the epsilon"
            " of a single pass of shuffled fixed batches without"
            " amplification (noise_multiplier="
            f"{noise_multiplier!r}, delta={delta!r})."
        )
    if steps == MAX_CALIBRATED_STEPS:
        raise ValueError(_too_many_steps_message(
            target_epsilon, passes.epsilon_without_amplification(
                steps=steps, noise_multiplier=noise_multiplier, delta=delta,
                batches_per_pass=batches_per_pass, accountant=accountant),
            setting))
    return steps


def _too_many_steps_message(target_epsilon, epsilon, setting):
    """Says that `target_epsilon` allows `MAX_CALIBRATED_STEPS` steps or
    more (`epsilon`: the epsilon after that many)."""
    return (
        f"target_epsilon={target_epsilon!r} allows"
        f" {MAX_CALIBRATED_STEPS:,} steps or more (epsilon after"
        f" {MAX_CALIBRATED_STEPS:,} steps is {epsilon:.4g} with {setting}),"
        " the most calibrate_steps returns (MAX_CALIBRATED_STEPS); lower"
        " target_epsilon or noise_multiplier, or choose the number of steps"
        " yourself."
    )


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    epochs: float | None = None,
    steps: int | None = None,
    delta: float,
    accountant: str = "pld",
) -> float:
    """The smallest noise multiplier (within 1%) that meets the target.

    With T = `steps`, or T = ceil(epochs * N / B), returns sigma with

        epsilon(sigma) <= target_epsilon < epsilon(sigma / 1.01),

    where epsilon(sigma) is `epsilon_after_steps(steps=T, ...)` (PLD with
    value discretization 1e-3, or RDP over `RDP_ORDERS`). The search brackets
    sigma by doubling or halving from 1 and bisects it geometrically (RDP,
    `search.halving_noise_search`), or from RDP's answer and narrows it
    interpolating log epsilon linearly in log sigma (PLD), until its ends
    are within 1% of each other; it returns the upper end, so the target is
    met. Since epsilon decreases with sigma, any sigma <= 0.99 * result
    misses the target. Every PLD probe builds a distribution (up to a few
    seconds at the smallest sigma PLD accepts); starting from RDP's answer,
    PLD is probed a few times.

    Args:
        target_epsilon: Privacy budget epsilon > 0.
        num_examples: N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        epochs: Number of epochs E > 0; exactly one of `epochs` and `steps`.
        steps: Number of steps T > 0; exactly one of `epochs` and `steps`.
        delta: Target delta in (0, 1).
        accountant: "pld" (default) or "rdp".

    Returns:
        sigma as a float.

    Warns:
        LargeDeltaWarning (a UserWarning): if delta >= 1 / num_examples.

    Raises:
        ValueError: if an argument is out of range, if not exactly one of
            `epochs` and `steps` is given, or if sigma would have to lie
            outside [1e-3, 1e6].
        PLDTooLargeError (a ValueError): with the PLD accountant, if sigma
            near the answer is too small for it
            (`pld.check_pld_noise_multiplier`), or the steps too many at
            that sigma (more than `pld.MAX_PLD_POINTS` points; use
            accountant="rdp").
    """
    validation.check_positive_real("target_epsilon", target_epsilon)
    validation.check_sizes("num_examples", num_examples, batch_size)
    validation.check_delta(delta)
    validation.check_accountant(accountant)
    total = accounting_epsilon.training_steps(
        num_examples=num_examples, batch_size=batch_size, epochs=epochs,
        steps=steps,
    )
    validation.warn_large_delta(delta, num_examples)
    q = batch_size / num_examples

    def eps(noise_multiplier, accountant=accountant):
        return accounting_epsilon.epsilon_at_rate(
            q, float(noise_multiplier), int(total), float(delta), accountant)

    if accountant == "rdp":
        return search.halving_noise_search(
            eps, target_epsilon, lowest=_MIN_NOISE_MULTIPLIER,
            highest=_MAX_NOISE_MULTIPLIER, rtol=_NOISE_MULTIPLIER_RTOL)
    # PLD: RDP's answer is a guess for PLD's; PLD builds no step below
    # `smallest`.
    start, smallest = 1.0, _MIN_NOISE_MULTIPLIER
    try:
        start = _smallest_noise_within(
            lambda sigma: eps(sigma, "rdp"), target_epsilon, start)[0]
    except ValueError:
        pass  # PLD's search says why, from 1.
    smallest = max(smallest, pld.smallest_pld_noise_multiplier(q))
    setting = (f"{total} steps at batch_size={batch_size!r},"
               f" num_examples={num_examples!r}")
    # Where PLD cannot account RDP's answer, it cannot account its own (as
    # small or a little larger) without many probes, each building a
    # distribution: say so at once.
    start = max(start, smallest)
    try:
        eps(start)
    except pld.PLDTooLargeError as error:
        raise pld.PLDTooLargeError(
            f"target_epsilon={target_epsilon!r} over {setting} needs a"
            f" noise multiplier near {start:.4g} (RDP's), which the PLD"
            f" accountant cannot account: {error}"
        ) from error
    too_large = {}
    sigma, below = _smallest_noise_within(
        search.inf_beyond_pld_limit(eps, too_large),
        target_epsilon, start, smallest)
    if below is None and smallest > _MIN_NOISE_MULTIPLIER:
        raise pld.PLDTooLargeError(
            f"target_epsilon={target_epsilon!r} is met by"
            f" noise_multiplier={sigma!r}, the smallest that the PLD"
            f" accountant accounts ({setting}); use accountant=\"rdp\" for"
            " a smaller one."
        )
    if below is None:
        raise ValueError(
            f"target_epsilon={target_epsilon!r} is met by every"
            f" noise_multiplier >= {sigma!r}; the search gives up there."
        )
    if below in too_large:
        raise pld.PLDTooLargeError(
            f"target_epsilon={target_epsilon!r} over {setting} needs a"
            " noise multiplier that the PLD accountant cannot account:"
            f" {too_large[below]}"
        )
    return sigma


def _smallest_noise_within(eps, target_epsilon, start,
                           smallest=_MIN_NOISE_MULTIPLIER):
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
    sigma = min(max(start, smallest), _MAX_NOISE_MULTIPLIER)
    factor = _FIRST_NOISE_FACTOR
    e = eps(sigma)
    if e > target_epsilon:
        low, e_low = sigma, e
        while True:
            if low >= _MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon!r} needs"
                    f" noise_multiplier > {_MAX_NOISE_MULTIPLIER!r}."
                )
            sigma, factor = min(low * factor, _MAX_NOISE_MULTIPLIER), factor**2
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
    gap = math.log1p(_NOISE_MULTIPLIER_RTOL)
    x_low, x_high = math.log(low[0]), math.log(high[0])
    f_low = search.log_ratio(low[1], target_epsilon)
    f_high = search.log_ratio(high[1], target_epsilon)
    sigma_low, sigma_high = low[0], high[0]
    moved = None
    widths = [math.inf, math.inf]  # The bracket's before the last 2 probes.
    while sigma_high > sigma_low * (1 + _NOISE_MULTIPLIER_RTOL):
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
        f = search.log_ratio(e, target_epsilon)
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
