"""The accountants, as objects in one registry that every choice reads.

An accountant turns the dp-accounting events of a training into an epsilon
(add-or-remove-one adjacency, always an upper bound). Every function of
`tf_dpadam.accounting` that takes `accountant="rdp"` or `"pld"` looks the
name up here (`get_accountant`) and asks the object; no module branches on
the name, so the accountants differ in one place only. An `Accountant`
answers:

* `poisson_epsilon`: T Poisson-sampled Gaussian steps (`epsilon_after_steps`
  and the calibrations, through the cache `epsilon.epsilon_at_rate`);
* `gaussian_epsilon`: one Gaussian mechanism (fixed batches without
  amplification, `passes`);
* `ledger_epsilon`: a ledger's composition (`ledger`), which always has an
  epsilon;
* `steps_guess` and `smallest_noise_within`: how the calibrations search
  with it (a costly accountant starts from a cheap one's answer).

The two here:

* `RDP` ("rdp"): dp-accounting's `RdpAccountant` over `RDP_ORDERS`. It
  costs the same at any T and searches from scratch.
* `PLD` ("pld"): the privacy loss distribution of `PLDAccountant`, value
  discretization 1e-3, pessimistic (`tf_dpadam.accounting.pld`). Tighter,
  but its cost grows with T and as sigma shrinks (`pld.PLDTooLargeError`
  past `pld.MAX_PLD_POINTS`), so its searches start from RDP's answer.

`ACCOUNTANTS` maps each name to its object, in the order registered ("rdp",
"pld"), which is the order of the command line's choices. A new accountant
is a subclass of `Accountant` (one module) and one line,
`register_accountant(MyAccountant())`: every `accountant=` argument and the
flags built from `ACCOUNTANTS` then accept its name.
"""

import abc
import types

import dp_accounting

from tf_dpadam.common import validation
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.accounting import pld
from tf_dpadam.accounting import search

_ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


class Accountant(abc.ABC):
    """How one accountant answers the accounting's questions.

    A subclass sets `name` (what `accountant=` and the flags spell) and
    gives the three epsilons. The searches default to a cheap accountant's
    (probing costs microseconds, so they start from scratch); a costly one
    overrides them. Arguments come already checked. An accountant is
    hashable by identity: the caches of the epsilons are keyed on it, so a
    replaced accountant never reads its predecessor's numbers.
    """

    name = ""
    # Whether one epsilon costs milliseconds or more, so that a log of every
    # batch computes it only now and then (`PrivacyBudget`'s batch logs).
    costly = False

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"

    @abc.abstractmethod
    def poisson_epsilon(self, q, sigma, steps, delta):
        """Epsilon at `delta` of T >= 1 steps, each
        PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), sigma > 0."""

    @abc.abstractmethod
    def gaussian_epsilon(self, sigma, delta):
        """Epsilon at `delta` of one GaussianDpEvent(sigma), sigma > 0."""

    @abc.abstractmethod
    def ledger_epsilon(self, poisson, gaussian_sigma, delta):
        """Epsilon at `delta` of a ledger's composition.

        Args:
            poisson: (q, sigma, T) of each Poisson mechanism, T >= 1 and
                sigma > 0 (a tuple, perhaps empty).
            gaussian_sigma: the multiplier of the one Gaussian mechanism
                the fixed-batch segments compose into, or None.
            delta: in (0, 1).

        Returns:
            A finite epsilon whatever the size of the composition: a ledger
            always has one, and it never decreases as steps are added.
        """

    def steps_guess(self, epsilon_of, target_epsilon, cap):
        """Where a search for the most steps (or participations) within
        `target_epsilon` starts (`search.largest_within`'s `start`).

        Args:
            epsilon_of: `epsilon_of(steps, accountant)`, the epsilon being
                searched, under any accountant (this one by default).
            target_epsilon: the budget.
            cap: the largest answer searched.
        """
        del epsilon_of, target_epsilon, cap  # A cheap search starts at 1.
        return 1

    def smallest_noise_within(self, epsilon_of, target_epsilon, *,
                              sampling_probability, setting):
        """`calibrate_noise_multiplier`'s search: the smallest sigma (within
        `search.NOISE_MULTIPLIER_RTOL`) whose epsilon meets the target.

        The default bisects from sigma = 1 (`search.halving_noise_search`):
        the recorded studies calibrated sigma so with RDP, and reading them
        back needs the same numbers.

        Args:
            epsilon_of: `epsilon_of(sigma, accountant)`, this accountant's
                epsilon of the training by default.
            target_epsilon: the budget.
            sampling_probability: q of the training's steps.
            setting: the training in words, for error messages.

        Raises:
            ValueError: if sigma would have to lie outside
                [`search.MIN_NOISE_MULTIPLIER`, `search.MAX_NOISE_MULTIPLIER`].
        """
        del sampling_probability, setting  # Words for a costlier search.
        return search.halving_noise_search(
            epsilon_of, target_epsilon, lowest=search.MIN_NOISE_MULTIPLIER,
            highest=search.MAX_NOISE_MULTIPLIER,
            rtol=search.NOISE_MULTIPLIER_RTOL)


