"""Privacy accounting for DP training with Poisson-sampled Gaussian steps.

One training step of DP-SGD / DP-Adam samples every example independently
with probability q = B / N (B the expected batch size, N the number of
examples), clips each example's gradient to L2 norm C and adds Gaussian noise
N(0, sigma^2 C^2 I) to the sum of the clipped gradients. As a dp-accounting
event this is

    PoissonSampledDpEvent(q, GaussianDpEvent(sigma)),

and T steps are that event self-composed T times:

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), T).

An accountant (dp-accounting's `RdpAccountant` or `PLDAccountant`, both under
add-or-remove-one adjacency) turns the event into an epsilon for a given delta.
Every (epsilon, delta) reported here is therefore the guarantee of releasing
all T intermediate models, under the assumption that batches are formed by
Poisson sampling. With shuffled fixed-size batches the same numbers are the
customary approximation, not a proven bound.

RDP orders:

* `compute_dp_sgd_privacy` uses TF-Privacy's own list for that function,
  `TF_PRIVACY_RDP_ORDERS` = [1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 4.5] +
  [5, 6, ..., 63] + [128, 256, 512], so that it returns TF-Privacy's numbers.
* Everything else uses the denser `RDP_ORDERS` = [1.05, 1.10, ..., 10.95]
  (step 0.05) + [11, 12, ..., 63] + [64, 96, 128, 192, 256, 384, 512, 768,
  1024]. A denser list can only lower the reported epsilon, since epsilon is
  the minimum over orders.

PLD: the `PLDAccountant` uses a value discretization interval of
`PLD_VALUE_DISCRETIZATION_INTERVAL` = 1e-3 with pessimistic rounding, so its
epsilon is still an upper bound; against dp-accounting's default of 1e-4 it
is at most about 0.5% larger on the settings we measured (e.g. MNIST with
q = 256/60000, sigma = 1.1, 14,063 steps: 2.3906 against 2.3818), and it is
about ten times faster, which matters for the calibration searches.

This module prints nothing and does not import TensorFlow.
"""

import contextlib
import functools
import logging
import math
import numbers

import dp_accounting

# The orders TF-Privacy's `compute_dp_sgd_privacy` uses.
TF_PRIVACY_RDP_ORDERS = (
    (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5)
    + tuple(float(a) for a in range(5, 64))
    + (128.0, 256.0, 512.0)
)

# The dense list used by every other function of this module.
RDP_ORDERS = (
    tuple(1 + x / 20.0 for x in range(1, 200))
    + tuple(float(a) for a in range(11, 64))
    + (64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0)
)

# Value discretization interval of the PLD accountant (see the module doc).
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3

ACCOUNTANTS = ("rdp", "pld")

# The searches give up past these bounds (see `calibrate_steps` and
# `calibrate_noise_multiplier`).
_MAX_STEPS = 2**40
_MIN_NOISE_MULTIPLIER = 1e-3
_MAX_NOISE_MULTIPLIER = 1e6
# `calibrate_noise_multiplier` returns sigma within this relative tolerance.
_NOISE_MULTIPLIER_RTOL = 0.01
# Largest RDP order used for the user-level (group privacy) bound.
_MAX_GROUP_ORDER = 4096.0

_ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


# --------------------------------------------------------------------------
# Validation.


def _check(condition, name, value, expectation):
    if not condition:
        raise ValueError(f"Expected {name}={value!r} {expectation}.")


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive_int(name, value):
    _check(_is_int(value), name, value, "to be an integer")
    _check(value > 0, name, value, "> 0")


def _check_positive_real(name, value):
    _check(_is_real(value), name, value, "to be a real number")
    _check(math.isfinite(value) and value > 0, name, value, "> 0")


def _check_sizes(n_name, n, batch_size):
    _check_positive_int(n_name, n)
    _check_positive_int("batch_size", batch_size)
    _check(
        batch_size <= n,
        "batch_size",
        batch_size,
        f"<= {n_name}={n!r} (the sampling rate batch_size / {n_name} must be"
        " at most 1)",
    )


