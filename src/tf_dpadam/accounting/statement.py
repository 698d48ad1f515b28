"""The privacy statement of a training run, TF-Privacy style.

`compute_dp_sgd_privacy_statement` reports the example-level epsilon under
both accountants, the assumptions it rests on, and optionally a user-level
epsilon from RDP group privacy.
"""

import math

from tf_dpadam.common import validation
from tf_dpadam.accounting import accountants
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import pld

# Largest RDP order used for the user-level (group privacy) bound.
_MAX_GROUP_ORDER = 4096.0


def _user_level_rdp_epsilon(q, sigma, steps, delta, max_examples_per_user):
    """User-level epsilon from RDP group privacy, or None if unavailable.

    A user with k examples changes the data set by k add/remove steps. With
    k <= 2^c, Mironov (2017, Prop. 2) turns (a, r)-RDP at order a >= 2^(c+1)
    into (a / 2^c, 3^c r)-RDP for such groups. The RDP curve of T steps is
    computed at orders 2^c * a for the base orders a >= 2 of `RDP_ORDERS`
    (up to order 4096) and converted at delta as usual.
    """
    c = max(0, math.ceil(math.log2(max_examples_per_user)))
    group = 2**c
    if group == 1:
        return _example_level_rdp(q, sigma, steps, delta)[0]
    base = [a for a in accounting_epsilon.RDP_ORDERS
            if a >= 2 and group * a <= _MAX_GROUP_ORDER]
    if not base:
        return None
    rdp = accounting_epsilon.rdp_curve(q, sigma, steps,
                                       [group * a for a in base])
    return accounting_epsilon.rdp_epsilon_and_order(3**c * rdp, delta,
                                                    base)[0]


def _example_level_rdp(q, sigma, steps, delta):
    """(epsilon, optimal order) of T steps over `RDP_ORDERS`."""
    return accounting_epsilon.rdp_epsilon_and_order(
        steps * accounting_epsilon.rdp_one_step(q, sigma), delta
    )