class RdpAccountant(Accountant):
    """dp-accounting's `RdpAccountant` over `RDP_ORDERS`, converting with
    min over orders a of rdp(a) + log1p(-1/a) - log(delta * a) / (a - 1).

    RDP composes additively, so T steps cost one step's curve times T: the
    same at any T. Its searches are the base class's.
    """

    name = "rdp"

    def poisson_epsilon(self, q, sigma, steps, delta):
        return accounting_epsilon.rdp_epsilon_and_order(
            steps * accounting_epsilon.rdp_one_step(q, sigma), delta)[0]

    def gaussian_epsilon(self, sigma, delta):
        rdp = dp_accounting.rdp.RdpAccountant(
            list(accounting_epsilon.RDP_ORDERS), _ADD_OR_REMOVE_ONE)
        rdp.compose(dp_accounting.GaussianDpEvent(sigma))
        return accounting_epsilon.rdp_epsilon_and_order(rdp.rdp, delta)[0]

    def ledger_epsilon(self, poisson, gaussian_sigma, delta):
        rdp = sum(steps * accounting_epsilon.rdp_one_step(q, sigma)
                  for q, sigma, steps in poisson)
        if gaussian_sigma is not None:
            rdp = rdp + accounting_epsilon.rdp_curve(1.0, gaussian_sigma, 1)
        return accounting_epsilon.rdp_epsilon_and_order(rdp, delta)[0]