def _check_delta(delta):
    _check(_is_real(delta), "delta", delta, "to be a real number")
    _check(0 < delta < 1, "delta", delta, "in (0, 1)")


def _check_steps(steps):
    _check(_is_int(steps), "steps", steps, "to be an integer")
    _check(steps >= 0, "steps", steps, ">= 0")


def _check_epochs(epochs, name="epochs"):
    _check(_is_real(epochs), name, epochs, "to be a real number")
    _check(math.isfinite(epochs) and epochs >= 0, name, epochs, ">= 0")


def _check_accountant(accountant):
    _check(
        accountant in ACCOUNTANTS, "accountant", accountant, f"in {ACCOUNTANTS}"
    )


# --------------------------------------------------------------------------
# Events and accountants.


def steps_for_epochs(epochs, num_examples, batch_size):
    """Returns the number of steps of `epochs` passes: ceil(epochs * N / B).

    This is TF-Privacy's convention. A product within 1e-9 (relative) of an
    integer is rounded to it first, so that e.g. epochs=0.1, N=3000, B=100
    gives 3 steps rather than the 4 that ceil(3.0000000000000004) would give.

    Args:
        epochs: E >= 0, may be fractional.
        num_examples: N > 0.
        batch_size: B, 0 < B <= N.

    Returns:
        The integer number of steps T.

    Raises:
        ValueError: if an argument is out of range.
    """
    _check_sizes("num_examples", num_examples, batch_size)
    _check_epochs(epochs)
    exact = epochs * num_examples / batch_size
    nearest = round(exact)
    if abs(exact - nearest) <= 1e-9 * max(1.0, abs(exact)):
        return int(nearest)
    return int(math.ceil(exact))


def dp_sgd_event(sampling_probability, noise_multiplier, steps):
    """Returns the dp-accounting event of T Poisson-sampled Gaussian steps.

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), T).
    """
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sampling_probability,
            dp_accounting.GaussianDpEvent(noise_multiplier),
        ),
        steps,
    )


class _DropNonConvergence(logging.Filter):
    """Drops dp-accounting's warnings that an RDP order was excluded.

    For small sigma the series of a few low fractional orders does not
    converge; dp-accounting then sets their RDP to inf (so the epsilon, a
    minimum over the other orders, stays valid) and logs a warning per order.
    The searches probe such sigmas routinely, so the warnings are noise here.
    """

    def filter(self, record):
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_non_convergence():
    logger = logging.getLogger("absl")
    drop = _DropNonConvergence()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@functools.lru_cache(maxsize=512)
def _rdp_one_step(q, sigma):
    """The RdpAccountant's RDP curve (on `RDP_ORDERS`) after one step."""
    accountant = dp_accounting.rdp.RdpAccountant(
        list(RDP_ORDERS), _ADD_OR_REMOVE_ONE
    )
    with _quiet_non_convergence():
        accountant.compose(dp_sgd_event(q, sigma, 1))
    rdp = accountant.rdp
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon_and_order(q, sigma, steps, delta, orders=RDP_ORDERS, rdp=None):
    """Epsilon and optimal order from T times the one-step RDP curve."""
    if rdp is None:
        rdp = steps * _rdp_one_step(q, sigma)
    epsilon, order = dp_accounting.rdp.compute_epsilon(list(orders), rdp, delta)
    return float(epsilon), float(order)


@functools.lru_cache(maxsize=4096)
def _epsilon(q, sigma, steps, delta, accountant):
    """Cached epsilon of T steps; arguments already validated."""
    if steps == 0:
        return 0.0
    if accountant == "rdp":
        # RDP composes additively, and the RdpAccountant's curve for the T-fold
        # SelfComposedDpEvent is exactly T times (bit for bit) its curve for
        # one step. Composing the step once per (q, sigma) and scaling makes a
        # search over T cost one accountant call instead of one per probe.
        return _rdp_epsilon_and_order(q, sigma, steps, delta)[0]
    pld = dp_accounting.pld.PLDAccountant(
        _ADD_OR_REMOVE_ONE,
        value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL,
    )
    pld.compose(dp_sgd_event(q, sigma, steps))
    return float(pld.get_epsilon(delta))


