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
Poisson sampling. Shuffled fixed-size batches have no such amplification
(Chua et al., ICML 2024, "How Private are DP-SGD Implementations?"): their
epsilon is that of `passes` (each pass over the data one Gaussian mechanism
per example), and `plans` says which of the two a training used.

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
about ten times faster, which matters for the calibration searches. The
one-step distribution is built once per (q, sigma) and self-composed T times
(`epsilon.pld_epsilon`, bit for bit the accountant's result).

Defaults: PLD, the tighter accountant, for `calibrate_steps`,
`calibrate_noise_multiplier`, `tf_dpadam.PrivacyBudget` and the command
line's calibrations (at q = 256/60000, sigma = 0.52, delta = 1e-5 it allows
1468 steps within epsilon = 7 against RDP's 719); `epsilon_after_steps` takes
the accountant it is given (RDP by default) and `compute_dp_sgd_privacy`
keeps TF-Privacy's RDP numbers. Every public function that computes an
epsilon with a known N warns once if delta >= 1 / N
(`tf_dpadam.common.validation.LargeDeltaWarning`).

The accountants are objects in one registry (`accountants`), the one place
their names are known: `ACCOUNTANTS` maps each name to its `Accountant`
(`accountants.RDP`, `accountants.PLD`) in the order "rdp", "pld", so
`list(ACCOUNTANTS)` is ["rdp", "pld"], the command line's choices. Every
`accountant=` argument is looked up there (`get_accountant`, whose
`ValueError` reads "Expected accountant='prv' in ('rdp', 'pld')."), and
the object, not an if/else on the name, computes: `poisson_epsilon` (T
steps), `gaussian_epsilon` (fixed batches), `ledger_epsilon` (a ledger's
composition) and the calibrations' searches (`steps_guess`,
`smallest_noise_within`: PLD starts from RDP's answer). A new accountant is
a subclass of `Accountant` in one module and one call,
`register_accountant(MyAccountant())`; every function that takes
`accountant=` then accepts its name (`unregister_accountant` removes it).

The names of the sampling choices: `SAMPLINGS` ("poisson", "shuffled";
`check_sampling` checks one).

The public constants: `ACCOUNTANTS` (above), `SAMPLINGS` (above),
`RDP_ORDERS` and `TF_PRIVACY_RDP_ORDERS` (the RDP orders above) and
`PLD_VALUE_DISCRETIZATION_INTERVAL` (1e-3, above).

Nothing here prints or imports TensorFlow. The modules:

* `epsilon`: the event, the orders and what the accountants compute with
  (`compute_dp_sgd_privacy`, `steps_for_epochs`);
* `accountants`: the accountants and their registry, and the epsilon of T
  steps by an accountant's name (`epsilon_after_steps`);
* `calibration`: `calibrate_steps` and `calibrate_noise_multiplier`;
* `statement`: `compute_dp_sgd_privacy_statement`, with user-level DP;
* `passes`: the epsilon of fixed batches, without amplification;
* `plans`: how a training's batches were drawn, and its epsilon;
* `ledger`: the privacy ledger a private model owns (segments of steps,
  each with its mechanism) and their composed epsilon.

This package re-exports their public names.
"""

from tf_dpadam.accounting import accountants
from tf_dpadam.accounting.accountants import ACCOUNTANTS
from tf_dpadam.accounting.accountants import Accountant
from tf_dpadam.accounting.accountants import epsilon_after_steps
from tf_dpadam.accounting.accountants import get_accountant
from tf_dpadam.accounting.accountants import register_accountant
from tf_dpadam.accounting.accountants import unregister_accountant
from tf_dpadam.accounting.calibration import calibrate_noise_multiplier
from tf_dpadam.accounting.calibration import calibrate_steps
from tf_dpadam.accounting.epsilon import compute_dp_sgd_privacy
from tf_dpadam.accounting.epsilon import dp_sgd_event
from tf_dpadam.accounting.epsilon import PLD_VALUE_DISCRETIZATION_INTERVAL
from tf_dpadam.accounting.epsilon import RDP_ORDERS
from tf_dpadam.accounting.epsilon import SAMPLINGS
from tf_dpadam.accounting.epsilon import check_sampling
from tf_dpadam.accounting.epsilon import steps_for_epochs
from tf_dpadam.accounting.epsilon import TF_PRIVACY_RDP_ORDERS
from tf_dpadam.accounting.epsilon import training_steps
from tf_dpadam.accounting.statement import compute_dp_sgd_privacy_statement
from tf_dpadam.accounting import ledger
from tf_dpadam.accounting import passes
from tf_dpadam.accounting import plans
from tf_dpadam.accounting.ledger import Ledger
from tf_dpadam.accounting.ledger import Mechanism
from tf_dpadam.accounting.ledger import Segment
from tf_dpadam.accounting.passes import epsilon_without_amplification

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "Ledger",
    "Mechanism",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "RDP_ORDERS",
    "SAMPLINGS",
    "Segment",
    "TF_PRIVACY_RDP_ORDERS",
    "accountants",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "check_sampling",
    "compute_dp_sgd_privacy",
    "compute_dp_sgd_privacy_statement",
    "dp_sgd_event",
    "epsilon_after_steps",
    "epsilon_without_amplification",
    "get_accountant",
    "ledger",
    "passes",
    "plans",
    "register_accountant",
    "steps_for_epochs",
    "training_steps",
    "unregister_accountant",
]