class PldAccountant(Accountant):
    """The privacy loss distribution of dp-accounting's `PLDAccountant`
    (value discretization `PLD_VALUE_DISCRETIZATION_INTERVAL`, pessimistic).

    Tighter than RDP, and costlier: a probe builds a distribution (up to
    about a second), and past `pld.MAX_PLD_POINTS` points it raises
    `pld.PLDTooLargeError`. So its searches start from RDP's answer (RDP's
    epsilon is the larger, and costs microseconds), and a ledger too large
    for it gets RDP's epsilon.
    """

    name = "pld"
    costly = True  # A distribution per epsilon: 10 to 100 ms.

    def poisson_epsilon(self, q, sigma, steps, delta):
        # Looked up on `epsilon`, the name's first home, where tests watch
        # the compositions.
        return accounting_epsilon.pld_epsilon(q, sigma, steps, delta)

    def gaussian_epsilon(self, sigma, delta):
        pld.check_pld_noise_multiplier(sigma)
        accountant = dp_accounting.pld.PLDAccountant(
            _ADD_OR_REMOVE_ONE,
            value_discretization_interval=(
                pld.PLD_VALUE_DISCRETIZATION_INTERVAL),
        )
        accountant.compose(dp_accounting.GaussianDpEvent(sigma))
        return float(accountant.get_epsilon(delta))

    def ledger_epsilon(self, poisson, gaussian_sigma, delta):
        try:
            return self._composed_epsilon(poisson, gaussian_sigma, delta)
        except pld.PLDTooLargeError:
            # Also an upper bound, larger than the PLD's.
            return RDP.ledger_epsilon(poisson, gaussian_sigma, delta)

    def _composed_epsilon(self, poisson, gaussian_sigma, delta):
        """`ledger_epsilon` or `pld.PLDTooLargeError`. One mechanism alone
        gives exactly the numbers of `poisson_epsilon` (cached) and
        `gaussian_epsilon`."""
        if gaussian_sigma is None and len(poisson) == 1:
            (q, sigma, steps), = poisson
            return accounting_epsilon.epsilon_at_rate(q, sigma, steps, delta,
                                                      self)
        if not poisson:
            return self.gaussian_epsilon(gaussian_sigma, delta)
        pld_lib = dp_accounting.pld.privacy_loss_distribution
        interval = pld.PLD_VALUE_DISCRETIZATION_INTERVAL
        composed = pld_lib.identity(value_discretization_interval=interval)
        for q, sigma, steps in poisson:
            composed = composed.compose(pld.pld_self_composed(q, sigma, steps))
        if gaussian_sigma is not None:
            pld.check_pld_noise_multiplier(gaussian_sigma)
            composed = composed.compose(pld_lib.from_gaussian_mechanism(
                standard_deviation=gaussian_sigma,
                value_discretization_interval=interval,
                neighboring_relation=_ADD_OR_REMOVE_ONE))
        return float(composed.get_epsilon_for_delta(delta))

    def steps_guess(self, epsilon_of, target_epsilon, cap):
        """RDP's answer, at most PLD's: PLD is probed only near it."""
        return search.largest_within(
            lambda steps: epsilon_of(steps, RDP), target_epsilon, cap=cap)

    def smallest_noise_within(self, epsilon_of, target_epsilon, *,
                              sampling_probability, setting):
        """From RDP's answer (`search.smallest_noise_within`), never below
        the smallest sigma PLD builds a step for.

        Raises:
            PLDTooLargeError (a ValueError): if sigma near the answer is
                too small for PLD, or its steps too many at that sigma.
        """
        start, smallest = 1.0, search.MIN_NOISE_MULTIPLIER
        try:
            start = search.smallest_noise_within(
                lambda sigma: epsilon_of(sigma, RDP), target_epsilon,
                start)[0]
        except ValueError:
            pass  # PLD's search says why, from 1.
        smallest = max(smallest,
                       pld.smallest_pld_noise_multiplier(sampling_probability))
        # Where PLD cannot account RDP's answer, it cannot account its own
        # (as small or a little larger) without many probes, each building
        # a distribution: say so at once.
        start = max(start, smallest)
        try:
            epsilon_of(start)
        except pld.PLDTooLargeError as error:
            raise pld.PLDTooLargeError(
                f"target_epsilon={target_epsilon!r} over {setting} needs a"
                f" noise multiplier near {start:.4g} (RDP's), which the PLD"
                f" accountant cannot account: {error}"
            ) from error
        too_large = {}
        sigma, below = search.smallest_noise_within(
            search.inf_beyond_pld_limit(epsilon_of, too_large),
            target_epsilon, start, smallest)
        if below is None and smallest > search.MIN_NOISE_MULTIPLIER:
            raise pld.PLDTooLargeError(
                f"target_epsilon={target_epsilon!r} is met by"
                f" noise_multiplier={sigma!r}, the smallest that the PLD"
                f" accountant accounts ({setting}); use accountant=\"rdp\""
                " for a smaller one."
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


RDP = RdpAccountant()
PLD = PldAccountant()

_REGISTRY = {}
# Name -> `Accountant`, read-only (`register_accountant` adds), in the order
# registered: the order of the flags' choices.
ACCOUNTANTS = types.MappingProxyType(_REGISTRY)


def get_accountant(name):
    """The accountant registered under `name`.

    Raises:
        ValueError: "Expected accountant={name!r} in ('rdp', 'pld')." (the
            registered names), if `name` is not one.
    """
    validation.check(isinstance(name, str) and name in _REGISTRY,
                     "accountant", name, f"in {tuple(_REGISTRY)}")
    return _REGISTRY[name]


def register_accountant(accountant):
    """Registers `accountant` under its `name`, after those registered.

    Returns:
        `accountant`.

    Raises:
        ValueError: if it is not an `Accountant`, or its name is not a
            non-empty string or is taken.
    """
    validation.check(isinstance(accountant, Accountant), "accountant",
                     accountant, "to be an Accountant")
    name = accountant.name
    validation.check(isinstance(name, str) and name, "accountant.name", name,
                     "to be a non-empty string")
    validation.check(name not in _REGISTRY, "accountant.name", name,
                     f"not to be taken (registered: {tuple(_REGISTRY)})")
    _REGISTRY[name] = accountant
    return accountant


def unregister_accountant(name):
    """Removes the accountant registered under `name` (a test's or a
    plugin's; `ValueError` as `get_accountant` if there is none)."""
    get_accountant(name)
    del _REGISTRY[name]


register_accountant(RDP)
register_accountant(PLD)


def epsilon_after_steps(
    *,
    steps: int,
    num_examples: int,
    batch_size: int,
    noise_multiplier: float,
    delta: float,
    accountant: str = "rdp",
    bands: int = 1,
) -> float:
    """Epsilon after T Poisson-sampled Gaussian steps.

    Composes SelfComposedDpEvent(PoissonSampledDpEvent(q,
    GaussianDpEvent(sigma)), T), q = batch_size / num_examples, under
    add-or-remove-one adjacency and returns the epsilon at `delta`:

    * "rdp": `RdpAccountant` over `RDP_ORDERS` (1.05 to 10.95 in steps of
      0.05, 11 to 63, and 64 to 1024), minimizing over orders
      rdp(a) + log1p(-1/a) - log(delta * a) / (a - 1).
    * "pld": the PLD of `PLDAccountant` with value discretization interval
      `PLD_VALUE_DISCRETIZATION_INTERVAL` (1e-3, pessimistic), the one-step
      distribution cached (`pld_epsilon`).
    * any other name in `ACCOUNTANTS` (`register_accountant`).

    Results are cached per argument tuple. RDP costs the same at any T; PLD
    refuses a distribution of more than `MAX_PLD_POINTS` points (at most
    about a second), e.g. 10**8 steps at q = 256/60000 and sigma = 6, or
    sigma < 0.192 for q < 1 (`pld.check_pld_noise_multiplier`).

    Args:
        steps: Number of steps T >= 0; T = 0 gives 0.0.
        num_examples: N > 0.
        batch_size: Expected batch size B, 0 < B <= N.
        noise_multiplier: sigma > 0.
        delta: Target delta in (0, 1).
        accountant: "rdp" or "pld" (a name in `ACCOUNTANTS`).
        bands: b, the bands of a correlated `noise_strategy` on cyclic
            Poisson batches of b groups: T steps are then ceil(T / b) steps
            at q = min(1, b B / N) (`epsilon.banded_dp_sgd_event`, as the
            ledger counts them).

    Returns:
        epsilon as a float (`inf` if the accountant cannot bound it).

    Warns:
        LargeDeltaWarning (a UserWarning): if delta >= 1 / num_examples.

    Raises:
        ValueError: if an argument is out of range.
        PLDTooLargeError (a ValueError): for "pld", if its distribution
            would have more than `MAX_PLD_POINTS` points.
    """
    validation.check_steps(steps)
    validation.check_sizes("num_examples", num_examples, batch_size)
    validation.check_positive_real("noise_multiplier", noise_multiplier)
    validation.check_delta(delta)
    validation.check_positive_int("bands", bands)
    chosen = get_accountant(accountant)
    validation.warn_large_delta(delta, num_examples)
    return accounting_epsilon.epsilon_at_rate(
        accounting_epsilon.cyclic_sampling_probability(
            batch_size, num_examples, bands),
        float(noise_multiplier),
        accounting_epsilon.cyclic_rounds(steps, bands),
        float(delta),
        chosen,
    )