# --------------------------------------------------------------------------
# Public API.


def compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta):
    """Epsilon of DP-SGD, with the same numbers as TF-Privacy's function.

    The event SelfComposedDpEvent(PoissonSampledDpEvent(q,
    GaussianDpEvent(sigma)), T) with q = batch_size / n and
    T = ceil(epochs * n / batch_size) goes to an `RdpAccountant` over
    `TF_PRIVACY_RDP_ORDERS` ([1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 4.5] +
    [5, ..., 63] + [128, 256, 512], the list of TF-Privacy's
    `compute_dp_sgd_privacy`), which converts RDP to (epsilon, delta) with
    the bound of Canonne, Kamath & Steinke (2020), Prop. 12:

        epsilon = min_a  rdp(a) + log1p(-1/a) - log(delta * a) / (a - 1).

    For example (60000, 256, 1.1, 60, 1e-5) gives (2.59708, 8.0) and
    (60000, 256, 1.0, 15, 1e-5) gives (1.57107, 10.0), equal to
    tensorflow-privacy 0.9.0's values to about 1e-13 (relative). At these
    (integer) orders dp-accounting 0.4.3 and 0.6 agree; they differ by about
    1e-8 at fractional orders. With a denser list of orders (e.g. one with
    8.1 or 9.7) the epsilons would be smaller: 2.59666 and 1.55985.

    Unlike TF-Privacy's function this prints nothing.

    Args:
        n: Number of training examples, N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        noise_multiplier: sigma > 0.
        epochs: Number of epochs E >= 0 (may be fractional).
        delta: Target delta in (0, 1).

    Returns:
        (epsilon, optimal RDP order), both floats.

    Raises:
        ValueError: if an argument is out of range.
    """
    _check_sizes("n", n, batch_size)
    _check_positive_real("noise_multiplier", noise_multiplier)
    _check_epochs(epochs)
    _check_delta(delta)
    steps = steps_for_epochs(epochs, n, batch_size)
    accountant = dp_accounting.rdp.RdpAccountant(
        list(TF_PRIVACY_RDP_ORDERS), _ADD_OR_REMOVE_ONE
    )
    with _quiet_non_convergence():
        accountant.compose(
            dp_sgd_event(batch_size / n, noise_multiplier, steps)
        )
    epsilon, order = accountant.get_epsilon_and_optimal_order(delta)
    return float(epsilon), float(order)


def epsilon_after_steps(
    *,
    steps,
    num_examples,
    batch_size,
    noise_multiplier,
    delta,
    accountant="rdp",
):
    """Epsilon after T Poisson-sampled Gaussian steps.

    Composes SelfComposedDpEvent(PoissonSampledDpEvent(q,
    GaussianDpEvent(sigma)), T), q = batch_size / num_examples, under
    add-or-remove-one adjacency and returns the epsilon at `delta`:

    * "rdp": `RdpAccountant` over `RDP_ORDERS` (1.05 to 10.95 in steps of
      0.05, 11 to 63, and 64 to 1024), minimizing over orders
      rdp(a) + log1p(-1/a) - log(delta * a) / (a - 1).
    * "pld": `PLDAccountant` with value discretization interval
      `PLD_VALUE_DISCRETIZATION_INTERVAL` (1e-3, pessimistic).

    Results are cached per argument tuple.

    Args:
        steps: Number of steps T >= 0; T = 0 gives 0.0.
        num_examples: N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        noise_multiplier: sigma > 0.
        delta: Target delta in (0, 1).
        accountant: "rdp" or "pld".

    Returns:
        epsilon as a float (`inf` if the accountant cannot bound it).

    Raises:
        ValueError: if an argument is out of range.
    """
    _check_steps(steps)
    _check_sizes("num_examples", num_examples, batch_size)
    _check_positive_real("noise_multiplier", noise_multiplier)
    _check_delta(delta)
    _check_accountant(accountant)
    return _epsilon(
        batch_size / num_examples,
        float(noise_multiplier),
        int(steps),
        float(delta),
        accountant,
    )