def compute_dp_sgd_privacy_statement(
    number_of_examples: int,
    batch_size: int,
    num_epochs: float,
    noise_multiplier: float,
    delta: float,
    used_microbatching: bool = False,
    max_examples_per_user: int | None = None,
) -> str:
    """A short human-readable statement of the privacy of a training run.

    The run is T = ceil(num_epochs * N / B) steps of
    PoissonSampledDpEvent(q = B / N, GaussianDpEvent(sigma)). The statement
    gives the example-level epsilon at `delta` under RDP (`RDP_ORDERS`) and
    PLD (value discretization 1e-3), and states the assumptions: Poisson
    sampling at rate q, per-example clipping, each example present once,
    add-or-remove-one adjacency, release of every intermediate model. Where
    PLD would need a distribution of more than `pld.MAX_PLD_POINTS`
    points (e.g. 10**8 steps at q = 256/60000, sigma = 6, or sigma < 0.19)
    its line says so instead of an epsilon; RDP costs the same at any T.

    With `used_microbatching=True` the clipped unit is a microbatch, so adding
    or removing one example can change the noised sum by 2C: the accounting
    uses sigma / 2 (TF-Privacy's convention). With `max_examples_per_user=k`
    it adds a user-level epsilon from RDP group privacy (Mironov 2017,
    Prop. 2, with k rounded up to a power of two); PLD gives no user-level
    number here.

    The signature follows TF-Privacy's function of the same name, except that
    `used_microbatching` defaults to False (our optimizers clip per example)
    and there is no `accountant_type` (both accountants are reported).

    Args:
        number_of_examples: N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        num_epochs: Number of epochs E >= 0.
        noise_multiplier: sigma > 0.
        delta: Target delta in (0, 1).
        used_microbatching: Whether gradients were clipped per microbatch of
            more than one example.
        max_examples_per_user: Optional bound k >= 1 on the examples of one
            user.

    Returns:
        A multi-line string (nothing is printed).

    Warns:
        LargeDeltaWarning (a UserWarning): if delta >= 1 / number_of_examples.

    Raises:
        ValueError: if an argument is out of range.
    """
    validation.check_sizes("number_of_examples", number_of_examples,
                           batch_size)
    validation.check_epochs(num_epochs, "num_epochs")
    validation.check_positive_real("noise_multiplier", noise_multiplier)
    validation.check_delta(delta)
    if max_examples_per_user is not None:
        validation.check_positive_int("max_examples_per_user",
                                      max_examples_per_user)
    validation.warn_large_delta(delta, number_of_examples)
    steps = accounting_epsilon.steps_for_epochs(num_epochs, number_of_examples,
                                                batch_size)
    q = batch_size / number_of_examples
    sigma = noise_multiplier / 2 if used_microbatching else noise_multiplier

    rdp_eps, rdp_order = (
        _example_level_rdp(q, float(sigma), steps, float(delta))
        if steps
        else (0.0, float("nan"))
    )

    clipping = (
        "per microbatch, with microbatching: one example moves the noised sum"
        f" by up to 2C, so the accounting uses noise multiplier {sigma:g}"
        if used_microbatching
        else "per example, without microbatching (sensitivity C)"
    )
    lines = [
        f"DP training over {number_of_examples} examples with expected batch"
        f" size {batch_size} (sampling rate q = {q:.4g}), noise multiplier"
        f" {noise_multiplier:g}, {num_epochs:g} epochs = {steps} steps.",
        "Assumptions:",
        "  - each step samples every example independently with probability q"
        " (Poisson sampling);",
        f"  - gradients are clipped to L2 norm C {clipping}, and Gaussian"
        " noise of std noise_multiplier * C is added to their sum;",
        "  - each example occurs once in the data set; neighboring data sets"
        " differ by adding or removing one example;",
        "  - every intermediate model may be released (the guarantee covers all"
        " checkpoints, not only the final model).",
        f"Example-level (epsilon, delta)-DP at delta = {delta:g}:",
        f"  epsilon = {rdp_eps:.4g} (RDP accountant, optimal order"
        f" {rdp_order:g})",
        _pld_line(q, float(sigma), steps, float(delta)),
    ]
    if max_examples_per_user is not None and max_examples_per_user > 1:
        lines += _user_level_lines(q, float(sigma), steps, delta,
                                   max_examples_per_user)
    lines.append(
        "These epsilons hold only for Poisson-sampled batches; shuffled"
        " fixed batches have no amplification by subsampling and a larger"
        " epsilon (tf_dpadam.accounting.epsilon_without_amplification)."
    )
    return "\n".join(lines)


def _pld_line(q, sigma, steps, delta):
    """The statement's line on the PLD epsilon; where PLD's distribution
    would exceed `pld.MAX_PLD_POINTS` points (huge T, or sigma below
    about 0.19), says so instead of taking seconds and GBs."""
    interval = accounting_epsilon.PLD_VALUE_DISCRETIZATION_INTERVAL
    try:
        epsilon = accounting_epsilon.epsilon_at_rate(q, sigma, steps, delta,
                                                     accountants.PLD)
    except pld.PLDTooLargeError:
        return (
            "  epsilon not computed by the PLD accountant: its privacy loss"
            " distribution would exceed MAX_PLD_POINTS ="
            f" {pld.MAX_PLD_POINTS:,} points (the RDP"
            " epsilon above is an upper bound too)"
        )
    return (f"  epsilon = {epsilon:.4g} (PLD accountant, value discretization"
            f" {interval:g})")


def _user_level_lines(q, sigma, steps, delta, max_examples_per_user):
    """The statement's lines on user-level DP (k > 1 examples per user)."""
    user_eps = (
        _user_level_rdp_epsilon(q, sigma, steps, float(delta),
                                max_examples_per_user)
        if steps
        else 0.0
    )
    lines = [
        f"User-level DP, at most {max_examples_per_user} examples per user,"
        f" add-or-remove-one-user adjacency, delta = {delta:g}:"
    ]
    if user_eps is None:
        lines.append(
            "  not available: the group is too large for RDP orders up to"
            f" {_MAX_GROUP_ORDER:g}."
        )
    else:
        lines.append(
            f"  epsilon = {user_eps:.4g} (RDP accountant with group"
            " privacy; no PLD bound)"
        )
    return lines
