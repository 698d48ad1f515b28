"""Calibration: the steps a privacy budget allows, or the noise it needs.

Both are bracketed searches over `epsilon_after_steps` (PLD, discretization
1e-3, by default, or RDP over `RDP_ORDERS`): they print nothing, raise
`ValueError` when the ask is impossible, and warn once if delta >= 1 / N.
How each accountant searches is its own (`accountants.Accountant`'s
`steps_guess` and `smallest_noise_within`); the searches are in `search`.

They are bounded: `calibrate_steps` answers at most `MAX_CALIBRATED_STEPS`
steps, PLD raises `pld.PLDTooLargeError` (a `ValueError`) rather than take
more than about a second a probe, and a PLD search starts from RDP's answer
(`search`), so it probes PLD a few times: a few seconds in all.
"""

import math

from tf_dpadam.common import validation
from tf_dpadam.accounting import accountants
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import passes
from tf_dpadam.accounting import pld
from tf_dpadam.accounting import search

# The most steps `calibrate_steps` returns: a budget that allows more raises
# `ValueError`. PLD at T = 10**7 (q = 256/60000, sigma = 6) takes about
# 0.5 s and 300,000 points.
MAX_CALIBRATED_STEPS = 10**7


def calibrate_steps(
    *,
    target_epsilon: float,
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    delta: float,
    accountant: str = "pld",
    sampling: str = "poisson",
    bands: int = 1,
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
        accountant: "pld" (default) or "rdp" (a name in `ACCOUNTANTS`).
        sampling: "poisson" (default) or "shuffled".
        bands: b, the bands of a correlated `noise_strategy` (cyclic
            Poisson batches of b groups, `sampling="poisson"` only): T is
            then b times the most rounds R of DP-SGD at q = b B / N within
            the target (T steps count as ceil(T / b) = R rounds).

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
    accountants.get_accountant(accountant)  # A registered name.
    accounting_epsilon.check_sampling(sampling)
    validation.warn_large_delta(delta, num_examples)
    validation.check_positive_int("bands", bands)
    if bands > 1:
        validation.check(sampling == "poisson" and bands * batch_size
                         <= num_examples, "bands", bands,
                         "to be 1, or with sampling='poisson' and"
                         f" bands * batch_size <= num_examples={num_examples}")
        # A round samples one group at q = b B / N: DP-SGD's step at a
        # batch of b B.
        return bands * steps_within(
            target_epsilon=target_epsilon, num_examples=num_examples,
            batch_size=bands * batch_size, noise_multiplier=noise_multiplier,
            delta=delta, accountant=accountant, sampling=sampling)
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
    chosen = accountants.get_accountant(accountant)

    def eps(steps, accountant=chosen):
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
    start = chosen.steps_guess(eps, target_epsilon, MAX_CALIBRATED_STEPS)
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
    bands: int = 1,
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
        accountant: "pld" (default) or "rdp" (a name in `ACCOUNTANTS`).
        bands: b, the bands of a correlated `noise_strategy`, whose `fit`
            samples cyclic Poisson batches of b groups: then epsilon is
            that of ceil(T / b) steps at q = min(1, b B / N)
            (`epsilon.banded_dp_sgd_event`, as the ledger counts them).

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
    chosen = accountants.get_accountant(accountant)
    total = accounting_epsilon.training_steps(
        num_examples=num_examples, batch_size=batch_size, epochs=epochs,
        steps=steps,
    )
    validation.warn_large_delta(delta, num_examples)
    validation.check_positive_int("bands", bands)
    q = accounting_epsilon.cyclic_sampling_probability(
        batch_size, num_examples, bands)
    total = accounting_epsilon.cyclic_rounds(total, bands)

    def eps(noise_multiplier, accountant=chosen):
        return accounting_epsilon.epsilon_at_rate(
            q, float(noise_multiplier), int(total), float(delta), accountant)

    return chosen.smallest_noise_within(
        eps, target_epsilon, sampling_probability=q,
        setting=(f"{total} steps at batch_size={batch_size!r},"
                 f" num_examples={num_examples!r}"))