def calibrate_steps(
    *,
    target_epsilon,
    num_examples,
    batch_size,
    noise_multiplier,
    delta,
    accountant="rdp",
):
    """The largest number of steps T whose epsilon stays within the target.

    Returns T >= 1 with

        epsilon(T) <= target_epsilon < epsilon(T + 1),

    where epsilon(T) is `epsilon_after_steps(steps=T, ...)` (so RDP over
    `RDP_ORDERS`, or PLD with value discretization 1e-3). The search first
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
        accountant: "rdp" or "pld".

    Returns:
        T as an int.

    Raises:
        ValueError: if an argument is out of range, if even one step exceeds
            the target (the message gives epsilon(1), the smallest epsilon of
            any training), or if epsilon stays within the target for 2**40
            steps.
    """
    _check_positive_real("target_epsilon", target_epsilon)
    _check_sizes("num_examples", num_examples, batch_size)
    _check_positive_real("noise_multiplier", noise_multiplier)
    _check_delta(delta)
    _check_accountant(accountant)

    def eps(steps):
        return epsilon_after_steps(
            steps=steps,
            num_examples=num_examples,
            batch_size=batch_size,
            noise_multiplier=noise_multiplier,
            delta=delta,
            accountant=accountant,
        )

    smallest = eps(1)
    if smallest > target_epsilon:
        raise ValueError(
            f"Expected target_epsilon={target_epsilon!r} >= {smallest!r}, the"
            " epsilon of a single step (the smallest epsilon reachable with"
            f" noise_multiplier={noise_multiplier!r},"
            f" batch_size={batch_size!r}, num_examples={num_examples!r} and"
            f" delta={delta!r})."
        )
    low, high = 1, 2  # Invariant: eps(low) <= target < eps(high).
    while eps(high) <= target_epsilon:
        low, high = high, 2 * high
        if high > _MAX_STEPS:
            raise ValueError(
                f"epsilon stays <= target_epsilon={target_epsilon!r} for"
                f" {low} steps; the search gives up there."
            )
    while high - low > 1:
        middle = (low + high) // 2
        if eps(middle) <= target_epsilon:
            low = middle
        else:
            high = middle
    return low


