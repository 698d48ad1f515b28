"""Epsilon of T Poisson-sampled Gaussian steps, from dp-accounting.

The event of one step is PoissonSampledDpEvent(q, GaussianDpEvent(sigma)) and
T steps are it self-composed T times (`dp_sgd_event`). `RdpAccountant` and
`PLDAccountant` turn it into an epsilon under add-or-remove-one adjacency;
the orders and the PLD discretization are described in `tf_dpadam.accounting`.
The accountants themselves are objects (`tf_dpadam.accounting.accountants`,
which holds `epsilon_after_steps`, the epsilon by an accountant's name); this
module is what they are built from, and knows none of them.

`compute_dp_sgd_privacy`, `steps_for_epochs` and `training_steps` check
their arguments; the lower-level functions (`rdp_curve`, `rdp_one_step`,
`rdp_epsilon_and_order`, `epsilon_at_rate`) take them as already checked,
for the accountants, the calibration and the statement.

Cost: RDP costs the same at any T (the one-step curve times T); PLD's
(`tf_dpadam.accounting.pld`) grows with T and as sigma shrinks, and it
raises `PLDTooLargeError` (a `ValueError`) rather than take more than about
a second.
"""

import contextlib
import functools
import logging
import math

import dp_accounting

from tf_dpadam.common import validation
# The PLD accountant's computations (`pld`); their names were here first,
# and still are (`accountants.PLD` calls `pld_epsilon` here).
from tf_dpadam.accounting.pld import MAX_PLD_POINTS  # noqa: F401
from tf_dpadam.accounting.pld import PLD_VALUE_DISCRETIZATION_INTERVAL
from tf_dpadam.accounting.pld import PLDTooLargeError  # noqa: F401
from tf_dpadam.accounting.pld import pld_epsilon  # noqa: F401
from tf_dpadam.accounting.pld import pld_one_step  # noqa: F401

# The orders TF-Privacy's `compute_dp_sgd_privacy` uses.
TF_PRIVACY_RDP_ORDERS = (
    (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5)
    + tuple(float(a) for a in range(5, 64))
    + (128.0, 256.0, 512.0)
)

# The dense list used by every other function of the accounting.
RDP_ORDERS = (
    tuple(1 + x / 20.0 for x in range(1, 200))
    + tuple(float(a) for a in range(11, 64))
    + (64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0)
)

_ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def steps_for_epochs(epochs: float, num_examples: int, batch_size: int) -> int:
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
        ValueError: if an argument is out of range, or epochs * N / B
            overflows.
    """
    validation.check_sizes("num_examples", num_examples, batch_size)
    validation.check_epochs(epochs)
    exact = epochs * num_examples / batch_size
    validation.check(math.isfinite(exact), "epochs", epochs,
                     "to give a finite number of steps")
    nearest = round(exact)
    if abs(exact - nearest) <= 1e-9 * max(1.0, abs(exact)):
        return int(nearest)
    return int(math.ceil(exact))


def training_steps(
    *,
    num_examples: int,
    batch_size: int,
    epochs: float | None = None,
    steps: int | None = None,
) -> int:
    """T of a training given by exactly one of `epochs` and `steps`.

    Args:
        num_examples: N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        epochs: Number of epochs E > 0, giving T = `steps_for_epochs(E, N, B)`.
        steps: Number of steps T > 0.

    Returns:
        T as an int.

    Raises:
        ValueError: if not exactly one of `epochs` and `steps` is given, or
            if it is out of range.
    """
    if (epochs is None) == (steps is None):
        raise ValueError(
            f"Expected exactly one of epochs={epochs!r} and steps={steps!r} to"
            " be given."
        )
    if epochs is not None:
        validation.check_epochs(epochs)
        validation.check(epochs > 0, "epochs", epochs, "> 0")
        return steps_for_epochs(epochs, num_examples, batch_size)
    validation.check_steps(steps)
    validation.check(steps > 0, "steps", steps, "> 0")
    return steps


def dp_sgd_event(
    sampling_probability: float,
    noise_multiplier: float,
    steps: int,
) -> dp_accounting.DpEvent:
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


def cyclic_sampling_probability(batch_size, num_examples, bands=1):
    """q of one step: B / N, or with cyclic Poisson sampling over b =
    `bands` groups (b > 1) the rate of a step's group, min(1, b B / N)."""
    if bands == 1:
        return batch_size / num_examples
    return min(1.0, bands * batch_size / num_examples)


