"""Calibration: the steps a privacy budget allows, or the noise it needs.

Both are bracketed searches over `epsilon_after_steps` (PLD with value
discretization 1e-3 by default, or RDP over `RDP_ORDERS`): they print nothing
and raise `ValueError` when the ask is impossible. Each warns once
(`validation.LargeDeltaWarning`) if delta >= 1 / N, not at every probe.
"""

import math

from tf_dpadam import validation
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import passes

# The searches give up past these bounds (see `calibrate_steps` and
# `calibrate_noise_multiplier`).
_MAX_STEPS = 2**40
_MIN_NOISE_MULTIPLIER = 1e-3
_MAX_NOISE_MULTIPLIER = 1e6
# `calibrate_noise_multiplier` returns sigma within this relative tolerance.
_NOISE_MULTIPLIER_RTOL = 0.01


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
    value discretization 1e-3, or RDP over `RDP_ORDERS`). The search first
    doubles T from 1 until epsilon(T) exceeds the target and then bisects the
    bracket [T, 2T]; both sides of the returned bracket are evaluated, so the
    inequality above holds exactly. Since epsilon(T) is non-decreasing in T
    (exactly for RDP, whose curve is linear in T), T is the largest such
    integer.

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
            any training), or if epsilon stays within the target for 2**40
            steps.
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
        steps = passes.max_steps_without_amplification(
            target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
            delta=delta, accountant=accountant,
            batches_per_pass=math.ceil(num_examples / batch_size))
        if steps == 0:
            raise ValueError(
                f"Expected target_epsilon={target_epsilon!r} >= the epsilon"
                " of a single pass of shuffled fixed batches without"
                " amplification (noise_multiplier="
                f"{noise_multiplier!r}, delta={delta!r})."
            )
        return steps
    q = batch_size / num_examples

    def eps(steps):
        return accounting_epsilon.epsilon_at_rate(
            q, float(noise_multiplier), steps, float(delta), accountant)

    smallest = eps(steps=1)
    if smallest > target_epsilon:
        raise ValueError(
            f"Expected target_epsilon={target_epsilon!r} >= {smallest!r}, the"
            " epsilon of a single step (the smallest epsilon reachable with"
            f" noise_multiplier={noise_multiplier!r},"
            f" batch_size={batch_size!r}, num_examples={num_examples!r} and"
            f" delta={delta!r})."
        )
    low, high = 1, 2  # Invariant: eps(low) <= target < eps(high).
    while eps(steps=high) <= target_epsilon:
        low, high = high, 2 * high
        if high > _MAX_STEPS:
            raise ValueError(
                f"epsilon stays <= target_epsilon={target_epsilon!r} for"
                f" {low} steps; the search gives up there."
            )
    while high - low > 1:
        middle = (low + high) // 2
        if eps(steps=middle) <= target_epsilon:
            low = middle
        else:
            high = middle
    return low


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
    sigma by doubling or halving from 1 and then bisects the bracket
    geometrically until its ends are within 1% of each other; it returns the
    upper end, so the target is met. Since epsilon decreases with sigma, any
    sigma <= 0.99 * result misses the target.

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

    def eps(noise_multiplier):
        return accounting_epsilon.epsilon_at_rate(
            q, float(noise_multiplier), int(total), float(delta), accountant)

    # Invariant once bracketed: eps(low) > target >= eps(high).
    high = 1.0
    if eps(noise_multiplier=high) > target_epsilon:
        low = high
        while eps(noise_multiplier=high) > target_epsilon:
            low, high = high, 2 * high
            if high > _MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon!r} needs"
                    f" noise_multiplier > {_MAX_NOISE_MULTIPLIER!r}."
                )
    else:
        low = high / 2
        while eps(noise_multiplier=low) <= target_epsilon:
            low, high = low / 2, low
            if low < _MIN_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon!r} is met by every"
                    f" noise_multiplier >= {high!r}; the search gives up there."
                )
    while high > low * (1 + _NOISE_MULTIPLIER_RTOL):
        middle = math.sqrt(low * high)
        if eps(noise_multiplier=middle) <= target_epsilon:
            high = middle
        else:
            low = middle
    return high