def calibrate_noise_multiplier(
    *,
    target_epsilon,
    num_examples,
    batch_size,
    epochs=None,
    steps=None,
    delta,
    accountant="rdp",
):
    """The smallest noise multiplier (within 1%) that meets the target.

    With T = `steps`, or T = ceil(epochs * N / B), returns sigma with

        epsilon(sigma) <= target_epsilon < epsilon(sigma / 1.01),

    where epsilon(sigma) is `epsilon_after_steps(steps=T, ...)` (RDP over
    `RDP_ORDERS`, or PLD with value discretization 1e-3). The search brackets
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
        accountant: "rdp" or "pld".

    Returns:
        sigma as a float.

    Raises:
        ValueError: if an argument is out of range, if not exactly one of
            `epochs` and `steps` is given, or if sigma would have to lie
            outside [1e-3, 1e6].
    """
    _check_positive_real("target_epsilon", target_epsilon)
    _check_sizes("num_examples", num_examples, batch_size)
    _check_delta(delta)
    _check_accountant(accountant)
    if (epochs is None) == (steps is None):
        raise ValueError(
            f"Expected exactly one of epochs={epochs!r} and steps={steps!r} to"
            " be given."
        )
    if epochs is not None:
        _check_epochs(epochs)
        _check(epochs > 0, "epochs", epochs, "> 0")
        steps = steps_for_epochs(epochs, num_examples, batch_size)
    else:
        _check_steps(steps)
        _check(steps > 0, "steps", steps, "> 0")

    def eps(sigma):
        return epsilon_after_steps(
            steps=steps,
            num_examples=num_examples,
            batch_size=batch_size,
            noise_multiplier=sigma,
            delta=delta,
            accountant=accountant,
        )

    # Invariant once bracketed: eps(low) > target >= eps(high).
    high = 1.0
    if eps(high) > target_epsilon:
        low = high
        while eps(high) > target_epsilon:
            low, high = high, 2 * high
            if high > _MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon!r} needs"
                    f" noise_multiplier > {_MAX_NOISE_MULTIPLIER!r}."
                )
    else:
        low = high / 2
        while eps(low) <= target_epsilon:
            low, high = low / 2, low
            if low < _MIN_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon!r} is met by every"
                    f" noise_multiplier >= {high!r}; the search gives up there."
                )
    while high > low * (1 + _NOISE_MULTIPLIER_RTOL):
        middle = math.sqrt(low * high)
        if eps(middle) <= target_epsilon:
            high = middle
        else:
            low = middle
    return high


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
        return _rdp_epsilon_and_order(q, sigma, steps, delta)[0]
    base = [a for a in RDP_ORDERS if a >= 2 and group * a <= _MAX_GROUP_ORDER]
    if not base:
        return None
    accountant = dp_accounting.rdp.RdpAccountant(
        [group * a for a in base], _ADD_OR_REMOVE_ONE
    )
    with _quiet_non_convergence():
        accountant.compose(dp_sgd_event(q, sigma, steps))
    return _rdp_epsilon_and_order(
        q, sigma, steps, delta, orders=base, rdp=3**c * accountant.rdp
    )[0]


def compute_dp_sgd_privacy_statement(
    number_of_examples,
    batch_size,
    num_epochs,
    noise_multiplier,
    delta,
    used_microbatching=False,
    max_examples_per_user=None,
):
    """A short human-readable statement of the privacy of a training run.

    The run is T = ceil(num_epochs * N / B) steps of
    PoissonSampledDpEvent(q = B / N, GaussianDpEvent(sigma)). The statement
    gives the example-level epsilon at `delta` under RDP (`RDP_ORDERS`) and
    PLD (value discretization 1e-3), and states the assumptions: Poisson
    sampling at rate q, per-example clipping, each example present once,
    add-or-remove-one adjacency, release of every intermediate model.

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

    Raises:
        ValueError: if an argument is out of range.
    """
    _check_sizes("number_of_examples", number_of_examples, batch_size)
    _check_epochs(num_epochs, "num_epochs")
    _check_positive_real("noise_multiplier", noise_multiplier)
    _check_delta(delta)
    if max_examples_per_user is not None:
        _check_positive_int("max_examples_per_user", max_examples_per_user)
    steps = steps_for_epochs(num_epochs, number_of_examples, batch_size)
    q = batch_size / number_of_examples
    sigma = noise_multiplier / 2 if used_microbatching else noise_multiplier

    rdp_eps, rdp_order = (
        _rdp_epsilon_and_order(q, float(sigma), steps, float(delta))
        if steps
        else (0.0, float("nan"))
    )
    pld_eps = _epsilon(q, float(sigma), steps, float(delta), "pld")

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
        f"  epsilon = {pld_eps:.4g} (PLD accountant, value discretization"
        f" {PLD_VALUE_DISCRETIZATION_INTERVAL:g})",
    ]
    if max_examples_per_user is not None and max_examples_per_user > 1:
        user_eps = (
            _user_level_rdp_epsilon(
                q, float(sigma), steps, float(delta), max_examples_per_user
            )
            if steps
            else 0.0
        )
        lines.append(
            f"User-level DP, at most {max_examples_per_user} examples per user,"
            f" add-or-remove-one-user adjacency, delta = {delta:g}:"
        )
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
    lines.append(
        "If batches were drawn by shuffling rather than Poisson sampling,"
        " these epsilons are the usual approximation, not a proven bound."
    )
    return "\n".join(lines)