def cyclic_rounds(steps, bands=1):
    """The Poisson-sampled steps of DP-SGD that T = `steps` steps of banded
    noise with cyclic Poisson sampling over b = `bands` groups count as:
    ceil(T / b) (T for b = 1; `banded_dp_sgd_event`)."""
    return -(-int(steps) // int(bands))


def banded_dp_sgd_event(
    group_sampling_probability: float,
    noise_multiplier: float,
    steps: int,
    bands: int,
) -> dp_accounting.DpEvent:
    """The event of T steps of banded correlated noise (b bands, the
    strategy's columns of norm 1) with cyclic Poisson sampling over b groups.

    Choquette-Choo, McMahan, Rush & Thakurta (2023, arXiv 2306.08153,
    "Amplified banded matrix factorization"): when the data are split into
    b groups, step t samples each example of group t mod b with probability
    q (= b B / N), and the strategy matrix has at most b bands, the columns
    of an example's steps (at least b apart) do not overlap, and the
    mechanism is DP-SGD with ceil(T / b) steps, each Poisson-sampled at q,
    of noise multiplier sigma: `dp_sgd_event(q, sigma, ceil(T / b))`. With
    one band it is `dp_sgd_event(q, sigma, T)`.
    """
    validation.check_positive_int("bands", bands)
    validation.check_steps(steps)
    return dp_sgd_event(group_sampling_probability, noise_multiplier,
                        cyclic_rounds(steps, bands))


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


def rdp_curve(q, sigma, steps, orders=RDP_ORDERS):
    """The RdpAccountant's RDP at `orders` after T steps, as an array.

    dp-accounting's warnings about orders whose series does not converge are
    dropped (those orders get RDP inf and so never attain the minimum).
    """
    accountant = dp_accounting.rdp.RdpAccountant(
        list(orders), _ADD_OR_REMOVE_ONE
    )
    with _quiet_non_convergence():
        accountant.compose(dp_sgd_event(q, sigma, steps))
    return accountant.rdp


@functools.lru_cache(maxsize=512)
def rdp_one_step(q, sigma):
    """The RdpAccountant's RDP curve (on `RDP_ORDERS`) after one step.

    Read-only and cached per (q, sigma): RDP composes additively, and the
    RdpAccountant's curve for the T-fold SelfComposedDpEvent is exactly T
    times (bit for bit) its curve for one step. Composing the step once per
    (q, sigma) and scaling makes a search over T cost one accountant call
    instead of one per probe.
    """
    rdp = rdp_curve(q, sigma, 1)
    rdp.setflags(write=False)
    return rdp


def rdp_epsilon_and_order(rdp, delta, orders=RDP_ORDERS):
    """(epsilon, optimal order) at `delta` of the RDP curve `rdp` on `orders`.

    dp-accounting's conversion, the bound of Canonne, Kamath & Steinke
    (2020), Prop. 12:

        epsilon = min_a  rdp(a) + log1p(-1/a) - log(delta * a) / (a - 1).
    """
    epsilon, order = dp_accounting.rdp.compute_epsilon(list(orders), rdp, delta)
    return float(epsilon), float(order)


@functools.lru_cache(maxsize=4096)
def epsilon_at_rate(q, sigma, steps, delta, accountant):
    """Cached epsilon of T steps at sampling rate q; arguments not checked.

    `accountant` is an `accountants.Accountant` (the cache's key, so a name
    registered again never reads the numbers of the accountant it had).

    Raises:
        PLDTooLargeError: for PLD beyond `MAX_PLD_POINTS` (`pld_epsilon`).
    """
    if steps == 0:
        return 0.0
    return accountant.poisson_epsilon(q, sigma, steps, delta)


SAMPLINGS = ("poisson", "shuffled")


def check_sampling(sampling: str) -> None:
    """Raises `ValueError` unless `sampling` is one of `SAMPLINGS`."""
    validation.check(sampling in SAMPLINGS, "sampling", sampling,
                     f"to be one of {SAMPLINGS}")


def compute_dp_sgd_privacy(
    n: int,
    batch_size: int,
    noise_multiplier: float,
    epochs: float,
    delta: float,
    *,
    sampling: str = "poisson",
) -> tuple[float, float]:
    """Epsilon of DP-SGD, with the same numbers as TF-Privacy's function.

    It assumes Poisson sampling (`sampling="poisson"`, TF-Privacy's
    assumption): each step draws every example with probability
    q = batch_size / n, as tf_dpadam's Poisson batches do (the default of a
    private model's `fit` on in-memory data). Shuffled fixed-size batches
    have no such amplification: `sampling="shuffled"` gives their epsilon,
    each of the ceil(T / ceil(n / batch_size)) passes one Gaussian mechanism
    per example (`tf_dpadam.accounting.passes`), on the same orders.

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
        (epsilon, optimal RDP order), both floats; (0.0, nan) for no step
        (e.g. epochs=0).

    Warns:
        LargeDeltaWarning (a UserWarning): if delta >= 1 / n.

    Raises:
        ValueError: if an argument is out of range.
    """
    validation.check_sizes("n", n, batch_size)
    validation.check_positive_real("noise_multiplier", noise_multiplier)
    validation.check_epochs(epochs)
    validation.check_delta(delta)
    check_sampling(sampling)
    validation.warn_large_delta(delta, n)
    steps = steps_for_epochs(epochs, n, batch_size)
    if steps == 0:
        return 0.0, math.nan
    if sampling == "shuffled":
        passes = math.ceil(steps / math.ceil(n / batch_size))
        rdp = passes * rdp_curve(1.0, noise_multiplier, 1,
                                 TF_PRIVACY_RDP_ORDERS)
    else:
        rdp = rdp_curve(batch_size / n, noise_multiplier, steps,
                        TF_PRIVACY_RDP_ORDERS)
    return rdp_epsilon_and_order(rdp, delta, TF_PRIVACY_RDP_ORDERS)
